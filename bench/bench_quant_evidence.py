#!/usr/bin/env python3
"""Proof of quant by the node's committed log-probabilities: how far a cheaper quant's values, and an honest backend's,
fall from the claimed model's, answer by answer.

The greedy-token statistic (`proof/drift`) cannot tell the demo's Q4_K_M from its Q8_0: both pick the claimed model's
tokens but at near-ties, and an honest CUDA node breaks more near-ties than the quant does. The node's evidence
(`contract/model_proof.AnswerEvidence`: its top-k log-probabilities at every answer token) says more: the values
themselves. This bench records, per answer position, the node's top-k (what its evidence commits) and the verifier's
wider top-k at the same position (forced greedy re-generation, `proof/scoring`, every token scored), so any statistic
over them can be computed afterwards from the records (`--table`).

    PYTHONPATH=src:tests python bench/bench_quant_evidence.py --work DIR --pairs "Q8_0:Q8_0,Q6_K,Q4_K_M;F16:F16,Q8_0,Q4_K_M" \
        --prompts 20 --tokens 32 --records R.jsonl [--device cpu|Vulkan0|CUDA0] [--vk-visible-devices 0|'']
    PYTHONPATH=src:tests python bench/bench_quant_evidence.py --table R.jsonl            # several measures, side by side
    PYTHONPATH=src:tests python bench/bench_quant_evidence.py --detection R.jsonl [...]  # the values' rule, simulated

`--work` holds the demo quants `demo-<TYPE>.gguf` (`bench_model_proof.py --quants` makes them with llama-quantize). The
served model answers on `--device` (the CPU, 1 thread, by default); the claimed model's verifier runs on the CPU
(2 threads), as an audit's does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from bench_model_proof import CPU1, CPU2, honest_prompts
from support.llama_instance import Backend, llama_instance

from meshnet_gguf.llama.binary import BinaryInfo, find_llama_server
from meshnet_gguf.proof.scoring import score_answer

# What the node records per token (the evidence commits EVIDENCE_TOP_K of them; more here, to try other k afterwards).
NODE_TOP_K = 8
# The verifier's top-k per position: wide enough to hold the node's committed entries where its backend moved them.
VERIFIER_TOP_K = 32


def node_answers(
    binary: BinaryInfo, model: Path, backend: Backend, prompts: list[list[int]], tokens: int, log: Path, temperature: float = 0.0
) -> list[list[dict]]:
    """Answers (greedy, or sampled at `temperature` with a seed per prompt) with the node's top-k per token (llama-server's
    `completion_probabilities`: the raw softmax before the sampler, whatever the temperature)."""
    out = []
    with llama_instance(binary, model, backend, log) as url:
        for i, prompt in enumerate(prompts):
            body = {"prompt": prompt, "n_predict": tokens, "n_probs": NODE_TOP_K, "cache_prompt": False, "ignore_eos": True}
            body |= (
                {"temperature": temperature, "seed": 1000 + i} if temperature else {"temperature": 0.0, "top_k": 1, "samplers": ["top_k"]}
            )
            out.append(httpx.post(url + "/completion", json=body, timeout=900).json()["completion_probabilities"])
    return out


async def score(url: str, prompts: list[list[int]], answers: list[list[dict]]) -> list[list[list[tuple[int, float]]]]:
    out = []
    async with httpx.AsyncClient(base_url=url) as client:
        for prompt, answer in zip(prompts, answers):
            scored = await score_answer(client, prompt, [int(e["id"]) for e in answer], top_k=VERIFIER_TOP_K, ends_ignored=True)
            out.append([list(p.top) for p in scored.positions])
    return out


def record(args: argparse.Namespace) -> None:
    binary = find_llama_server(args.llama_server)
    node_backend = CPU1 if args.device == "cpu" else Backend("vulkan", 1, 512, args.device, args.vk_visible_devices or None)
    pairs = {c: s.split(",") for c, s in (p.split(":") for p in args.pairs.split(";"))}
    log = args.work / "evidence-llama.log"
    texts = honest_prompts(args.from_prompt + args.prompts)[args.from_prompt :]
    with llama_instance(binary, args.work / f"demo-{next(iter(pairs))}.gguf", CPU2, log) as url:
        prompts = [httpx.post(url + "/tokenize", json={"content": t, "add_special": True}).json()["tokens"] for t in texts]
    answers: dict[str, list[list[dict]]] = {}
    for name in sorted({s for ss in pairs.values() for s in ss}):
        t0 = time.monotonic()
        answers[name] = node_answers(binary, args.work / f"demo-{name}.gguf", node_backend, prompts, args.tokens, log, args.temperature)
        print(f"served {name} on {args.device}: {len(prompts)} answers in {time.monotonic() - t0:.0f} s", flush=True)
    for claimed, served_by in pairs.items():
        with llama_instance(binary, args.work / f"demo-{claimed}.gguf", CPU2, log) as url:
            for served in served_by:
                t0 = time.monotonic()
                verifier = asyncio.run(score(url, prompts, answers[served]))
                with args.records.open("a") as f:
                    for answer, ver in zip(answers[served], verifier):
                        node = [[[int(t["id"]), round(float(t["logprob"]), 5)] for t in e["top_logprobs"]] for e in answer]
                        f.write(json.dumps({"family": args.family, "claimed": claimed, "served": served, "device": args.device,
                                            "temperature": args.temperature,
                                            "tokens": [int(e["id"]) for e in answer],
                                            "node": node, "verifier": [[[i, round(v, 5)] for i, v in pos] for pos in ver]}) + "\n")  # fmt: skip
                print(f"  claimed {claimed} served {served}: scored in {time.monotonic() - t0:.0f} s", flush=True)


# --costs: what asking every answer for its log-probabilities costs, at the node (decode) and at the tracker (stripping).
STRIP_EVENTS = 20_000


def strip_cost() -> str:
    """The tracker's CPU per streamed event to take out top-4 log-probabilities (`answer_evidence.LogprobStripper`)."""
    from meshnet_gguf.reference.tracker.answer_evidence import LogprobStripper

    def event(i: int, logprobs: bool) -> bytes:
        top = [{"id": i + k, "token": "tok", "bytes": [116, 111, 107], "logprob": -0.1 * (k + 1)} for k in range(4)]
        choice: dict = {"finish_reason": None, "index": 0, "delta": {"content": "tok"}}
        if logprobs:
            choice["logprobs"] = {"content": [{"id": i, "token": "tok", "bytes": [116, 111, 107], "logprob": -0.1, "top_logprobs": top}]}
        body = {"choices": [choice], "created": 1, "id": "chatcmpl-x", "model": "m", "object": "chat.completion.chunk"}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    events = [event(i, True) for i in range(STRIP_EVENTS)]
    stripper = LogprobStripper(stream=True)
    t0 = time.perf_counter()
    out = sum(len(stripper.feed(e)) for e in events)
    took = time.perf_counter() - t0
    return (
        f"tracker: a streamed event with top-4 log-probabilities is {len(events[0])} bytes ({len(event(0, False))} without); "
        f"taking them out costs {took / STRIP_EVENTS * 1e6:.1f} us of CPU an event ({out / STRIP_EVENTS:.0f} bytes left)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, help="where demo-<TYPE>.gguf are")
    parser.add_argument("--pairs", default="Q8_0:Q8_0,Q6_K,Q4_K_M", metavar="C:S,S;C:S")
    parser.add_argument("--family", default="demo", help="the records' model family (demo: the demo's quants; tiny: generated)")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--from-prompt", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="sampled answers at this temperature (0: greedy)")
    parser.add_argument("--device", default="cpu", help="the served model's device: cpu, Vulkan0, CUDA0")
    parser.add_argument("--vk-visible-devices", default="0", help="GGML_VK_VISIBLE_DEVICES for a Vulkan device ('' leaves it unset)")
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument("--records", type=Path)
    parser.add_argument("--table", type=Path, default=None, metavar="RECORDS")
    parser.add_argument("--costs", action="store_true", help="what the log-probabilities cost: the node's decode (the demo "
                        "F16 and Q8_0 in --work, 1 thread), the tracker's stripping")  # fmt: skip
    parser.add_argument("--detection", type=Path, nargs="+", default=None, metavar="RECORDS",
                        help="the values' rule simulated on RECORDS: refused after 1, 10, 50 audits; honest CUSUMs")  # fmt: skip
    args = parser.parse_args()
    if args.table:
        from quant_evidence_stats import print_table

        print_table(args.table)
        return 0
    if args.costs:
        from bench_model_proof import n_probs_cost

        print(strip_cost(), flush=True)
        for name in ("Q8_0", "F16"):
            print(
                "node: " + n_probs_cost(find_llama_server(args.llama_server), args.work / f"demo-{name}.gguf", args.work / "cost.log", 5),
                flush=True,
            )
        return 0
    if args.detection:
        from quant_evidence_stats import print_detection

        print_detection(args.detection)
        return 0
    record(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
