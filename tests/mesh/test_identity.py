"""Node identity: one private key per state directory, created safely, and an id bound to it."""

from __future__ import annotations

import multiprocessing
import stat
from pathlib import Path

import jwt
import pytest

from meshnet_gguf.contract.protocol import ReceiptClaims, UsageRecord
from meshnet_gguf.contract.signing import TokenRefused, node_id_for, parse_public_key, verify
from meshnet_gguf.contract.token_policies import NODE_CALL_TOKEN, RECEIPT_TOKEN
from meshnet_gguf.mesh.identity import NODE_KEY_FILE, NodeIdentity


def test_key_is_created_private_and_reused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = NodeIdentity.load_or_create(state)
    key_file = state / NODE_KEY_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert [p.name for p in state.iterdir()] == [NODE_KEY_FILE]  # no temp file left behind
    again = NodeIdentity.load_or_create(state)
    assert again.node_id == first.node_id and again.public_key_text == first.public_key_text


def test_node_id_derives_from_the_public_key(tmp_path: Path) -> None:
    ident = NodeIdentity.load_or_create(tmp_path)
    assert ident.node_id == node_id_for(parse_public_key(ident.public_key_text))
    assert ident.node_id.startswith("node-")
    other = NodeIdentity.load_or_create(tmp_path / "other")
    assert other.node_id != ident.node_id


def test_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    NodeIdentity.load_or_create(tmp_path)
    (tmp_path / NODE_KEY_FILE).chmod(0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        NodeIdentity.load_or_create(tmp_path)


def _create(state: str, out: "multiprocessing.Queue[str]") -> None:
    out.put(NodeIdentity.load_or_create(Path(state)).node_id)


def test_concurrent_first_runs_agree_on_one_key(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.Queue[str] = ctx.Queue()
    procs = [ctx.Process(target=_create, args=(str(tmp_path), out)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(10)
    ids = {out.get(timeout=5) for _ in procs}
    assert ids == {NodeIdentity.load_or_create(tmp_path).node_id}


def test_receipts_verify_with_the_public_key_only(tmp_path: Path) -> None:
    ident = NodeIdentity.load_or_create(tmp_path)
    record = UsageRecord(
        request_id="req-1", route="/v1/chat/completions", model="m", status=200, stream=True,
        prompt_tokens=5, completion_tokens=7, started_at=1.0,
    )  # fmt: skip
    receipt = ident.sign_receipt(record)
    claims = ReceiptClaims.model_validate(
        verify(receipt.token, parse_public_key(ident.public_key_text), RECEIPT_TOKEN, issuer=ident.node_id)
    )
    assert claims.iss == ident.node_id and claims.usage == record
    stranger = NodeIdentity.load_or_create(tmp_path / "stranger")
    with pytest.raises(TokenRefused, match="does not match"):
        verify(receipt.token, stranger.public_key, RECEIPT_TOKEN, issuer=ident.node_id)
    # Changing a figure breaks the signature.
    header, payload, sig = receipt.token.split(".")
    forged = jwt.utils.base64url_encode(
        jwt.utils.base64url_decode(payload).replace(b'"completion_tokens":7', b'"completion_tokens":1')
    ).decode()
    with pytest.raises(TokenRefused, match="does not match"):
        verify(f"{header}.{forged}.{sig}", ident.public_key, RECEIPT_TOKEN, issuer=ident.node_id)


def test_request_auth_binds_method_path_and_body(tmp_path: Path) -> None:
    ident = NodeIdentity.load_or_create(tmp_path)
    token = ident.request_auth("post", "/v1/nodes/x/heartbeat", b"{}", audience="tracker-a")
    claims = verify(token, ident.public_key, NODE_CALL_TOKEN, issuer=ident.node_id, audience="tracker-a", body=b"{}")
    # Bound to one tracker: another tracker (another issuer) refuses the same token.
    with pytest.raises(TokenRefused, match="aud"):
        verify(token, ident.public_key, NODE_CALL_TOKEN, issuer=ident.node_id, audience="tracker-b", body=b"{}")
    assert claims["htm"] == "POST" and claims["htu"] == "/v1/nodes/x/heartbeat" and claims["iss"] == ident.node_id
    assert claims["exp"] - claims["iat"] <= 60
