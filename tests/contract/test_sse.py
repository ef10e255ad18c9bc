from meshnet_gguf.contract.sse import SSESplitter, comment_event, data_event, event_data, is_comment


def test_events_split_across_arbitrary_chunk_boundaries_come_back_byte_identical() -> None:
    stream = b'data: {"a":1}\n\n: ping\n\ndata: {"b":2}\n\ndata: [DONE]\n\n'
    for cut in range(1, len(stream)):
        splitter = SSESplitter()
        events = splitter.feed(stream[:cut]) + splitter.feed(stream[cut:])
        assert b"".join(events) == stream
        assert events == [b'data: {"a":1}\n\n', b": ping\n\n", b'data: {"b":2}\n\n', b"data: [DONE]\n\n"]
        assert splitter.pending == b""


def test_incomplete_tail_waits_for_its_terminator() -> None:
    splitter = SSESplitter()
    assert splitter.feed(b"data: x\n") == []
    assert splitter.pending == b"data: x\n"
    assert splitter.feed(b"\n") == [b"data: x\n\n"]


def test_crlf_and_cr_framing() -> None:
    splitter = SSESplitter()
    assert splitter.feed(b"data: a\r\n\r\ndata: b\r\rdata: c\r\n") == [b"data: a\r\n\r\n", b"data: b\r\r"]
    assert splitter.pending == b"data: c\r\n"


def test_event_data_joins_lines_and_ignores_comments() -> None:
    assert event_data(b"data: one\ndata:two\n\n") == b"one\ntwo"
    assert event_data(b": ping\n\n") is None
    assert is_comment(b": ping\n\n") and not is_comment(b"data: x\n\n")


def test_builders_make_parseable_events() -> None:
    assert SSESplitter().feed(comment_event("meshnet-usage {}\nx")) == [b": meshnet-usage {} x\n\n"]
    assert event_data(data_event(b"[DONE]")) == b"[DONE]"
