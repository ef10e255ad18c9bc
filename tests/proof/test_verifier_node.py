"""`meshnet-gguf serve --verifier`: a real node that verifies the model it serves, for a real
`meshnet-gguf dev tracker --verifier MODEL=URL`, with the real llama-server and generated models.

The tracker probes each new node through the verifier node: the honest node (the same weights)
becomes routable, the impostor (another seed under the same name) is caught at registration.
The verifier node answers only audits its tracker signed (401 otherwise), standalone (the key it was
given) or meshed (the honest node is a verifier too, trusting the key its link pinned), and a node serving
without --verifier has no audit path at all (404, whoever signed the audit)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from support.mesh_tracker import tracker_key
from support.node_process import NodeProcess
from support.tracker_process import MESSAGES, TrackerProcess, sdk, wait_for

from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.contract.model_proof import AUDIT_PATH, AUDIT_TOKEN_HEADER, AUDIT_TOKEN_SUBJECT, AuditRequest, AuditVerdict
from meshnet_gguf.contract.signing import body_sha256, encode_token, load_or_create_private_key, public_key_text, tracker_issuer_for
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.mesh.identity import NodeIdentity
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model
from meshnet_gguf.proof.audit import audit
from meshnet_gguf.serving.audit_door import AuditDoor, audit_route
from meshnet_gguf.serving.routes import RouteTable
from meshnet_gguf.reference.tracker.app import TRACKER_KEY_FILE
from meshnet_gguf.reference.tracker.audits import PROBE_PROMPTS

pytestmark = [pytest.mark.real_llama, pytest.mark.slow]

# Large enough that a random model's next-token distribution is not flat (bench/bench_model_proof.py).
SHAPE = TinyModelSpec(n_layers=4, n_embd=256, n_head=8, n_head_kv=4, n_ff=512)
MODEL = "tiny"
SERVE = ("--parallel", "1", "--ctx-size", "2048")
PROBED_S = 180.0


@pytest.fixture(scope="module")
def mesh(real_llama: BinaryInfo, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A dev tracker that names a `serve --verifier` node for MODEL, an honest node and an impostor."""
    root = tmp_path_factory.mktemp("verifier-node")
    claimed = write_tiny_model(root / "claimed" / f"{MODEL}.gguf", SHAPE)
    other = write_tiny_model(root / "other" / f"{MODEL}.gguf", TinyModelSpec(**{**SHAPE.__dict__, "seed": 1}))
    # The tracker's key exists before it starts, so the verifier node can be told it (as an operator copies it).
    key = tracker_key(root / "tracker")
    started: list[Any] = []
    try:
        verifier = NodeProcess(["--gguf", str(claimed), "--verifier", "--tracker-public-key", key, *SERVE], workdir=_dir(root / "verifier"))
        started.append(verifier)
        verifier.wait_ready()
        tracker = TrackerProcess(root, "--verifier", f"{MODEL}={verifier.url}")
        started.append(tracker)
        enrol = tracker.enrolment()  # the key is learnt on first contact (loopback) and pinned
        nodes = {}
        for name, gguf, extra in (("honest", claimed, ["--verifier"]), ("impostor", other, [])):
            node = NodeProcess(["--gguf", str(gguf), "--tracker", tracker.url, *extra, *SERVE], workdir=_dir(root / name), env=enrol)
            started.append(node)
            nodes[name] = node
        for node in nodes.values():
            node.wait_ready()
        # Registered: each has pinned the tracker's key by then.
        wait_for(lambda: len(_listed(tracker)) == len(nodes), "both nodes registered", tracker.log_path)
        yield {"tracker": tracker, "verifier": verifier, "key": key, "root": root, **nodes}
    finally:
        for proc in reversed(started):
            proc.close()


def _dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _listed(tracker: TrackerProcess) -> dict[str, dict[str, Any]]:
    return {n["node_id"]: n for n in httpx.get(tracker.url + "/v1/nodes", timeout=5).json()}


def _audits_settled(mesh: dict[str, Any], node: str) -> bool:
    """No audit pending at the tracker, and `node` has no slot at work."""
    metrics = httpx.get(mesh["tracker"].url + "/metrics", timeout=5).text
    health = httpx.get(mesh[node].url + "/health", timeout=5).json()
    return "\nmeshnet_tracker_audits_pending 0.0\n" in metrics and health["slots_busy"] == 0


def _node_id(node: NodeProcess) -> str:
    return NodeIdentity.load_or_create(node.state_dir).node_id  # the key the running node made


def test_a_dev_tracker_audits_through_a_serve_verifier_node(mesh: dict[str, Any]) -> None:
    tracker, honest, impostor = mesh["tracker"], mesh["honest"], mesh["impostor"]
    ids = {name: _node_id(mesh[name]) for name in ("honest", "impostor")}

    def probed() -> bool:
        listed = _listed(tracker)
        return all(i in listed for i in ids.values()) and listed[ids["honest"]]["audits"]["passed"] >= len(PROBE_PROMPTS) \
            and listed[ids["impostor"]]["audits"]["failed"] >= 1  # fmt: skip

    wait_for(probed, "both registration probes decided by the verifier node", mesh["verifier"].log_path, timeout=PROBED_S)
    listed = _listed(tracker)
    assert listed[ids["honest"]]["audits"]["failed"] == 0 and not listed[ids["honest"]]["proof_blocked"]
    assert listed[ids["impostor"]]["proof_blocked"] and listed[ids["impostor"]]["audits"]["last_verdict"]["outcome"] == "failed"
    # Clients reach the honest node only: every answer comes from the weights the verifier holds.
    for _ in range(4):
        answer = sdk(tracker).chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        request_id = answer.http_response.headers["x-meshnet-request-id"]
        assert httpx.get(f"{tracker.url}/v1/usage/{request_id}", timeout=5).json()["node_id"] == ids["honest"]
    assert honest.proc.poll() is None and impostor.proc.poll() is None


