"""How fast a node is, as the tracker sees it: the node's claim, the tracker's own measurements, and the
expected time to first token of a request there.

The node claims prefill and decode rates it measured at its start (`NodeCapability`). The tracker
measures every stream it forwards to it: time to first token (TTFT) against the prompt's length, and
the tokens per second of the stream (content events it counted itself, as for billing). Both go into
moving averages; once `TRUST_AFTER_SAMPLES` streams are in, the tracker's own figures replace the
claim, and a node whose claimed decode rate is above `CLAIM_FLAG_FACTOR` times what it delivers is
flagged.

The tracker does not tokenize: a prompt's length here is `metering.prompt_ceiling`, a bound on its
tokens from the request's bytes. Claims and measurements are both read against that same length, so
nodes rank consistently; it is why a prefill claim is not flagged (a bound cannot prove a node slow)
but is only replaced, once measured. Pure arithmetic: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

from meshnet_gguf.contract.protocol import NodeCapability, RatePoint

# Weight of the newest sample in each moving average: the last ~1/weight streams count, so a node
# that slows down (another job on the box, a pool worker lost) is seen within a few requests.
EWMA_WEIGHT = 0.3
# Streams measured before the tracker prefers its own figures to the node's claim, and before it may
# flag the claim: fewer, and one cold or unlucky stream would decide.
TRUST_AFTER_SAMPLES = 5
# A node claiming more than this many times the decode rate it delivers is flagged. Honest figures
# drift with load and with other work on the box by well under this; a made-up one is far above.
CLAIM_FLAG_FACTOR = 3.0
# A stream's decode rate counts only over at least this many tokens after the first: fewer are mostly
# the network's jitter.
MIN_DECODE_TOKENS = 4
# Each other request busy on the node stretches a new one's expected TTFT by this fraction: its slot
# shares every batch llama-server runs. It also makes an idle node win over an equally fast busy one.
BUSY_SLOT_PENALTY = 0.25


@dataclass(frozen=True)
class StreamSample:
    """One stream the tracker forwarded to the node, as it timed it."""

    prompt_tokens: int  # the tracker's bound on the prompt (`metering.prompt_ceiling`)
    ttft_s: float  # request sent -> first content event
    busy_before: int  # the node's other requests in flight when this one was sent
    decode_tokens: int  # content events after the first
    decode_s: float  # first content event -> last
    concurrency: float  # the node's requests in flight while it decoded, this one included (an average)


def load_factor(busy: int) -> float:
    """How much `busy` other requests stretch a new request's TTFT (BUSY_SLOT_PENALTY each)."""
    return 1.0 + BUSY_SLOT_PENALTY * max(busy, 0)


def rate_at(points: Sequence[RatePoint], ctx_tokens: int) -> float | None:
    """A claimed rate at `ctx_tokens`, interpolated between the measured points (the nearest end outside them)."""
    ordered = sorted(points, key=lambda p: p.ctx_tokens)
    if not ordered:
        return None
    if ctx_tokens <= ordered[0].ctx_tokens:
        return ordered[0].tokens_per_s
    for low, high in pairwise(ordered):
        if ctx_tokens <= high.ctx_tokens:
            share = (ctx_tokens - low.ctx_tokens) / (high.ctx_tokens - low.ctx_tokens)
            return low.tokens_per_s + share * (high.tokens_per_s - low.tokens_per_s)
    return ordered[-1].tokens_per_s


