"""The llama-server child: finding the binary, its CPU compatibility, building one from source, the
supervisor (spawn, warm-up, restart), its load progress, and the clients that talk to it.

May import: common, contract, models.
"""
