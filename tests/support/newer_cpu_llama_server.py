#!/usr/bin/env python3
"""A llama-server built for a newer CPU than this one, as the bundled build is on some machines.

It runs float (F32/F16/BF16) models, as the fake llama-server does, and dies
with SIGILL the moment it would run a quantized kernel, as the real build does
on a CPU without the instructions it was compiled for. Tests use it to check
what the node does with such a build on any machine, not only where it crashes.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path

from gguf import LlamaFileType

from meshnet_gguf.models.gguf_info import read_gguf_info

FAKE_LLAMA = Path(__file__).parent / "fake_llama_server.py"
FLOAT_FILE_TYPES = {LlamaFileType.ALL_F32, LlamaFileType.MOSTLY_F16, LlamaFileType.MOSTLY_BF16}


def model_of(argv: list[str]) -> Path | None:
    for flag in ("-m", "--model"):
        if flag in argv[:-1]:
            return Path(argv[argv.index(flag) + 1])
    return None


def main(argv: list[str]) -> None:
    model = model_of(argv)
    if model is not None and read_gguf_info(model).file_type not in FLOAT_FILE_TYPES:
        print(f"main: loading model '{model}'", flush=True)
        print("load_tensors: warming up the quantized kernels", flush=True)
        signal.signal(signal.SIGILL, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGILL)
    sys.argv = [str(FAKE_LLAMA), *argv]
    runpy.run_path(str(FAKE_LLAMA), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
