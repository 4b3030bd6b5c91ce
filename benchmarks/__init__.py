"""The benchmark suite: `python -m benchmarks NAME [options]` (see `benchmarks/README.md`)."""
