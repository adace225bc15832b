"""nanguard benchmark suite: ``python -m benchmarks.overhead`` (see BENCHMARKS.md)."""
