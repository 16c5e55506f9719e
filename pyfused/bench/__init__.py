"""Microbenchmark harness and CLI (``python -m pyfused.bench``)."""
