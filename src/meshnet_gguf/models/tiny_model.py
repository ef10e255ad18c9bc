"""Write tiny but real llama GGUF models with random weights.

They load in well under a second and decode thousands of tokens per second on
a CPU, so tests can exercise the real llama-server. The vocabulary is the 128
ASCII bytes (GPT-2 byte-level spelling) plus one merge and an end-of-text
token: random weights can then only emit valid UTF-8, which llama-server's
chat parser requires (a non-ASCII byte token makes it answer 500).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

ASCII_BYTES = 128
# llama.cpp refuses a gpt2 vocab without merges, so we add exactly one.
_MERGE = ("a", "b")


@dataclass(frozen=True)
class TinyModelSpec:
    n_layers: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    context_length: int = 2048
    seed: int = 0
    name: str = "tiny-llama"
    # "Q8_0" stores the matrices quantized, so llama.cpp runs its integer dot-product
    # kernels (the ones a binary built for another CPU can die on); "F32" avoids them;
    # "F16" halves the size of a benchmark-sized model (the usual unquantized GGUF).
    # Any type in WRITABLE_TYPES works.
    weight_type: str = "F32"
    # Per-layer matrix types, cycled over the layers (the run probe's mix of a model's
    # weight types); None: every matrix is `weight_type`.
    layer_types: tuple[str, ...] | None = None


# The matrix types the `gguf` package can quantize to, so a tiny model can hold them.
WRITABLE_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
_FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16, "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1, "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}  # fmt: skip


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map (as in its encoder.py)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapped = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            mapped.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, mapped)}


def _vocab() -> tuple[list[str], list[int]]:
    spelling = _byte_to_unicode()
    tokens = [spelling[b] for b in range(ASCII_BYTES)]
    types = [gguf.TokenType.NORMAL] * ASCII_BYTES
    tokens.append("".join(_MERGE))
    types.append(gguf.TokenType.NORMAL)
    tokens.append("<|endoftext|>")
    types.append(gguf.TokenType.CONTROL)
    return tokens, [int(t) for t in types]


def write_tiny_model(
    path: Path,
    spec: TinyModelSpec = TinyModelSpec(),
    *,
    split_max_tensors: int = 0,
) -> Path:
    """Write a tiny llama GGUF to `path`; returns the path llama-server should load.

    With `split_max_tensors` > 0 the model is split into
    `NAME-00001-of-0000K.gguf` shards next to `path` and the first shard's
    path is returned (llama.cpp loads a split model from shard 1).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(spec.seed)
    tokens, token_types = _vocab()
    n_vocab = len(tokens)
    head_dim = spec.n_embd // spec.n_head

    writer = gguf.GGUFWriter(str(path), "llama", split_max_tensors=split_max_tensors)
    writer.add_name(spec.name)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layers)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    layer_types = spec.layer_types or (spec.weight_type,)
    unknown = sorted({spec.weight_type, *layer_types} - set(WRITABLE_TYPES))
    if unknown:
        raise ValueError(f"weight types must be among {', '.join(WRITABLE_TYPES)}, not {', '.join(unknown)}")
    writer.add_file_type(_FILE_TYPES[spec.weight_type])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges([" ".join(_MERGE)])
    writer.add_eos_token_id(n_vocab - 1)
    writer.add_bos_token_id(n_vocab - 1)
    writer.add_add_bos_token(False)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def add_matrix(name: str, data: np.ndarray, type_name: str = spec.weight_type) -> None:
        if type_name == "F32":
            writer.add_tensor(name, data)
        elif type_name == "F16":
            writer.add_tensor(name, data.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[type_name]
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    kv_dim = head_dim * spec.n_head_kv
    writer.add_tensor("token_embd.weight", weight(n_vocab, spec.n_embd))
    for layer in range(spec.n_layers):
        prefix = f"blk.{layer}"
        kind = layer_types[layer % len(layer_types)]
        writer.add_tensor(f"{prefix}.attn_norm.weight", np.ones(spec.n_embd, np.float32))
        add_matrix(f"{prefix}.attn_q.weight", weight(spec.n_embd, spec.n_embd), kind)
        add_matrix(f"{prefix}.attn_k.weight", weight(kv_dim, spec.n_embd), kind)
        add_matrix(f"{prefix}.attn_v.weight", weight(kv_dim, spec.n_embd), kind)
        add_matrix(f"{prefix}.attn_output.weight", weight(spec.n_embd, spec.n_embd), kind)
        writer.add_tensor(f"{prefix}.ffn_norm.weight", np.ones(spec.n_embd, np.float32))
        add_matrix(f"{prefix}.ffn_gate.weight", weight(spec.n_ff, spec.n_embd), kind)
        add_matrix(f"{prefix}.ffn_up.weight", weight(spec.n_ff, spec.n_embd), kind)
        add_matrix(f"{prefix}.ffn_down.weight", weight(spec.n_embd, spec.n_ff), kind)
    writer.add_tensor("output_norm.weight", np.ones(spec.n_embd, np.float32))
    add_matrix("output.weight", weight(n_vocab, spec.n_embd))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    if split_max_tensors:
        shards = sorted(path.parent.glob(f"{path.stem}-00001-of-*.gguf"))
        if not shards:
            raise RuntimeError(f"gguf writer produced no shards next to {path}")
        return shards[0]
    return path
