"""A prompt too long for llama-server's slot, shrunk to the largest that fits.

The warm-up and the speed probe size their prompts in words, and a word is one token with a subword
vocabulary but several with a byte-level one, so their largest prompts may not fit a slot. llama-server
refuses those with `exceed_context_size_error`, saying the prompt's tokens and the slot's size; the node's
own requests read that and ask again at the size that fits (`ask_within_a_slot`), so the largest prompt
shape a client can send is the one warmed and measured (a GPU node whose largest prompts were refused paid 5.9 s for Vulkan's
first use of that shape on its first client's long prompt: bench/RESULTS.md, "A fair market").
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable
from typing import TypeVar

log = logging.getLogger(__name__)
Answer = TypeVar("Answer")

# Tokens left free in the slot beside the prompt's share, for a tokenizer that merges differently at the new length.
SLOT_FIT_MARGIN_TOKENS = 16
# Asks at a shrunk size before giving up. The shrink is proportional, and the chat template's own tokens do not
# shrink with the words, so the first shrunk prompt can still be over by the template's share (a byte-level
# vocabulary's 50 template tokens: 1,030 of a 1,024-token slot); the second refusal, nearer, fits.
SLOT_FIT_ATTEMPTS = 3
EXCEEDS_CONTEXT = "exceed_context_size_error"


def words_that_fit(words: int, answer: bytes, answer_tokens: int) -> int | None:
    """The word count whose prompt and `answer_tokens` fit the slot llama-server's refusal `answer` names;
    None when `answer` is no such refusal, or when not even one word would fit."""
    try:
        error = json.loads(answer).get("error")
    except (ValueError, AttributeError):
        return None
    if not isinstance(error, dict) or error.get("type") != EXCEEDS_CONTEXT:
        return None
    prompt_tokens, slot_tokens = error.get("n_prompt_tokens"), error.get("n_ctx")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (prompt_tokens, slot_tokens)):
        return None
    room = slot_tokens - answer_tokens - SLOT_FIT_MARGIN_TOKENS
    fitted = math.floor(words * room / prompt_tokens)
    return fitted if 0 < fitted < words else None


async def ask_within_a_slot(
    words: int, ask: Callable[[int], Awaitable[Answer]], fitting: Callable[[int, Answer], int | None], what: str
) -> Answer:
    """`ask(words)`, and again at the size `fitting(words, answer)` gives while it says the prompt was too long for a
    slot, at most SLOT_FIT_ATTEMPTS more times; the last answer. `what` names the asker in the log."""
    answer = await ask(words)
    for _ in range(SLOT_FIT_ATTEMPTS):
        fitted = fitting(words, answer)
        if fitted is None:
            break
        log.info("%s prompt of %d words is too long for a slot; shrunk to %d words", what, words, fitted)
        words = fitted
        answer = await ask(words)
    return answer


__all__ = ["EXCEEDS_CONTEXT", "SLOT_FIT_ATTEMPTS", "SLOT_FIT_MARGIN_TOKENS", "ask_within_a_slot", "words_that_fit"]
