"""Benchmarks: our code against a reference in the same run (``python -m kvresearch.bench.<name>``)."""
