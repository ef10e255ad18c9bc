"""The wire models: what peers send must round-trip, and nonsense must be refused at the edge."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from meshnet_gguf.contract.protocol import (
    MAX_RECEIPTS_PER_BATCH,
    MAX_ROUTE_LIFETIME_S,
    NODE_TTL_HEARTBEATS,
    ROUTE_ERRORS,
    ErrorBody,
    NodeAnnouncement,
    ReceiptBatch,
    RouteClaims,
    UsageReceipt,
    UsageRecord,
)


def announcement(**over: object) -> NodeAnnouncement:
    fields: dict[str, object] = {
        "node_id": "node-x",
        "public_key": "k",
        "advertised_url": "http://127.0.0.1:8080",
        "model_id": "tiny",
        "first_layer": 0,
        "last_layer": 1,
        "total_layers": 2,
        "slots": 4,
        "node_version": "0.1.0",
    }
    fields.update(over)
    return NodeAnnouncement.model_validate(fields)


def test_announcement_round_trips_and_knows_full_coverage() -> None:
    ann = announcement()
    again = NodeAnnouncement.model_validate_json(ann.model_dump_json())
    assert again == ann
    assert again.full_coverage and again.state == "joining"
    assert not announcement(first_layer=1).full_coverage


def test_announcement_refuses_impossible_layers() -> None:
    with pytest.raises(ValidationError):
        announcement(last_layer=2)  # layer 2 of a 2-layer model does not exist
    with pytest.raises(ValidationError):
        announcement(first_layer=1, last_layer=0)


def test_newer_peer_fields_are_ignored() -> None:
    """A peer on a newer minor version may add fields; an older one must still parse the message."""
    data = announcement().model_dump() | {"future_field": {"x": 1}}
    assert NodeAnnouncement.model_validate(data).node_id == "node-x"


def test_route_claims_carry_every_field_the_node_checks() -> None:
    claims = RouteClaims.model_validate(
        {
            "iss": "tracker-a", "sub": "node-x", "jti": "req-1", "iat": 100, "exp": 130, "path": "/v1/chat/completions",
            "model": "tiny", "hops": [{"node_id": "node-x", "first_layer": 0, "last_layer": 1}],
            "body_sha256": "ab", "max_tokens": 16,
        }
    )  # fmt: skip
    assert claims.hops[0].last_layer == 1 and claims.max_tokens == 16
    with pytest.raises(ValidationError):
        RouteClaims.model_validate(claims.model_dump() | {"max_tokens": 0})


def test_receipt_batches_are_bounded() -> None:
    # docs/protocol.md: `ReceiptBatch` (<= 100)
    receipt = UsageReceipt(request_id="r", token="t")
    ReceiptBatch(node_id="n", receipts=[receipt] * 100)
    with pytest.raises(ValidationError):
        ReceiptBatch(node_id="n", receipts=[receipt] * 101)


def test_usage_record_keeps_its_existing_shape() -> None:
    record = UsageRecord(request_id="r", route="/v1/completions", model="m", status=200, stream=False, started_at=1.0)
    assert record.finish_reason == "unknown" and record.completion_tokens == 0


def test_refusals_parse_as_the_protocol_error_body() -> None:
    from meshnet_gguf.contract.errors import ApiError

    body = ErrorBody.model_validate_json(ApiError(403, "route_replayed", "already used").body())
    assert (body.error.code, body.error.type, body.error.message) == ("route_replayed", "permission_error", "already used")


def test_contract_numbers_are_the_documents() -> None:
    # docs/protocol.md: route lifetime <= 60 s, node TTL = 3 heartbeat periods, receipts in batches of <= 100
    assert (MAX_ROUTE_LIFETIME_S, NODE_TTL_HEARTBEATS, MAX_RECEIPTS_PER_BATCH) == (60, 3, 100)
    # docs/protocol.md §2.1's table of refusals, status by status
    assert ROUTE_ERRORS["route_expired"] == 401 and ROUTE_ERRORS["route_replayed"] == 403
    assert ROUTE_ERRORS["route_key_unavailable"] == 503 and ROUTE_ERRORS["route_replay_cache_full"] == 503
    assert {status for status in ROUTE_ERRORS.values()} == {401, 403, 503}
