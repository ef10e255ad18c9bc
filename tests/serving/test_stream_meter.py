"""The streamed-answer relay: whatever way llama-server's bytes are cut into reads, the client
gets the same events and the meter the same counts as metering event by event would give."""

from __future__ import annotations

import random

from meshnet_gguf.contract.sse import SSESplitter
from meshnet_gguf.serving.meter import RequestMeter, StreamMeter, meter_events


def _meter() -> RequestMeter:
    return RequestMeter(request_id="r", path="/v1/chat/completions", stream=True, started_at=0.0, started=0.0)


def _answer(tokens: int) -> bytes:
    head = b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}]}\n\n'
    body = b"".join(
        b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"t%d"}}],"object":"chat.completion.chunk"}\n\n' % i
        for i in range(tokens)
    )
    ping = b": ping\n\n"
    end = b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}]}\n\n'
    usage = (
        b'data: {"choices":[],"usage":{"completion_tokens":%d,"prompt_tokens":5,"total_tokens":%d,'
        b'"prompt_tokens_details":{"cached_tokens":1}}}\n\n' % (tokens, tokens + 5)
    )
    return head + body[: len(body) // 2] + ping + body[len(body) // 2 :] + end + usage + b"data: [DONE]\n\n"


def _by_events(answer: bytes) -> tuple[bytes, RequestMeter]:
    meter = _meter()
    events = SSESplitter().feed(answer)
    replaced, done = meter_events(meter, events)
    assert done
    return b"".join(replaced if replaced is not None else events), meter


def test_any_cut_into_reads_gives_the_same_bytes_and_counts() -> None:
    answer = _answer(40)
    expected_bytes, expected = _by_events(answer)
    rng = random.Random(7)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(answer)), rng.randint(1, 60)))
        reads = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)])]
        relay = StreamMeter(_meter())
        out, done_seen = [], False
        for read in reads:
            body, done = relay.feed(read)
            out.append(body)
            done_seen = done_seen or done
        assert done_seen
        assert b"".join(out) == expected_bytes
        meter = relay.meter
        assert meter.content_events == expected.content_events == 40
        assert (meter.completion_tokens, meter.prompt_tokens, meter.cached_tokens) == (40, 5, 1)
        assert meter.finish_reason == "length" and meter.first_token_at is not None


def test_only_whole_events_go_out() -> None:
    relay = StreamMeter(_meter())
    event = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
    assert relay.feed(event[:10]) == (b"", False)
    assert relay.feed(event[10:] + event[:5]) == (event, False)
    assert relay.feed(event[5:]) == (event, False)
    assert relay.meter.content_events == 2


def test_a_stream_cut_short_still_counts_its_tokens() -> None:
    relay = StreamMeter(_meter())
    for i in range(5):
        relay.feed(b'data: {"choices":[{"delta":{"content":"%d"}}]}\n\n' % i)
    assert relay.meter.tokens_out() == 5


def test_the_spelled_out_marker_check_is_the_marker_list() -> None:
    """`_needs_events` spells out _SLOW_PATH_MARKERS for speed: each marker, alone in a token-sized
    read, sends it down the per-event path, and a read of plain content deltas does not."""
    from meshnet_gguf.serving.meter import _SLOW_PATH_MARKERS, _needs_events

    delta = b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" hi"}}],"object":"chat.completion.chunk"}\n\n'
    assert not _needs_events(delta)
    for marker in _SLOW_PATH_MARKERS:
        assert _needs_events(delta[:40] + marker + delta[40:]), marker


def test_a_non_finite_decode_speed_from_upstream_leaves_the_usage_record_whole() -> None:
    """Python's json reads `NaN` and `1e999`; the usage record refuses a non-finite figure, so the meter
    keeps none: the request's one record is still made, and goes on the wire finite."""
    for rate in ("NaN", "1e999", "-1", "1" + "0" * 400):
        relay = StreamMeter(_meter())
        relay.feed(
            b'data: {"choices":[{"delta":{"content":"x"}}],"timings":{"predicted_n":1,"predicted_per_second":%s}}\n\n' % rate.encode()
        )
        relay.feed(b"data: [DONE]\n\n")
        assert relay.meter.usage_record("tiny").decode_tokens_per_s is None, rate
    relay = StreamMeter(_meter())
    relay.feed(b'data: {"choices":[],"timings":{"predicted_n":1,"predicted_per_second":42.5}}\n\ndata: [DONE]\n\n')
    assert relay.meter.usage_record("tiny").decode_tokens_per_s == 42.5