class NodeSpeed:
    """One node's claim and the tracker's measurements of it, for one registration (a new one starts afresh)."""

    def __init__(self, claim: NodeCapability | None = None) -> None:
        self.claim = claim
        self._forget_measurements()

    def _forget_measurements(self) -> None:
        self.samples = 0
        self.decode_samples = 0
        # Seconds of TTFT per prompt token on an otherwise idle node (the sample's load divided out).
        self.ttft_s_per_token: float | None = None
        # The moving variance of those samples: how much one stream's TTFT scatters on this node.
        self.ttft_var_per_token: float = 0.0
        # What the claim leaves out of a TTFT: the way there and back, the node's checks, its queue.
        # A claim is llama-server's prefill alone, so it is read with this added, like for like with
        # what the tracker measures of the nodes it already trusts.
        self.overhead_s: float | None = None
        # The stream's decode rate times the node's concurrency while it ran: the node's decode rate
        # for one stream on a compute-bound box, more where batching is free (lenient, never unfair).
        self.decode_tokens_per_s: float | None = None
        # What the node delivered as a fraction of its claimed decode rate (moving average).
        self.decode_delivered: float | None = None

    def set_claim(self, claim: NodeCapability | None) -> None:
        """A claim from the node's /health. A different one means llama-server restarted and measured
        itself anew (other settings, another load on the box): what was measured before is stale."""
        if claim is None or claim == self.claim:
            return
        if self.claim is not None:
            self._forget_measurements()
        self.claim = claim

    @property
    def trusted(self) -> bool:
        return self.samples >= TRUST_AFTER_SAMPLES

    def record(self, sample: StreamSample, *, first_token: bool = True) -> None:
        """One stream's figures. `first_token=False`: its first token waited for a model's load, so only its decode
        rate counts (the load is in its TTFT, not in its tokens per second: a claim is still checked, R3)."""
        if not first_token:
            self._record_decode(sample)
            return
        if sample.prompt_tokens < 1 or sample.ttft_s <= 0:
            return
        self.samples += 1
        idle_ttft_s = sample.ttft_s / load_factor(sample.busy_before)
        per_token = idle_ttft_s / sample.prompt_tokens
        if self.ttft_s_per_token is not None:
            gap = per_token - self.ttft_s_per_token
            self.ttft_var_per_token = (1 - EWMA_WEIGHT) * (self.ttft_var_per_token + EWMA_WEIGHT * gap * gap)
        self.ttft_s_per_token = _ewma(self.ttft_s_per_token, per_token)
        claimed_prefill = rate_at(self.claim.prefill_tokens_per_s, sample.prompt_tokens) if self.claim else None
        if claimed_prefill:
            self.overhead_s = _ewma(self.overhead_s, max(0.0, idle_ttft_s - sample.prompt_tokens / claimed_prefill))
        self._record_decode(sample)

    def _record_decode(self, sample: StreamSample) -> None:
        if sample.decode_tokens < MIN_DECODE_TOKENS or sample.decode_s <= 0:
            return
        self.decode_samples += 1
        delivered = sample.decode_tokens / sample.decode_s * max(sample.concurrency, 1.0)
        self.decode_tokens_per_s = _ewma(self.decode_tokens_per_s, delivered)
        claimed = rate_at(self.claim.decode_tokens_per_s, sample.prompt_tokens) if self.claim else None
        if claimed:
            self.decode_delivered = _ewma(self.decode_delivered, delivered / claimed)

    @property
    def flagged(self) -> bool:
        """The claim is far above what the node delivers, over enough streams to say so."""
        return (
            self.decode_samples >= TRUST_AFTER_SAMPLES
            and self.decode_delivered is not None
            and self.decode_delivered * CLAIM_FLAG_FACTOR < 1.0
        )

    def ttft_s(self, prompt_tokens: int, overhead_floor_s: float = 0.0) -> float | None:
        """The expected TTFT of a prompt on the idle node: measured once trusted; else claimed, plus the
        overhead measured here so far (or, before any stream, `overhead_floor_s`: the least the tracker
        measured on any node); else measured from fewer streams; None when neither says anything."""
        claimed = rate_at(self.claim.prefill_tokens_per_s, prompt_tokens) if self.claim else None
        if self.ttft_s_per_token is not None and (self.trusted or claimed is None):
            return self.ttft_s_per_token * prompt_tokens
        if claimed:
            return prompt_tokens / claimed + (self.overhead_s if self.overhead_s is not None else overhead_floor_s)
        return None

    def claimed_prefill_s(self, prompt_tokens: int) -> float | None:
        """The prefill of a prompt by the node's claim alone, before anything it delivered; None without a claim."""
        claimed = rate_at(self.claim.prefill_tokens_per_s, prompt_tokens) if self.claim else None
        return prompt_tokens / claimed if claimed else None

    def ttft_spread_s(self, prompt_tokens: int) -> float:
        """How far the measured TTFT of this prompt may be off by chance: the standard error of the moving
        average (the scatter of one stream's TTFT times sqrt(w / (2 - w)), w = `EWMA_WEIGHT`); 0 before any
        stream or for a claim (a claim does not scatter; it is doubted otherwise, `market`)."""
        if self.ttft_s_per_token is None or not (self.trusted or self.claim is None):
            return 0.0
        return math.sqrt(self.ttft_var_per_token * EWMA_WEIGHT / (2 - EWMA_WEIGHT)) * prompt_tokens

    def summary(self) -> dict[str, object]:
        """What `/v1/nodes` and the tracker page show."""
        claim = self.claim
        return {
            "claimed_prefill_tokens_per_s": _first_rate(claim.prefill_tokens_per_s) if claim else None,
            "claimed_decode_tokens_per_s": _first_rate(claim.decode_tokens_per_s) if claim else None,
            "measured_streams": self.samples,
            "measured_prefill_tokens_per_s": _round(1 / self.ttft_s_per_token) if self.ttft_s_per_token else None,
            "measured_decode_tokens_per_s": _round(self.decode_tokens_per_s),
            "decode_delivered_of_claim": _round(self.decode_delivered, 3),
            "trusted": self.trusted,
            "claim_flagged": self.flagged,
        }


def expected_ttft_s(speed: NodeSpeed, prompt_tokens: int, busy: int, overhead_floor_s: float = 0.0) -> float | None:
    """A request's expected TTFT on this node now: its idle TTFT for this prompt, stretched by the load."""
    idle = speed.ttft_s(prompt_tokens, overhead_floor_s)
    return None if idle is None else idle * load_factor(busy)


def overhead_floor_s(speeds: Iterable[NodeSpeed]) -> float:
    """The least overhead the tracker measured on any of these nodes: what a node not measured yet is
    assumed to cost besides its claimed prefill (0 when none is measured)."""
    return min((s.overhead_s for s in speeds if s.overhead_s is not None), default=0.0)


def _ewma(current: float | None, sample: float) -> float:
    return sample if current is None else current + EWMA_WEIGHT * (sample - current)


def _first_rate(points: Sequence[RatePoint]) -> float | None:
    """The rate at the smallest context measured: the one a short request gets."""
    return _round(min(points, key=lambda p: p.ctx_tokens).tokens_per_s) if points else None


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


__all__ = [
    "BUSY_SLOT_PENALTY",
    "CLAIM_FLAG_FACTOR",
    "EWMA_WEIGHT",
    "MIN_DECODE_TOKENS",
    "TRUST_AFTER_SAMPLES",
    "NodeSpeed",
    "StreamSample",
    "expected_ttft_s",
    "load_factor",
    "overhead_floor_s",
    "rate_at",
]
