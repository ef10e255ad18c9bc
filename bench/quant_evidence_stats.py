"""Statistics over bench_quant_evidence.py's records: per answer, how far the node's committed log-probabilities fall
from the claimed model's at the same positions, by several measures, so the one that parts honest backends from
cheaper quants best can be chosen on measurements."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

Top = list[list[float]]  # [[id, logprob], ...] best first


def _lookup(top: Top) -> dict[int, float]:
    return {int(i): float(v) for i, v in top}


def top1_abs(node: Top, ver: Top, k: int) -> float | None:
    v = _lookup(ver)
    tid, lp = node[0]
    return abs(lp - v[int(tid)]) if int(tid) in v else None


def topk_abs(node: Top, ver: Top, k: int) -> float | None:
    v = _lookup(ver)
    diffs = [abs(lp - v[int(t)]) for t, lp in node[:k] if int(t) in v]
    return statistics.fmean(diffs) if diffs else None


def _log_ratio_differences(node: Top, ver: Top, k: int) -> list[float] | None:
    """The node's log-ratios to its top-1 less the verifier's for the same tokens (no softmax normalizer in them), for
    its entries 2..k the verifier ranks; None when the verifier does not rank the node's top-1."""
    v = _lookup(ver)
    t1, lp1 = int(node[0][0]), node[0][1]
    if t1 not in v:
        return None
    return [(lp - lp1) - (v[int(t)] - v[t1]) for t, lp in node[1:k] if int(t) in v]


def logit_gap_abs(node: Top, ver: Top, k: int) -> float | None:
    diffs = _log_ratio_differences(node, ver, k)
    return statistics.fmean(abs(d) for d in diffs) if diffs else None


def logit_gap_sq(node: Top, ver: Top, k: int) -> float | None:
    diffs = _log_ratio_differences(node, ver, k)
    return statistics.fmean(d * d for d in diffs) if diffs else None


MEASURES: dict[str, Callable[[Top, Top, int], float | None]] = {
    "top1 |d|": top1_abs,
    "top-k |d|": topk_abs,
    "log-ratio |d|": logit_gap_abs,
    "log-ratio d^2": logit_gap_sq,
}


def per_answer(record: dict, measure: Callable[[Top, Top, int], float | None], k: int) -> float:
    values = [measure(n, v, k) for n, v in zip(record["node"], record["verifier"])]
    kept = [x for x in values if x is not None]
    return statistics.fmean(kept) if kept else float("nan")


def read_records(path: Path) -> list[dict]:
    """A records file, gzipped (`.gz`, as bench/results keeps them) or not."""
    import gzip

    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return [json.loads(line) for line in text.splitlines()]


def print_table(path: Path, k: int = 4) -> None:
    records = read_records(path)
    pairs: dict[tuple[str, str, str], list[dict]] = {}
    for r in records:
        pairs.setdefault((r["claimed"], r["served"], r["device"]), []).append(r)
    for name, measure in MEASURES.items():
        print(f"\n{name} (k={k}): per-answer mean over its tokens; answers' median, p90, max")
        for (claimed, served, device), rs in pairs.items():
            xs = sorted(per_answer(r, measure, k) for r in rs)
            print(f"  {claimed:>6} <- {served:<6} {device:<8} n={len(xs):>3}  median {statistics.median(xs):.4f}  "
                  f"p90 {xs[int(0.9 * (len(xs) - 1))]:.4f}  min {xs[0]:.4f}  max {xs[-1]:.4f}")  # fmt: skip


# --- the values' rule (contract.model_proof.VALUE_DRIFTS), simulated on the records -------------------------------
DETECTION_AFTER = (1, 10, 50)
DETECTION_DRAWS = 2000
HONEST_NODES, HONEST_RUN = 2000, 1000


def answer_figures(record: dict):
    """The audit's figures of one recorded answer (what `proof.values.value_gaps` computes from the evidence)."""
    from meshnet_gguf.contract.model_proof import VALUE_DRIFTS, AnswerGaps, value_weights

    rule = VALUE_DRIFTS[value_weights(record["claimed"])]
    gaps = []
    for node, ver in zip(record["node"], record["verifier"]):
        theirs = _lookup(ver).get(int(node[0][0]))
        gaps.append(rule.cap_nats if theirs is None else min(abs(node[0][1] - theirs), rule.cap_nats))
    return AnswerGaps.of(gaps, rule=rule)


def evidence_refused(record: dict) -> bool:
    """Whether `proof.check.check_evidence` (each committed entry against the claimed model's) refuses the answer alone."""
    from meshnet_gguf.contract.model_proof import evidence_from_token_probs
    from meshnet_gguf.proof.check import check_evidence
    from meshnet_gguf.proof.scoring import Position, Scored

    entries = [{"id": t, "top_logprobs": [{"id": i, "logprob": v} for i, v in node]} for t, node in zip(record["tokens"], record["node"])]
    scored = Scored(
        tuple(Position(t, tuple((int(i), float(v)) for i, v in ver)) for t, ver in zip(record["tokens"], record["verifier"])), 1
    )
    return check_evidence(scored, evidence_from_token_probs(entries)).passed is False


def print_detection(paths: list[Path], seed: int = 44) -> None:
    """Per (claimed, served, device): the share of simulated nodes refused within their first k audited answers (each
    drawn with replacement from the recorded ones), and for the claimed file itself the highest CUSUM of
    HONEST_NODES nodes x HONEST_RUN audits in a row."""
    import random

    from meshnet_gguf.contract.model_proof import VALUE_DRIFT, NodeDrift, answer_refused

    rng = random.Random(seed)
    pairs: dict[tuple[str, str, str, str], list] = {}
    entry_refusals: dict[tuple[str, str, str, str], int] = {}
    for path in paths:
        for r in read_records(path):
            key = (r.get("family", "demo"), r["claimed"], r["served"], r["device"])
            pairs.setdefault(key, []).append(answer_figures(r))
            entry_refusals[key] = entry_refusals.get(key, 0) + evidence_refused(r)
    print(
        "| model | claimed | served | on | answers | refused by an entry | mean value gap / token | allowance | refused after "
        + " | ".join(map(str, DETECTION_AFTER))
        + " | honest: highest CUSUM in a row (bound) |"
    )
    print("|---" * (9 + len(DETECTION_AFTER)) + "|")
    for (family, claimed, served, device), figures in sorted(pairs.items()):
        tokens = sum(f.tokens for f in figures)
        rates = []
        for k in DETECTION_AFTER:
            caught = 0
            for _ in range(DETECTION_DRAWS):
                node = NodeDrift(rule=VALUE_DRIFT)
                caught += any(answer_refused(f) or node.add(f) for f in (rng.choice(figures) for _ in range(k)))
            rates.append(f"{caught / DETECTION_DRAWS:.0%}")
        honest = "-"
        if claimed == served:
            highest = 0.0
            for _ in range(HONEST_NODES):
                node = NodeDrift(rule=VALUE_DRIFT)
                for _ in range(HONEST_RUN):
                    node.add(rng.choice(figures))
                    highest = max(highest, node.s)
            honest = f"{highest:.3f} ({VALUE_DRIFT.refuse_nats})"
        print(
            f"| {family} | {claimed} | {served} | {device} | {len(figures)} | {entry_refusals[(family, claimed, served, device)]} | "
            f"{sum(f.gap_nats for f in figures) / tokens:.4f} | "
            f"{figures[0].rule.allowance_nats_per_token} | " + " | ".join(rates) + f" | {honest} |"
        )
