"""Two relays for one node (protocol 9.7): the order the tracker dials them in, when it moves to the
next, and the announcement that names them. The whole path, with real processes and a relay killed
under a stream of requests, is `e2e/test_relay_e2e.py::test_a_relay_killed_under_a_stream_fails_over_with_no_client_error`."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from meshnet_gguf.common.http1_client import HttpConnectError
from meshnet_gguf.contract.protocol import MAX_NODE_RELAYS, NodeAnnouncement, RelayAttachment
from meshnet_gguf.reference.tracker.relay_dialer import ConnectRefused
from meshnet_gguf.reference.tracker.relay_failover import RelayOrder, dial_in_order

pytestmark = pytest.mark.anyio

FAILED_BEFORE_SENDING = (OSError, TimeoutError, HttpConnectError)


def test_relays_are_dialled_as_announced_until_one_works_then_that_one_first() -> None:
    order = RelayOrder(["a", "b", "c"])
    assert order.order() == ["a", "b", "c"]
    order.worked("b")
    assert order.order() == ["b", "a", "c"]  # the one that worked, then the others as announced
    order.worked("a")
    assert order.order() == ["a", "b", "c"]
    with pytest.raises(ValueError):
        RelayOrder([])


async def test_a_connect_that_fails_moves_to_the_next_relay_and_the_next_dial_starts_there() -> None:
    order = RelayOrder(["a", "b"])
    tried: list[str] = []
    down = {"a"}

    async def dial(relay: str) -> str:
        tried.append(relay)
        if relay in down:
            raise ConnectRefused("HTTP/1.1 404 node_not_attached")  # the tunnel there is gone
        return f"tunnel via {relay}"

    assert await dial_in_order(order, dial, FAILED_BEFORE_SENDING) == "tunnel via b"
    assert tried == ["a", "b"]
    tried.clear()
    assert await dial_in_order(order, dial, FAILED_BEFORE_SENDING) == "tunnel via b"
    assert tried == ["b"]  # the dead relay is not paid for again
    down = {"b"}  # now b dies and a is back: a refused TCP connect moves on as a refused CONNECT does
    tried.clear()

    async def refused(relay: str) -> str:
        tried.append(relay)
        if relay in down:
            raise ConnectionRefusedError(111, "Connection refused")
        return f"tunnel via {relay}"

    assert await dial_in_order(order, refused, FAILED_BEFORE_SENDING) == "tunnel via a"
    assert tried == ["b", "a"]


async def test_a_relay_silent_past_its_time_gives_the_next_one_its_own_time() -> None:
    import anyio

    async def dial(relay: str) -> str:
        if relay == "silent":
            await anyio.sleep(10)
        return relay

    with anyio.fail_after(2):
        assert await dial_in_order(RelayOrder(["silent", "b"]), dial, FAILED_BEFORE_SENDING, each_timeout_s=0.2) == "b"


async def test_every_relay_failing_raises_the_last_failure_and_other_errors_are_not_retried() -> None:
    tried: list[str] = []

    async def dial(relay: str) -> str:
        tried.append(relay)
        raise ConnectRefused(f"{relay}: HTTP/1.1 503 no_work_connection")

    with pytest.raises(ConnectRefused, match="b: "):  # a connect error: the forwarder reads "the node saw nothing"
        await dial_in_order(RelayOrder(["a", "b"]), dial, FAILED_BEFORE_SENDING)
    assert tried == ["a", "b"]
    tried.clear()

    async def broken(relay: str) -> str:
        tried.append(relay)
        raise RuntimeError("not a dial failure")

    with pytest.raises(RuntimeError):
        await dial_in_order(RelayOrder(["a", "b"]), broken, FAILED_BEFORE_SENDING)
    assert tried == ["a"]


CERT = "Y2VydA"


def announcement(**over: object) -> NodeAnnouncement:
    fields: dict[str, object] = {
        "node_id": "node-x", "public_key": "k", "advertised_url": "http://relay-a:8001", "model_id": "tiny",
        "first_layer": 0, "last_layer": 1, "total_layers": 2, "slots": 4, "node_version": "0.1.0",
    }  # fmt: skip
    fields.update(over)
    return NodeAnnouncement.model_validate(fields)


def attachment(url: str, certificate: str = CERT) -> dict[str, str]:
    return {"url": url, "tls_certificate": certificate}


def test_the_announcement_lists_both_relays_and_an_older_tracker_still_reads_the_first() -> None:
    a, b = attachment("http://relay-a:8001"), attachment("http://relay-b:8002")
    both = announcement(relay=a, relays=[a, b])
    assert [r.url for r in both.relay_attachments()] == ["http://relay-a:8001", "http://relay-b:8002"]
    wire = both.model_dump(mode="json")
    assert wire["relay"]["url"] == "http://relay-a:8001"  # what a tracker that knows one relay reads
    assert [r.url for r in announcement(relay=a).relay_attachments()] == ["http://relay-a:8001"]  # an older node
    assert announcement().relay_attachments() == []


@pytest.mark.parametrize(
    "relay, relays, why",
    [
        (attachment("http://relay-a:8001"), [attachment("http://relay-b:8002"), attachment("http://relay-a:8001")], "first relay"),
        (None, [attachment("http://relay-a:8001")], "first relay"),
        (
            attachment("http://relay-a:8001"),
            [attachment("http://relay-a:8001"), attachment("http://relay-b:8002", "b3RoZXI")],
            "one certificate",
        ),
        (attachment("http://relay-a:8001"), [attachment("http://relay-a:8001"), attachment("http://RELAY-A:8001/")], "named twice"),
        (
            attachment("http://relay-0:8001"),
            [attachment(f"http://relay-{n}:8001") for n in range(MAX_NODE_RELAYS + 1)],
            "at most",
        ),
    ],
)
def test_a_relay_list_that_disagrees_with_itself_is_refused(relay: object, relays: list[object], why: str) -> None:
    with pytest.raises(ValidationError, match=why):
        announcement(relay=relay, relays=relays)
