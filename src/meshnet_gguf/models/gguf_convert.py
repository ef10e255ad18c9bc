"""Rewrite a quantized GGUF with F16 weights (via the gguf package).

Used by the benchmarks on a CPU whose llama-server cannot run quantized kernels
(see `llama.run_probe`; a node builds a llama-server for such a machine instead):
the same model, dequantized, still runs on the plain float kernels. Only sensible
for small models, such as the demo: F16 doubles or quadruples a Q4 file.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from meshnet_gguf.common.atomic_file import replaced_on_success

_KEPT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)


def dequantize_to_f16(source: Path, target: Path) -> Path:
    """Write `target`: `source` with every quantized tensor stored as F16. Atomic: a crash leaves no half file."""
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    with replaced_on_success(target) as partial:
        _write_f16(reader, arch, partial)
    return target


def _write_f16(reader: gguf.GGUFReader, arch: str, partial: Path) -> None:
    writer = gguf.GGUFWriter(str(partial), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer emits these itself
        value_type = field.types[0]
        sub_type = field.types[1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if key == "general.file_type":
            value = int(gguf.LlamaFileType.MOSTLY_F16)
        writer.add_key_value(key, value, value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.tensor_type in _KEPT_TYPES:
            data = np.asarray(tensor.data)
            writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=tensor.tensor_type)
        else:
            weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float16)
            writer.add_tensor(tensor.name, weights, raw_dtype=gguf.GGMLQuantizationType.F16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
