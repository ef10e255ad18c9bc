"""Aids for tests, benchmarks and the `dev` commands: an HF-compatible hub on loopback.

May import: common, contract, models.
"""
