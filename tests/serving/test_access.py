"""The node's HTTP access rules (`serving/access`, `contract/bearer`), each played from the attacker's side once.

Every door of the node (the proxy's key and Host checks, the pages, `/metrics`) is built
from these rules, so a refusal proven here holds at each door; the doors' own tests
(test_status_page, test_proxy_admission, test_relay_edge) check that they use them.
"""

from __future__ import annotations

import httpx
import pytest

from meshnet_gguf.common.asgi import Scope, respond
from meshnet_gguf.contract.bearer import bearer_matches, bearer_token
from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.serving.access import (
    LocalOrKey,
    PageAccess,
    answered_hosts,
    check_api_key,
    check_host,
    local_and_not_relayed,
    open_to_the_network,
)
from meshnet_gguf.serving.routes import Request, Route, RouteTable

KEY = "s3cret-operator-key"
LOOPBACK = ("127.0.0.1", 40000)
REMOTE = ("192.0.2.7", 40000)
# The relay link's streams reach the listener from loopback too; the link knows their ports.
RELAYED = ("127.0.0.1", 45555)


def _relayed(address: tuple[str, int]) -> bool:
    return address == RELAYED


def _refused(check: object, *args: object) -> ApiError:
    with pytest.raises(ApiError) as refused:
        check(*args)  # type: ignore[operator]
    return refused.value


def test_the_bearer_key_is_refused_wrong_shorter_longer_or_in_another_scheme() -> None:
    for given in ("", "Bearer", "Bearer ", "Bearer s3cret", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}X", f"Basic {KEY}", f"bearer {KEY}", KEY):
        assert not bearer_matches(given.encode("latin-1"), KEY), given
        assert _refused(check_api_key, {"authorization": given}, KEY).status == 401
    assert _refused(check_api_key, {}, KEY).code == "invalid_api_key"
    assert bearer_matches(f"Bearer {KEY}".encode(), KEY)
    check_api_key({"authorization": f"Bearer {KEY}"}, KEY)


def test_a_key_beyond_latin1_is_not_matched_by_question_marks() -> None:
    # Encoding the key as latin-1 with replacement made "Bearer ????" the key "ключ".
    assert not bearer_matches(b"Bearer ????", "ключ")
    assert _refused(check_api_key, {"authorization": "Bearer ????"}, "ключ").status == 401
    assert bearer_matches("Bearer ключ".encode(), "ключ")


def test_the_status_token_needs_the_bearer_scheme_and_a_token() -> None:
    for given in ("", "Bearer", "Bearer ", "Basic abc", "abc"):
        assert bearer_token(given) is None, given
    assert bearer_token("bearer abc") == "abc"


def test_only_this_machine_and_never_the_relay_counts_as_local() -> None:
    assert not local_and_not_relayed(REMOTE, _relayed)
    assert not local_and_not_relayed(RELAYED, _relayed)  # loopback, but the relay link's own
    assert not local_and_not_relayed(None, None)  # no peer address: nothing to trust
    assert not local_and_not_relayed(("not-an-address", 1), None)
    assert not local_and_not_relayed(("::ffff:192.0.2.7", 1), None)
    assert local_and_not_relayed(LOOPBACK, _relayed)
    assert local_and_not_relayed(("::1", 1), None)


def test_a_foreign_host_header_is_refused() -> None:
    allowed = answered_hosts(["node.example"])
    for host in ("evil.example", "evil.example:8080", "localhost.evil.example", "", "[::1", "node.example.evil"):
        assert _refused(check_host, {"host": host}, allowed).code == "host_not_allowed", host
    assert _refused(check_host, {}, allowed).status == 403
    for host in ("localhost:8080", "127.0.0.1", "[::1]:8080", "NODE.example", "app.localhost"):
        check_host({"host": host}, allowed)


def _scope(client: tuple[str, int] | None, host: str = "127.0.0.1", authorization: str | None = None) -> Scope:
    headers = [(b"host", host.encode())] + ([(b"authorization", authorization.encode())] if authorization else [])
    return {"type": "http", "path": "/status.json", "headers": headers, "client": client}


def _page_refusal(access: PageAccess, client: tuple[str, int] | None, **kw: str) -> int:
    scope = _scope(client, **kw)
    headers = {k.decode(): v.decode() for k, v in scope["headers"]}
    return _refused(access.check, scope, headers).status


def test_the_pages_refuse_the_relay_a_remote_caller_of_a_meshed_node_a_foreign_host_and_a_wrong_key() -> None:
    meshed = PageAccess(api_key=None, meshed=True, relayed=_relayed)
    assert _page_refusal(meshed, RELAYED) == 404
    assert _page_refusal(meshed, REMOTE) == 403
    assert _page_refusal(meshed, None) == 403
    assert _page_refusal(meshed, LOOPBACK, host="evil.example") == 403
    keyed = PageAccess(api_key=KEY, meshed=False, relayed=_relayed)
    assert _page_refusal(keyed, LOOPBACK, authorization="Bearer wrong") == 401
    assert _page_refusal(keyed, LOOPBACK) == 401
    assert _page_refusal(keyed, RELAYED, authorization=f"Bearer {KEY}") == 404  # the key does not open the relay


async def _metrics(request: Request) -> None:
    await respond(request.send, 200, b"meshnet_up 1\n", [(b"content-type", b"text/plain")])


@pytest.mark.anyio
async def test_metrics_are_refused_to_a_stranger_a_relayed_caller_and_a_wrong_key_as_an_unknown_path() -> None:
    guard = RouteTable([Route("GET", "/metrics", LocalOrKey(_relayed, KEY), _metrics)])

    async def get(client: tuple[str, int], **headers: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=guard, client=client)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as http:
            return await http.get("/metrics", headers=headers)

    for client, headers in [
        (REMOTE, {}),
        (RELAYED, {}),
        (REMOTE, {"authorization": "Bearer wrong"}),
        (REMOTE, {"authorization": f"Bearer {KEY}extra"}),
        (RELAYED, {"authorization": f"bearer {KEY}"}),
    ]:
        refused = await get(client, **headers)
        assert refused.status_code == 404, (client, headers)
        assert refused.json()["error"]["code"] == "not_found"
    assert (await get(LOOPBACK)).status_code == 200
    assert (await get(REMOTE, authorization=f"Bearer {KEY}")).status_code == 200


def test_an_allowed_host_is_answered_and_no_other_name_is() -> None:
    allowed = answered_hosts(["127.0.0.1", "node.lan", "proxy.example.net"])
    for host in ("node.lan", "NODE.LAN:8080", "proxy.example.net", "localhost:8080", "192.168.1.20:8080"):
        check_host({"host": host}, allowed)
    # Names that contain, end with or start like an allowed one are other names.
    for host in ("evil.example", "node.lan.evil.example", "evil-node.lan", "xnode.lan", "node.lanx", "node.lan@evil.example", ""):
        assert _refused(check_host, {"host": host}, allowed).status == 403, host


def test_a_node_open_to_the_network_without_a_key_is_warned_about() -> None:
    for host in ("0.0.0.0", "::", "192.168.1.20", "node.lan"):
        warning = open_to_the_network(host, None, meshed=False)
        assert warning is not None and host in warning and "--api-key" in warning
    for host in ("127.0.0.1", "::1", "localhost"):
        assert open_to_the_network(host, None, meshed=False) is None
    assert open_to_the_network("0.0.0.0", KEY, meshed=False) is None
    assert open_to_the_network("0.0.0.0", None, meshed=True) is None  # only signed routes get in
