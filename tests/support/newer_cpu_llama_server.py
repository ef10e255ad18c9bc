#!/usr/bin/env python3
"""A llama-server built for a newer CPU than this one, as the bundled build is on some machines.

It runs float (F32/F16/BF16) models, as the fake llama-server does, and dies
with SIGILL the moment it would run a quantized kernel, as the real build does
on a CPU without the instructions it was compiled for (AMD Zen 4). With
`STAND_IN_DIES_ON=every-model` it dies on float models too, as the bundled
build does on a CPU with AVX2 but no AVX-512; with `every-model-but-the-probe`
it passes the run probe and dies on the real model (a kernel the probe missed). Tests use it to check what the
node does with such a build on any machine, not only where it crashes.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path

from gguf import GGMLQuantizationType

from meshnet_gguf.models.gguf_info import read_gguf_info

FAKE_LLAMA = Path(__file__).parent / "fake_llama_server.py"
FLOAT_TENSOR_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}


def model_of(argv: list[str]) -> Path | None:
    for flag in ("-m", "--model"):
        if flag in argv[:-1]:
            return Path(argv[argv.index(flag) + 1])
    return None


def main(argv: list[str]) -> None:
    model = model_of(argv)
    dies_on = os.environ.get("STAND_IN_DIES_ON")
    # "every-model-but-the-probe": a kernel the run probe's tiny model does not reach (its file is probe.gguf).
    unforeseen = dies_on == "every-model-but-the-probe" and model is not None and model.name != "probe.gguf"
    if model is not None and (dies_on == "every-model" or unforeseen or not read_gguf_info(model).tensor_types <= FLOAT_TENSOR_TYPES):
        print(f"main: loading model '{model}'", flush=True)
        print("load_tensors: warming up the quantized kernels", flush=True)
        signal.signal(signal.SIGILL, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGILL)
    sys.argv = [str(FAKE_LLAMA), *argv]
    runpy.run_path(str(FAKE_LLAMA), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
