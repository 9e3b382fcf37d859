"""Data that ships inside packages, and the corpora built from it."""
