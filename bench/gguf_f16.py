"""Make an F16 copy of a quantized GGUF (for CPUs where llama.cpp's quantized kernels SIGILL).

Used by bench_proxy.py when the bundled llama-server cannot run Q4_K_M here.
If the package grows `meshnet_gguf.gguf_convert`, that is used instead.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def to_f16(src: Path, dst: Path) -> Path:
    try:  # the project's own converter, where present
        from meshnet_gguf import gguf_convert  # type: ignore[attr-defined]

        for name in ("to_f16", "convert_to_f16", "dequantize_to_f16"):
            fn = getattr(gguf_convert, name, None)
            if fn is not None:
                fn(src, dst)
                return dst
    except ImportError:
        pass
    import gguf
    from gguf import GGMLQuantizationType as Q

    reader = gguf.GGUFReader(src)
    arch = reader.get_field("general.architecture").contents()
    tmp = dst.with_suffix(".partial")
    writer = gguf.GGUFWriter(tmp, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        if t.tensor_type in (Q.F32, Q.F16, Q.BF16):
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
        else:
            data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float16)
            writer.add_tensor(t.name, data, raw_dtype=Q.F16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)
    return dst
