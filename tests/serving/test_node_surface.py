"""The node's listener as its table (`serving/node_surface`), played from the attacker's side row by row.

The table is built with every door open (the pages with the chat, `/metrics`, the control proof, the
audit) and each test walks `table.rows`: a row added without its line in `ROWS` fails
`test_every_row_of_the_table_has_its_attack`, so a new door cannot arrive untested. Every refusal
must be OpenAI's error JSON, whichever door gave it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshnet_gguf.contract.model_proof import AUDIT_PATH, AUDIT_TOKEN_HEADER, AUDIT_TOKEN_SUBJECT, AuditRequest, AuditVerdict
from meshnet_gguf.contract.protocol import NODE_CONTROL_PATH, HealthReport
from meshnet_gguf.contract.signing import body_sha256, encode_token, public_key_text, tracker_issuer_for
from meshnet_gguf.serving.access import LocalOrKey, PageAccess
from meshnet_gguf.serving.audit_door import MAX_AUDIT_BODY_BYTES, AuditDoor
from meshnet_gguf.serving.node_surface import NodeDoors, node_table
from meshnet_gguf.serving.routes import Route, RouteTable
from meshnet_gguf.serving.status_page import STATIC_FILES, ChatUi, NodePages, RecentRequests, StatusSource
from support.fake_upstream import ALIAS
from support.proxy_harness import CHAT, MAX_BODY_BYTES, Exchange, ProxyUnderTest, build_proxy

pytestmark = pytest.mark.anyio

API_KEY = "the-nodes-api-key"
OPERATOR_KEY = "the-operators-metrics-key"
LOOPBACK = ("127.0.0.1", 40000)
REMOTE = ("192.0.2.7", 40000)
# A stream the relay link opened reaches the listener from loopback too; the link knows its port.
RELAYED = ("127.0.0.1", 45555)
TRACKER = Ed25519PrivateKey.generate()
VERDICT = AuditVerdict(audit_id="audit-surface", outcome="no_verdict", reason="scored by the test", margin_nats=0.0, positions_checked=0)


@dataclass(frozen=True)
class Attack:
    """What one row takes, and what keeps it: the path a request uses, the headers that open its guard
    (none: open to all), and whether the relay's callers (and remote ones) must find no such path."""

    path: str
    opener: dict[str, str] | Callable[[], dict[str, str]] | None = None
    hidden_from_relay: bool = False
    local_only: bool = False
    body: bytes = b""

    @property
    def credential(self) -> dict[str, str] | None:
        """The headers that open the row's guard, made when asked: a signed token's life is short, and a slow run
        may reach the row a minute after this module was read."""
        return self.opener() if callable(self.opener) else self.opener


def _audit_body() -> bytes:
    asked = AuditRequest(audit_id="audit-surface", model=ALIAS, path="/v1/completions", answer_text=" and the sea",
                         body='{"prompt": "hello", "max_tokens": 8, "temperature": 0}')  # fmt: skip
    return asked.model_dump_json().encode()


def _audit_token(body: bytes) -> str:
    now = int(time.time())
    claims = {"iss": tracker_issuer_for(TRACKER.public_key()), "sub": AUDIT_TOKEN_SUBJECT, "jti": "audit-surface",
              "iat": now, "exp": now + 30, "body_sha256": body_sha256(body)}  # fmt: skip
    return encode_token(claims, TRACKER)


KEYED = {"authorization": f"Bearer {API_KEY}"}
CHAT_BODY = json.dumps(CHAT).encode()
AUDIT_BODY = _audit_body()

# Every row of the table, by (method, path as the row names it).
ROWS: dict[tuple[str, str], Attack] = {
    ("GET", "/health"): Attack("/health"),
    ("HEAD", "/health"): Attack("/health"),
    ("POST", "/v1/chat/completions"): Attack("/v1/chat/completions", KEYED, body=CHAT_BODY),
    ("POST", "/v1/completions"): Attack("/v1/completions", KEYED, body=b'{"prompt": "hi", "max_tokens": 2}'),
    ("POST", "/v1/embeddings"): Attack("/v1/embeddings", KEYED, body=b'{"input": "hi"}'),
    ("GET", "/v1/models"): Attack("/v1/models", KEYED),
    ("GET", "/v1/models/"): Attack(f"/v1/models/{ALIAS}", KEYED),
    **{(method, path): Attack(path) for path in STATIC_FILES for method in ("GET", "HEAD")},
    ("GET", "/status.json"): Attack("/status.json", KEYED, hidden_from_relay=True),
    ("GET", "/chat"): Attack("/chat"),
    ("GET", "/chat/props"): Attack("/chat/props", KEYED, hidden_from_relay=True),
    ("GET", "/chat/"): Attack("/chat/"),
    ("POST", "/chat/v1/chat/completions"): Attack("/chat/v1/chat/completions", KEYED, body=CHAT_BODY),
    ("GET", "/chat/v1/models"): Attack("/chat/v1/models", KEYED),
    ("GET", "/metrics"): Attack("/metrics", {"authorization": f"Bearer {OPERATOR_KEY}"}, hidden_from_relay=True, local_only=True),
    ("GET", NODE_CONTROL_PATH): Attack(NODE_CONTROL_PATH),
    ("POST", AUDIT_PATH): Attack(
        AUDIT_PATH, lambda: {AUDIT_TOKEN_HEADER: _audit_token(AUDIT_BODY)}, hidden_from_relay=True, body=AUDIT_BODY
    ),
}


