"""Benchmarks: run `python -m benchmarks.<name>` from the repository root."""
