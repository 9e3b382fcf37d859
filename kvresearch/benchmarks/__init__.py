"""Benchmarks: sample generators and loaders in kvpress's schema, and their metrics."""
