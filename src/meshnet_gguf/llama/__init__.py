"""The llama-server child: finding the binary, its CPU compatibility, building one from source, the
child process, its warm-up and its restart loop, its load progress, and the clients that talk to it;
and the pool worker (`rpc_worker`, `rpc_status`): llama.cpp's ggml-rpc-server on a helper box, and the
node's watch over its workers (`pool_monitor`).

May import: common, contract, models.
"""