def _relayed(address: tuple[str, int]) -> bool:
    return address == RELAYED


async def _scrape() -> tuple[int, bytes, str]:
    return 200, b"meshnet_up 1\n", "text/plain; version=0.0.4"


async def _control(query: object) -> tuple[int, bytes, str]:
    return 200, b'{"signed": "by the node"}', "application/json"


async def _score(client: httpx.AsyncClient, asked: AuditRequest) -> AuditVerdict:
    return VERDICT


def _surface() -> tuple[RouteTable, ProxyUnderTest]:
    """The table as `node/listener` builds it, every door open, a standalone node with an API key."""
    proxy = build_proxy(api_key=API_KEY)
    health = proxy.proxy_app._health
    status = StatusSource(health=health, recent=RecentRequests(), plan="CPU only", chat=True)
    pages = NodePages(
        status=status,
        access=PageAccess(api_key=API_KEY, meshed=False, relayed=_relayed),
        chat=ChatUi(proxy.proxy_app._upstream, proxy.upstream),
    )
    door = AuditDoor(_score, "http://127.0.0.1:9", public_key_text(TRACKER.public_key()))
    doors = NodeDoors(
        proxy.proxy_app,
        health,
        pages,
        metrics=_scrape,
        metrics_access=LocalOrKey(_relayed, OPERATOR_KEY),
        control=(NODE_CONTROL_PATH, _control),
        audit=door,
    )
    return node_table(doors), proxy


def _rows() -> Iterator[tuple[Route, Attack]]:
    table, _ = _surface()
    for row in table.rows:
        yield row, ROWS[(row.method, row.path)]


def _ids() -> list[str]:
    return [f"{method} {path}" for method, path in ROWS]


async def _call(
    table: RouteTable,
    method: str,
    path: str,
    *,
    headers: dict[str, str] | None = None,
    body: bytes = b"",
    client: tuple[str, int] = LOOPBACK,
) -> Exchange:
    exchange = Exchange(table, method, path, body=body, headers={"host": "127.0.0.1:8080", **(headers or {})}, client=client)
    async with exchange:
        await exchange.read_to_end()
    return exchange


def _spoiled(credential: str) -> str:
    """The credential with one character in its middle changed. Not its last: the last character of a token's
    base64url signature carries padding bits, and a change there may decode to the very same signature."""
    middle = len(credential) // 2
    return credential[:middle] + ("y" if credential[middle] == "x" else "x") + credential[middle + 1 :]