def _audit(key: Ed25519PrivateKey, body: bytes, *, issuer: str | None = None, subject: str = AUDIT_TOKEN_SUBJECT) -> str:
    now = int(time.time())
    claims = {"iss": issuer or tracker_issuer_for(key.public_key()), "sub": subject, "jti": "audit-test", "iat": now, "exp": now + 60,
              "body_sha256": body_sha256(body)}  # fmt: skip
    return encode_token(claims, key)


def _request_body(text: str = " and the sea") -> bytes:
    asked = AuditRequest(audit_id="audit-test", model=MODEL, path="/v1/completions", answer_text=text,
                         body='{"model": "tiny", "prompt": "hello world, this is a test of", "max_tokens": 8, "temperature": 0}')  # fmt: skip
    return asked.model_dump_json().encode()


@pytest.mark.parametrize("verifier", ["verifier", "honest"])
def test_the_verifier_node_answers_only_audits_its_tracker_signed(mesh: dict[str, Any], verifier: str) -> None:
    url = mesh[verifier].url + AUDIT_PATH
    tracker_private = load_or_create_private_key(mesh["root"] / "tracker" / TRACKER_KEY_FILE)
    stranger = Ed25519PrivateKey.generate()
    body = _request_body()
    forged = {
        "unsigned": None,
        "garbage": "not.a.token",
        "another key": _audit(stranger, body),
        "another key, the tracker's issuer": _audit(stranger, body, issuer=tracker_issuer_for(tracker_private.public_key())),
        "the tracker's key, another body": _audit(tracker_private, _request_body(" and the land")),
        "the tracker's key, a route token's subject": _audit(tracker_private, body, subject="route"),
    }
    for what, token in forged.items():
        headers = {"content-type": "application/json", **({} if token is None else {AUDIT_TOKEN_HEADER: token})}
        refused = httpx.post(url, content=body, headers=headers, timeout=30)
        assert refused.status_code == 401, (what, refused.text)
        assert refused.json()["error"]["code"] == "invalid_audit_token", (what, refused.text)  # OpenAI's shape, as every door
    wrong_method = httpx.get(url, timeout=5)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"
    # The tracker's own signature is answered with a verdict (scored by the node's llama-server), once the tracker's
    # own audits (registration probes, answers drawn) leave the node's one slot free: busy, it answers 503, as designed.
    wait_for(lambda: _audits_settled(mesh, verifier), "the tracker's audits decided and the node's slot free", mesh[verifier].log_path)
    signed = httpx.post(url, content=body, headers={AUDIT_TOKEN_HEADER: _audit(tracker_private, body)}, timeout=120)
    assert signed.status_code == 200, signed.text
    assert AuditVerdict.model_validate_json(signed.content).audit_id == "audit-test"


def test_a_node_serving_without_verifier_has_no_audit_path(mesh: dict[str, Any]) -> None:
    tracker_private = load_or_create_private_key(mesh["root"] / "tracker" / TRACKER_KEY_FILE)
    body = _request_body()
    answer = httpx.post(
        mesh["impostor"].url + AUDIT_PATH, content=body, headers={AUDIT_TOKEN_HEADER: _audit(tracker_private, body)}, timeout=30
    )
    assert answer.status_code == 404, answer.text


def test_verifier_without_a_tracker_key_is_refused_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TRACKER", "TRACKER_PUBLIC_KEY", "VERIFIER"):
        monkeypatch.delenv(f"MESHNET_{name}", raising=False)
    with pytest.raises(ValueError, match="tracker-public-key"):
        NodeSettings(verifier=True)
    assert NodeSettings(verifier=True, tracker_public_key="k").verifier


@pytest.mark.anyio
async def test_a_caller_through_the_relay_meets_the_nodes_own_404() -> None:
    """A relayed stream arrives on loopback like the tracker's post; the node names it (its relay link does) and the
    audit row answers it as a path the node does not serve: the relay's clients never spend its llama-server."""
    key = Ed25519PrivateKey.generate()
    door = AuditDoor(audit, "http://127.0.0.1:9", public_key_text(key.public_key()))
    relayed = {("127.0.0.1", 40001)}
    app = RouteTable([audit_route(door, lambda peer: peer in relayed)])
    body = _request_body()
    headers = {AUDIT_TOKEN_HEADER: _audit(key, body)}
    for peer, status in ((("127.0.0.1", 40001), 404), (("127.0.0.1", 40002), 200)):
        transport = httpx.ASGITransport(app=app, client=peer)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            answer = await http.post(AUDIT_PATH, content=body, headers=headers)
        assert answer.status_code == status, answer.text
