"""Tools for benchmarks and tests: model directories of real architectures with random weights."""
