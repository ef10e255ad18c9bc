"""Receipts and usage: a node's signed usage for a request this tracker routed, checked and billed.

A receipt is taken only when its signature is the node's (keys are kept in the ledger, so
receipts verify before the node re-registers after a restart), it names a request this tracker
routed to that node, and it claims no more than the route allowed or the body could hold. The
bill is the smaller of the node's figures and what the tracker counted as it forwarded; a node
whose figures differ beyond the tolerance is flagged. `GET /v1/usage` lists what was billed.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.contract.protocol import ReceiptAck, ReceiptBatch, ReceiptClaims, ReceiptRejection, UsageReceipt
from meshnet_gguf.contract.signing import TokenRefused, parse_public_key, verify
from meshnet_gguf.contract.token_policies import RECEIPT_TOKEN
from meshnet_gguf.reference.tracker.ledger import ForwardedRequest, TrackerLedger
from meshnet_gguf.reference.tracker.node_calls import NodeCalls
from meshnet_gguf.reference.tracker.request_io import control_body, error_response, model_response, parse_body

log = logging.getLogger(__name__)

# A receipt signed this far in the future (a node clock running ahead) is left for a later resend;
# further than this it is refused for good.
FUTURE_RECEIPT_RETRY_WINDOW_S = 300
# A chat template wraps each prompt in role markers and sometimes a default system prompt; a
# prompt cannot hold more tokens than its body has bytes plus this.
PROMPT_TEMPLATE_ALLOWANCE_TOKENS = 2048
# `GET /v1/usage?limit=N`: N is 1..this.
MAX_USAGE_LIST_LIMIT = 10_000
DEFAULT_USAGE_LIST_LIMIT = 100


class _NotYet(Exception):
    """A receipt that may be accepted later: left out of both lists of the acknowledgement."""


class Receipts:
    def __init__(self, ledger: TrackerLedger, calls: NodeCalls) -> None:
        self.ledger = ledger
        self.calls = calls

    async def receive(self, request: Request) -> Response:
        node_id = request.path_params["node_id"]
        try:
            # Keys are kept in the ledger, so receipts verify even before the node re-registers
            # after a tracker restart.
            key_text = await self.ledger.node_key(node_id)
            if key_text is None:
                raise ApiError(404, "unknown_node", f"node {node_id} never registered here")
            key = parse_public_key(key_text)
            body = await control_body(request)
            self.calls.verify(request, body, node_id, key)
            batch = parse_body(ReceiptBatch, body)
            if batch.node_id != node_id:
                raise ApiError(400, "wrong_node", "batch node_id differs from the path")
        except ApiError as refusal:
            return error_response(refusal)
        ack = ReceiptAck()
        for receipt in batch.receipts:
            try:
                await self._accept(node_id, key, receipt)
            except _NotYet as later:
                log.warning("receipt %s from %s left for a resend: %s", receipt.request_id, node_id, later)
                continue
            except ApiError as refusal:
                log.warning("receipt %s from %s refused: %s", receipt.request_id, node_id, refusal.message)
                ack.rejected.append(ReceiptRejection(request_id=receipt.request_id, code=refusal.code, message=refusal.message))
            else:
                ack.accepted.append(receipt.request_id)
        return model_response(ack)

    async def _accept(self, node_id: str, key: Ed25519PublicKey, receipt: UsageReceipt) -> None:
        try:
            claims = ReceiptClaims.model_validate(verify(receipt.token, key, RECEIPT_TOKEN, issuer=node_id))
        except TokenRefused as exc:
            raise _refusal(exc) from None
        except ValidationError as exc:
            raise ApiError(400, "malformed", f"receipt is not valid: {exc}") from None
        if not (claims.jti == claims.usage.request_id == receipt.request_id):
            raise ApiError(400, "malformed", "receipt request ids disagree")
        forwarded = await self.ledger.forwarded(receipt.request_id)
        if forwarded is None:
            raise ApiError(400, "unknown_request", "this tracker never routed that request")
        if forwarded.node_id != node_id:
            raise ApiError(400, "wrong_node", f"request was routed to {forwarded.node_id}")
        check_plausible(claims.usage, forwarded)
        if await self.ledger.store_receipt(node_id, claims.usage, receipt.token):
            await self.flag_mismatch(receipt.request_id)

    async def flag_mismatch(self, request_id: str) -> None:
        """Flag the node when its signed figures differ from what this tracker forwarded beyond the
        tolerance (both must be in). The bill is the smaller figure either way."""
        usage = await self.ledger.usage(request_id)
        if usage is not None and usage.flagged and await self.ledger.mark_flagged(request_id):
            log.warning(
                "receipt disagrees for %s on %s: tracker counted %s, node signed %s; billed %s",
                request_id, usage.node_id, usage.tracker.model_dump(), usage.node.model_dump() if usage.node else None,
                usage.billed.model_dump() if usage.billed else None,
            )  # fmt: skip

    async def usage(self, request: Request) -> Response:
        usage = await self.ledger.usage(request.path_params["request_id"])
        if usage is None:
            return error_response(ApiError(404, "unknown_request", "no request with that id was routed here"))
        return model_response(usage)

    async def usage_list(self, request: Request) -> Response:
        given = request.query_params.get("limit", str(DEFAULT_USAGE_LIST_LIMIT))
        if not given.isdigit() or not 1 <= int(given) <= MAX_USAGE_LIST_LIMIT:
            return error_response(ApiError(400, "bad_limit", f"limit must be a whole number from 1 to {MAX_USAGE_LIST_LIMIT}"))
        return JSONResponse([u.model_dump() for u in await self.ledger.usage_list(limit=int(given))])


def _refusal(refused: TokenRefused) -> Exception:
    if refused.fault == "bad_signature":
        return ApiError(400, "bad_signature", "receipt signature does not match the node key")
    if refused.fault == "wrong_issuer":
        return ApiError(400, "wrong_node", f"receipt is not signed for this node: {refused}")
    if refused.fault == "not_yet_valid" and refused.claims is not None:
        # The signature checked out; only the node's clock runs ahead. Within the window it is
        # left unsettled, so the node sends it again once our clock has caught up.
        ahead = float(refused.claims.get("iat", 0)) - time.time()
        if ahead <= FUTURE_RECEIPT_RETRY_WINDOW_S:
            return _NotYet(f"signed {ahead:.0f} s in the future; check the node's clock (NTP)")
        return ApiError(400, "from_the_future", f"receipt signed {ahead:.0f} s in the future")
    return ApiError(400, "malformed", f"receipt is not valid: {refused}")


def check_plausible(usage: Any, forwarded: ForwardedRequest) -> None:
    """A signed receipt still cannot claim more than the route allowed or the body could hold."""
    if usage.route != forwarded.path or usage.model != forwarded.model:
        raise ApiError(400, "malformed", "receipt names another path or model than the route")
    ceiling = (forwarded.max_tokens or 0) * forwarded.choices
    if usage.completion_tokens > ceiling:
        raise ApiError(400, "implausible", f"receipt claims {usage.completion_tokens} completion tokens; the route allowed {ceiling}")
    prompt_ceiling = forwarded.body_bytes + PROMPT_TEMPLATE_ALLOWANCE_TOKENS
    if usage.prompt_tokens > prompt_ceiling:
        raise ApiError(
            400, "implausible", f"receipt claims {usage.prompt_tokens} prompt tokens; a {forwarded.body_bytes}-byte body holds fewer"
        )
    if usage.cached_tokens > usage.prompt_tokens:
        raise ApiError(400, "implausible", "receipt claims more cached tokens than prompt tokens")