def _openai_error(exchange: Exchange, status: int, code: str | None = None) -> dict[str, object]:
    """The refusal is OpenAI's error JSON, with the status asked for."""
    assert exchange.status == status, (exchange.status, exchange.body)
    assert exchange.headers["content-type"] == "application/json"
    error = json.loads(exchange.body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if code is not None:
        assert error["code"] == code, error
    return error


def test_every_row_of_the_table_has_its_attack() -> None:
    table, _ = _surface()
    served = [(row.method, row.path) for row in table.rows]
    assert sorted(served) == sorted(ROWS), "a row without its attack here, or an attack on a row that went"
    assert len(set(served)) == len(served)


@pytest.mark.parametrize("row_key", list(ROWS), ids=_ids())
async def test_a_method_no_row_takes_is_a_405_in_openai_shape(row_key: tuple[str, str]) -> None:
    table, proxy = _surface()
    attack = ROWS[row_key]
    answer = await _call(table, "PATCH", attack.path, headers=attack.credential)
    _openai_error(answer, 405, "method_not_allowed")
    assert row_key[0] in answer.headers["allow"].split(", ")
    assert proxy.upstream.requests == []


@pytest.mark.parametrize("path", ["/nothing-here", "/v1/chat/completion", "/v1/modelsx", "/metrics/", "/chatty", "/v1/proof/audit/x"])
async def test_a_path_no_row_takes_is_a_404_in_openai_shape(path: str) -> None:
    table, proxy = _surface()
    for method in ("GET", "POST"):
        _openai_error(await _call(table, method, path, headers=KEYED), 404, "not_found")
    assert proxy.upstream.requests == []


@pytest.mark.parametrize("row_key", [key for key, attack in ROWS.items() if attack.credential is not None], ids=str)
async def test_a_guarded_row_refuses_a_caller_without_its_credential_or_with_a_wrong_one(row_key: tuple[str, str]) -> None:
    table, proxy = _surface()
    method, attack = row_key[0], ROWS[row_key]
    assert attack.credential is not None
    wrong = {name: _spoiled(value) for name, value in attack.credential.items()}
    for headers in ({}, wrong):
        # From another machine: the metrics' rule lets this machine in without the key.
        client = REMOTE if attack.local_only else LOOPBACK
        refused = await _call(table, method, attack.path, headers=headers, body=attack.body, client=client)
        error = _openai_error(refused, refused.status or 0)
        assert refused.status in (401, 403, 404), (headers, error)
    assert proxy.upstream.requests == []  # nothing reached llama-server
    allowed = await _call(table, method, attack.path, headers=attack.credential, body=attack.body)
    assert allowed.status not in (401, 403), allowed.body  # the credential is what opened the door


@pytest.mark.parametrize("row_key", list(ROWS), ids=_ids())
async def test_a_body_over_the_rows_limit_is_refused_before_it_is_read(row_key: tuple[str, str]) -> None:
    table, proxy = _surface()
    method, attack = row_key[0], ROWS[row_key]
    limit = {AUDIT_PATH: MAX_AUDIT_BODY_BYTES}.get(attack.path, MAX_BODY_BYTES if attack.body else 0)
    # Declared over the limit: the body itself need not come (a client may declare a gigabyte and send nothing).
    declared = {**(attack.credential or {}), "content-length": str(limit + 1)}
    _openai_error(await _call(table, method, attack.path, headers=declared, body=b"{}"), 413, "body_too_large")
    if attack.body:  # and a body that grows over it without a declared length
        chunks = [b"{", b" " * limit, b"}"]
        exchange = Exchange(table, method, attack.path, body_chunks=chunks, headers=attack.credential, client=LOOPBACK)
        async with exchange:
            await exchange.read_to_end()
        _openai_error(exchange, 413, "body_too_large")
    assert proxy.upstream.requests == []


@pytest.mark.parametrize("row_key", [key for key, attack in ROWS.items() if attack.hidden_from_relay], ids=str)
async def test_a_relayed_caller_finds_no_such_path_on_a_row_kept_from_the_relay(row_key: tuple[str, str]) -> None:
    table, proxy = _surface()
    method, attack = row_key[0], ROWS[row_key]
    headers = {} if attack.local_only else attack.credential  # the pages' key and the audit's token do not open the relay
    for asked in (method, "PATCH"):  # nor does another method show that the path exists
        _openai_error(await _call(table, asked, attack.path, headers=headers, body=attack.body, client=RELAYED), 404, "not_found")
    if attack.local_only:
        _openai_error(await _call(table, method, attack.path, client=REMOTE), 404, "not_found")
        assert (await _call(table, method, attack.path, client=LOOPBACK)).status == 200  # this machine, not relayed
    assert proxy.upstream.requests == []


async def test_the_audit_door_refuses_in_openai_shape_and_answers_a_signed_audit() -> None:
    table, _ = _surface()
    token = {AUDIT_TOKEN_HEADER: _audit_token(AUDIT_BODY)}
    unsigned = await _call(table, "POST", AUDIT_PATH, body=AUDIT_BODY)
    assert "no audit token" in str(_openai_error(unsigned, 401, "invalid_audit_token")["message"])
    other_body = await _call(table, "POST", AUDIT_PATH, headers=token, body=AUDIT_BODY.replace(b"the sea", b"the land"))
    _openai_error(other_body, 401, "invalid_audit_token")
    not_a_request = b'{"audit_id": 1}'
    refused = await _call(table, "POST", AUDIT_PATH, headers={AUDIT_TOKEN_HEADER: _audit_token(not_a_request)}, body=not_a_request)
    _openai_error(refused, 400, "invalid_audit")
    signed = await _call(table, "POST", AUDIT_PATH, headers=token, body=AUDIT_BODY)
    assert signed.status == 200 and AuditVerdict.model_validate_json(signed.body) == VERDICT


async def test_an_audit_while_the_tracker_key_is_unknown_is_a_503_with_retry_after() -> None:
    proxy = build_proxy()
    door = AuditDoor(_score, "http://127.0.0.1:9", lambda: None)
    table = node_table(NodeDoors(proxy.proxy_app, lambda: HealthReport(state="ready", model=ALIAS), audit=door))
    answer = await _call(table, "POST", AUDIT_PATH, headers={AUDIT_TOKEN_HEADER: _audit_token(AUDIT_BODY)}, body=AUDIT_BODY)
    _openai_error(answer, 503, "verifier_unavailable")
    assert answer.headers["retry-after"]
