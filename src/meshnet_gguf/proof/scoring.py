"""The verifier's side of an audit: what the claimed model, on a llama-server the verifier trusts, says
about every token of a given answer.

llama-server scores only tokens it generates: `n_probs` gives each generated token's top-k
log-probabilities (a softmax of the raw logits, before any sampler, when `post_sampling_probs` is
off), and it has no prompt log-probabilities (`/v1/completions` answers "Only no echo is supported").
So the answer is scored by *forced greedy re-generation*: the verifier generates greedily from the
prompt with `n_probs`, compares each token with the answer's, and at the first difference starts
again from prompt + the answer up to and including that token (`cache_prompt` keeps the prefix, so a
restart costs the prefill of the new tokens only). Each answer position then has the verifier's own
top-k, conditioned on exactly the answer's tokens before it. An honest greedy answer costs one
generation; each divergence costs one more request.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

# llama-server's /completion with a list of token ids as the prompt, greedy, nothing added.
_GREEDY = {"temperature": 0.0, "top_k": 1, "samplers": ["top_k"], "cache_prompt": True, "stream": False}


@dataclass(frozen=True)
class Position:
    """The verifier's view of one answer token: its top-k (id, log-probability), best first, and, where the
    request forbade some tokens (`ignore_eos`), the verifier's own greedy pick among those it allowed.

    `n_probs` reports the raw logits, before the sampler: with `ignore_eos` an end-of-generation token can
    top them while no sampler may pick it, so the best a greedy answer is held to is the pick (`chosen`)."""

    token: int
    top: tuple[tuple[int, float], ...]
    chosen: int | None = None

    @property
    def best(self) -> int:
        return self.top[0][0] if self.chosen is None else self.chosen

    def logprob_of(self, token: int) -> float | None:
        for tid, lp in self.top:
            if tid == token:
                return lp
        return None

    def gap(self, token: int | None = None) -> float:
        """How far `token` (default: the answer's) falls below the verifier's best, in nats; when it is
        not in the top-k, at least the distance to the k-th (a lower bound)."""
        token = self.token if token is None else token
        lp = self.logprob_of(token)
        best = self.logprob_of(self.best) if self.chosen is not None else None
        return (self.top[0][1] if best is None else best) - (lp if lp is not None else self.top[-1][1])


@dataclass(frozen=True)
class Scored:
    positions: tuple[Position, ...]
    requests: int  # how many /completion calls it took (1 + divergences)


class ScoringFailed(RuntimeError):
    """The verifier's llama-server did not answer as expected: no verdict (never a refusal)."""


async def score_answer(
    client: httpx.AsyncClient,
    prompt: list[int],
    answer: list[int],
    *,
    top_k: int,
    give_up_gap: float | None = None,
    timeout_s: float = 120.0,
    ends_ignored: bool = False,
) -> Scored:
    """The verifier's top-k at every position of `answer` (token ids) after `prompt` (token ids).

    The verifier always generates with `ignore_eos` (it must go on to the answer's end); `ends_ignored`
    says the audited request asked for it too, so the node could not end either: its best at each position
    is then the verifier's own pick. Without it an end-of-generation token on top means the answer went on
    where the claimed model ends, and the answer's token is held to that token's log-probability.

    With `give_up_gap`, scoring stops at the first answer token further than that below the
    verifier's best: the verdict on a greedy answer is then known, and another model's answer
    (which diverges at every token) costs one request, not one per token."""
    positions: list[Position] = []
    requests = 0
    while len(positions) < len(answer):
        done = len(positions)
        body = {**_GREEDY, "prompt": prompt + answer[:done], "n_predict": len(answer) - done,
                "n_probs": top_k, "ignore_eos": True}  # fmt: skip
        try:
            response = await client.post("/completion", json=body, timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise ScoringFailed(f"verifier llama-server unreachable: {exc}") from exc
        requests += 1
        if response.status_code != 200:
            raise ScoringFailed(f"verifier llama-server answered {response.status_code}: {response.text[:200]}")
        probs = response.json().get("completion_probabilities") or []
        if not probs:
            raise ScoringFailed("verifier llama-server returned no token probabilities")
        for entry in probs:
            expected = answer[len(positions)]
            top = tuple((int(t["id"]), float(t["logprob"])) for t in entry["top_logprobs"])
            positions.append(Position(expected, top, int(entry["id"]) if ends_ignored else None))
            if give_up_gap is not None and positions[-1].gap() > give_up_gap:
                return Scored(tuple(positions), requests)
            if int(entry["id"]) != expected or len(positions) == len(answer):
                break  # diverged: force the answer's token and go on from there
    return Scored(tuple(positions), requests)
