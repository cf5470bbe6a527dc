"""Benchmarks for pdserve. `bench.loadgen` drives any OpenAI-compatible endpoint."""
