"""Rewrite a GGUF with other weight types (via the gguf package).

`dequantize_to_f16`: used by the benchmarks on a CPU whose llama-server cannot run
quantized kernels (see `llama.run_probe`; a node builds a llama-server for such a
machine instead): the same model, dequantized, still runs on the plain float kernels.
`requantize`: the same model in another quant the `gguf` package can write (Q8_0,
Q4_0, ...), which the proof-of-model bench serves in place of the claimed one. Only
sensible for small models, such as the demo: F16 doubles or quadruples a Q4 file.
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
        _write_rewritten(reader, arch, partial)
    return target


def requantize(source: Path, target: Path, type_name: str) -> Path:
    """Write `target`: `source` with every matrix whose rows split into whole blocks of `type_name`
    (e.g. "Q8_0", "Q4_0") stored in it, from its dequantized values; the rest as F16, and float
    vectors as they were. Atomic, like `dequantize_to_f16`."""
    qtype = gguf.GGMLQuantizationType[type_name]
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    with replaced_on_success(target) as partial:
        _write_rewritten(reader, arch, partial, qtype)
    return target


def _write_rewritten(reader: gguf.GGUFReader, arch: str, partial: Path, qtype: gguf.GGMLQuantizationType | None = None) -> None:
    writer = gguf.GGUFWriter(str(partial), arch)
    block = gguf.GGML_QUANT_SIZES[qtype][0] if qtype is not None else 0
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer emits these itself
        value_type = field.types[0]
        sub_type = field.types[1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if key == "general.file_type":
            value = int(gguf.LlamaFileType[f"MOSTLY_{qtype.name}"] if qtype is not None else gguf.LlamaFileType.MOSTLY_F16)
        writer.add_key_value(key, value, value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        is_float = tensor.tensor_type in _KEPT_TYPES
        if qtype is not None and len(tensor.shape) >= 2 and int(tensor.shape[0]) % block == 0:
            weights = np.asarray(tensor.data) if is_float else gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            writer.add_tensor(tensor.name, gguf.quants.quantize(weights.astype(np.float32), qtype), raw_dtype=qtype)
        elif is_float:
            data = np.asarray(tensor.data)
            writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=tensor.tensor_type)
        else:
            weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float16)
            writer.add_tensor(tensor.name, weights, raw_dtype=gguf.GGMLQuantizationType.F16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
