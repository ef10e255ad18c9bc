"""meshnet-gguf: a whole-model Meshnet node serving GGUF models through llama-server."""

__version__ = "0.1.0"
