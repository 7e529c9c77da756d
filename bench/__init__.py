"""Benchmarks: isthmus beside local jax, in the same run (python -m bench)."""
