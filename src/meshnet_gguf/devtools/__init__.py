"""Helpers for tests, benchmarks and the `dev` commands (tiny models, stub servers)."""
