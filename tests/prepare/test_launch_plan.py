"""Launch plans from recorded machines, and one real launch whose layers must land on Vulkan0."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from meshnet_gguf.common.units import GB
from meshnet_gguf.hardware.report import probe_hardware
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.llama.features import BinaryFeatures
from meshnet_gguf.models.gguf_info import read_gguf_info
from meshnet_gguf.prepare.memory import ModelFacts, ctx_floor
from meshnet_gguf.prepare.plan import plan_launch
from support.hardware_fixtures import choices, deepseek_facts, dense_facts, fixture_binary, load_box, require_software_vulkan
from support.node_process import free_port

# A dense 70B at Q4_K_M and an 8B at Q4_K_M, with their published attention shapes.
LLAMA_70B_Q4 = dense_facts("Llama-3.3-70B-Q4_K_M", int(42.5 * GB), layers=80, kv_heads=8, head_dim=128, context=131072)
QWEN_8B_Q4 = dense_facts("Qwen3-8B-Q4_K_M", int(5.0 * GB), layers=36, kv_heads=8, head_dim=128, context=40960)
SUPERVISOR_OPTIONS = {"--host", "--port", "--api-key", "--api-key-file"}


def _value(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_deepseek_ud_iq3_xxs_on_strix_halo_128_offloads_every_layer_without_mmap() -> None:
    model = deepseek_facts("UD-IQ3_XXS")
    hw = load_box("strix-halo-128")
    plan = plan_launch(model, hw, choices(), fixture_binary())

    assert not plan.cpu_only and plan.fits
    assert (plan.backend, plan.device) == ("vulkan", "Vulkan0")
    assert plan.gpu_layers == plan.total_layers == model.block_count + 1
    assert _value(plan.argv, "--n-gpu-layers") == str(plan.total_layers)
    assert _value(plan.argv, "--device") == "Vulkan0"
    assert plan.load_mode == "no-mmap" and _value(plan.argv, "--load-mode") == "none"
    assert _value(plan.argv, "--model").endswith("-00001-of-00004.gguf")
    # Context, by hand from the recorded box: the GPU budget 129,065,631,744 B (test_hardware) less
    # 104,200,000,000 B of weights and 2 GiB (2,147,483,648 B) of compute buffers leaves 22,718,148,096 B;
    # the KV cache takes 43 layers x 1 head x (512 + 512) x 2 B = 88,064 B per token, so 257,972 tokens
    # fit, rounded down to whole 256-cell pages on each of 4 slots (1,024 tokens): 251 x 1,024 = 257,024.
    assert plan.ctx_size == 257_024 and _value(plan.argv, "--ctx-size") == "257024"
    # What is left for the prompt cache: 22,718,148,096 - 88,064 x 257,024 = 83,586,560 B = 79.7 MiB -> 79 MiB.
    assert _value(plan.argv, "--cache-ram") == "79" and plan.memory.prompt_cache == 79 * 2**20
    assert plan.gpu_bytes == 104_200_000_000 + 2_147_483_648 + 88_064 * 257_024
    assert not SUPERVISOR_OPTIONS & set(plan.argv)
    assert "all 44 layers" in plan.describe() and "CPU only" not in plan.describe()


def test_large_carve_out_plan_stays_inside_the_honest_budget() -> None:
    hw = load_box("strix-halo-128-carveout-64")
    plan = plan_launch(deepseek_facts("UD-IQ3_XXS"), hw, choices(), fixture_binary())

    gpu = hw.gpus[0]
    assert plan.gpu_layers == plan.total_layers
    assert plan.gpu_bytes <= gpu.budget_bytes < gpu.memory_total_bytes - 40 * GB


def test_cpu_box_plan_is_cpu_only_and_says_so() -> None:
    hw = load_box("cpu-only")
    plan = plan_launch(QWEN_8B_Q4, hw, choices(), fixture_binary())

    assert plan.cpu_only and plan.backend == "cpu" and plan.device is None
    assert plan.gpu_layers == 0 and _value(plan.argv, "--n-gpu-layers") == "0"
    assert plan.load_mode == "mmap" and "--load-mode" not in plan.argv and "--no-mmap" not in plan.argv
    # 4 slots x the model's own 40,960 tokens (below the 65,536 per-slot cap) = 163,840 tokens. They fit:
    # RAM 60,332,130,304 B (test_hardware) - 5 GB weights - 2 GiB compute = 53,184,646,656 B, and the KV
    # cache is 36 layers x 8 heads x (128 + 128) x 2 B = 147,456 B per token x 163,840 = 24,159,191,040 B.
    assert plan.ctx_size == 163_840
    assert plan.memory.kv_host == 24_159_191_040
    # The prompt cache gets one more context's worth (24.2 GB) capped at llama.cpp's 8 GiB default;
    # 29,025,455,616 B of RAM are still free, so the cap binds: --cache-ram 8192 (MiB).
    assert _value(plan.argv, "--cache-ram") == "8192"
    assert plan.host_bytes == 5_000_000_000 + 2_147_483_648 + 24_159_191_040 + 8_589_934_592
    assert any(r.startswith("CPU only: this machine has no GPU") for r in plan.reasons)
    assert plan.describe().startswith("plan: CPU only")


def test_nvidia_box_splits_a_70b_between_the_4090_and_the_cpu() -> None:
    hw = load_box("nvidia-rtx4090")
    plan = plan_launch(LLAMA_70B_Q4, hw, choices(), fixture_binary())

    assert plan.device == "Vulkan0"  # the RTX 4090, not the Raphael iGPU (Vulkan1)
    assert isinstance(plan.gpu_layers, int) and 0 < plan.gpu_layers < plan.total_layers
    assert plan.gpu_bytes <= hw.primary_gpu().budget_bytes
    assert plan.load_mode == "mmap"  # dedicated VRAM: the page cache is no second copy in the same memory
    assert plan.fits
    assert any("the other layers run on the CPU" in r for r in plan.reasons)


def test_nvidia_invisible_to_llama_server_falls_back_to_cpu_with_the_reason() -> None:
    hw = load_box("nvidia-rtx4090", list_devices="llama-server-no-vulkan.txt")
    plan = plan_launch(QWEN_8B_Q4, hw, choices(), fixture_binary())

    assert plan.cpu_only
    assert any("lists no device for NVIDIA GeForce RTX 4090" in r for r in plan.reasons)


def test_operator_choices_win_over_the_plan() -> None:
    hw = load_box("strix-halo-128")
    settings = choices(
        ctx_size=8192,
        n_gpu_layers="10",
        parallel=2,
        llama_args=("--flash-attn", "off", "-b", "512", "--mmap"),
    )
    plan = plan_launch(deepseek_facts("UD-IQ3_XXS"), hw, settings, fixture_binary())

    assert plan.gpu_layers == 10 and _value(plan.argv, "--n-gpu-layers") == "10"
    assert plan.ctx_size == 8192 and _value(plan.argv, "--ctx-size") == "8192"
    assert _value(plan.argv, "--parallel") == "2"
    assert plan.flash_attn == "off"
    # the plan does not emit its own spelling of what the operator set; theirs comes last, verbatim
    assert plan.argv.count("--flash-attn") == 1 and "--batch-size" not in plan.argv and "--load-mode" not in plan.argv
    assert plan.argv[-5:] == ("--flash-attn", "off", "-b", "512", "--mmap")
    assert any("set by --ctx-size" in r for r in plan.reasons)


def test_quantized_kv_cache_from_llama_args_enlarges_the_planned_context() -> None:
    hw = load_box("strix-halo-80")
    small = dense_facts("Mistral-Small-24B-Q4_K_M", int(14.3 * GB), layers=40, kv_heads=8, head_dim=128, context=131072)
    f16 = plan_launch(small, hw, choices(parallel=8), fixture_binary())
    q8 = plan_launch(small, hw, choices(parallel=8, llama_args=("-ctk", "q8_0", "-ctv", "q8_0")), fixture_binary())

    assert f16.ctx_size < q8.ctx_size


def test_older_binary_gets_no_mmap_and_bare_flash_attn_and_a_device_warning() -> None:
    old = fixture_binary("llama-server-help-old.txt")
    plan = plan_launch(deepseek_facts("UD-IQ3_XXS"), load_box("strix-halo-128", binary=old), choices(), old)

    assert "--no-mmap" in plan.argv and "--load-mode" not in plan.argv
    flash = plan.argv.index("--flash-attn")
    assert plan.argv[flash + 1].startswith("-")  # a bare switch on builds before on|off|auto
    assert "--device" not in plan.argv
    assert any("no --device option" in w for w in plan.warnings)
    # a build from before the RAM prompt cache: no --cache-ram to set, and no cache to count
    assert "--cache-ram" not in plan.argv and plan.memory.prompt_cache == 0


def test_one_gpu_listed_by_two_backends_is_pinned_to_one_device(tmp_path: Path) -> None:
    listing = tmp_path / "llama-server.txt"
    listing.write_text(
        "Available devices:\n"
        "  ROCm0: AMD Radeon Graphics (126976 MiB, 126000 MiB free)\n"
        "  Vulkan0: Radeon 8060S Graphics (RADV GFX1151) (127488 MiB, 126812 MiB free)\n"
    )
    hw = load_box("strix-halo-128", list_devices=str(listing))
    assert len(hw.gpus) == 1 and {d.name for d in hw.gpus[0].llama_devices} == {"ROCm0", "Vulkan0"}

    plan = plan_launch(deepseek_facts("UD-IQ3_XXS"), hw, choices(), fixture_binary())
    assert plan.argv.count("--device") == 1 and _value(plan.argv, "--device") == "Vulkan0"


def test_a_model_too_large_for_the_box_is_planned_but_flagged() -> None:
    plan = plan_launch(deepseek_facts("UD-IQ3_XXS"), load_box("strix-halo-80"), choices(), fixture_binary())

    assert not plan.fits
    assert plan.ctx_size > 0  # 0 would ask llama-server for the whole training context
    assert any("does not fit" in w for w in plan.warnings)


def test_kv_estimate_counts_every_layer_and_head() -> None:
    model = deepseek_facts("UD-IQ3_XXS")
    # 43 layers x 1 KV head x (512 K + 512 V dims) x 2 bytes (f16)
    assert model.kv_bytes_per_token() == 88_064
    # q8_0 stores 32 elements in 34 bytes: 43 x 1,024 x 34 / 32 = 46,784 bytes
    assert model.kv_bytes_per_token("q8_0", "q8_0") == 46_784
    # every one of 4 slots gets 4,096 tokens (the model's own context, 163,840, is longer)
    assert ctx_floor(model, 4) == 16_384


def test_the_plan_and_the_quant_advisor_count_the_same_bytes_for_the_same_context() -> None:
    """One memory model: at the advisor's context (16,384 tokens) the plan needs what the advisor says."""
    from meshnet_gguf.prepare.quant_advisor import advise_quant
    from support.hardware_fixtures import deepseek_quants

    hw = load_box("strix-halo-128")
    plan = plan_launch(deepseek_facts("UD-IQ3_XXS"), hw, choices(ctx_size=16_384), fixture_binary())
    advice = advise_quant(deepseek_quants(), hw.capacity(), model=deepseek_facts("UD-IQ3_XXS"), target_ctx=16_384)
    fit = advice.find("UD-IQ3_XXS")
    # 104,200,000,000 weights + 88,064 x 16,384 = 1,442,840,576 KV + 2,147,483,648 compute
    assert fit is not None and fit.need_bytes == plan.memory.need_bytes == 107_790_324_224
    # the prompt cache comes on top, from what is left: one more context's worth, 1,442,840,576 B = 1,376 MiB
    assert _value(plan.argv, "--cache-ram") == "1376"


def test_model_facts_from_a_real_gguf_header(tiny_split_gguf: Path) -> None:
    from meshnet_gguf.models.gguf_info import total_bytes

    shards = sorted(tiny_split_gguf.parent.glob("tiny-*-of-*.gguf"))
    facts = ModelFacts.from_gguf(read_gguf_info(tiny_split_gguf), total_bytes(shards))

    assert (facts.block_count, facts.head_count_kv, facts.head_dim_k, facts.context_length) == (2, 2, 16, 2048)
    assert facts.shard_count == 3 and facts.total_bytes == sum(p.stat().st_size for p in shards)
    assert facts.path == tiny_split_gguf and facts.guessed == ()


# --------------------------------------------------------------------------- the real binary on lavapipe

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
_VULKAN_BUFFER = re.compile(r"Vulkan0 model buffer size\s*=\s*([\d.]+) MiB")


@pytest.mark.real_llama
@pytest.mark.slow
def test_real_llama_server_puts_every_layer_on_vulkan0(
    real_llama: BinaryInfo, real_llama_features: BinaryFeatures, tiny_gguf: Path, tmp_path: Path
) -> None:
    require_software_vulkan()
    if not real_llama_features.vulkan:
        pytest.skip(f"{real_llama.describe()} was built without Vulkan (see build-llama-server's note on the headers)")
    hw = probe_hardware(real_llama, device_env={"GGML_VK_VISIBLE_DEVICES": "0"})
    assert hw.llama_devices, hw.probes
    info = read_gguf_info(tiny_gguf)
    model = ModelFacts.from_gguf(info, info.file_bytes)
    # The only device is a software renderer, so offloading must be asked for; -lv 4 prints the load log.
    settings = choices(n_gpu_layers="all", parallel=1, llama_args=("-lv", "4"))
    plan = plan_launch(model, hw, settings, real_llama)
    assert (plan.device, plan.gpu_layers, plan.total_layers) == ("Vulkan0", 3, 3)
    assert plan.env == {"GGML_VK_VISIBLE_DEVICES": "0"}

    port = free_port()
    log_path = tmp_path / "llama-server.log"
    argv = [str(real_llama.path), *plan.argv, "--host", "127.0.0.1", "--port", str(port)]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, env=real_llama.environment({**_base_env(), **plan.env}), stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(proc, port)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    text = log_path.read_text(errors="replace")

    # "offloaded 3/3 layers" prints even without a GPU; the buffer lines say where the weights really are.
    assert "offloaded 3/3 layers to GPU" in text, text[-3000:]
    buffer = _VULKAN_BUFFER.search(text)
    assert buffer and float(buffer.group(1)) > 0, text[-3000:]
    assert "CPU_Mapped model buffer" not in text
    assert "load_mode = none" in text or "--load-mode" not in plan.argv


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("GGML_")}


def _wait_healthy(proc: subprocess.Popen[bytes], port: int) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"llama-server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pytest.fail(f"llama-server was not healthy within {READY_TIMEOUT_S:.0f} s")


def test_gpu_layers_given_as_a_llama_arg_shape_the_estimate_too() -> None:
    settings = choices(llama_args=("-ngl", "0"))
    plan = plan_launch(QWEN_8B_Q4, load_box("strix-halo-128"), settings, fixture_binary())

    assert plan.cpu_only and "--n-gpu-layers" not in plan.argv
    assert plan.argv[-2:] == ("-ngl", "0")


def test_the_operators_cache_ram_is_left_to_them_and_counted() -> None:
    hw = load_box("cpu-only")
    mine = plan_launch(QWEN_8B_Q4, hw, choices(llama_args=("--cache-ram", "512")), fixture_binary())
    assert mine.argv.count("--cache-ram") == 1 and mine.argv[-2:] == ("--cache-ram", "512")
    assert mine.memory.prompt_cache == 512 * 2**20  # 536,870,912 B counted in RAM

    unlimited = plan_launch(QWEN_8B_Q4, hw, choices(llama_args=("-cram", "-1")), fixture_binary())
    assert "--cache-ram" not in unlimited.argv
    assert unlimited.memory.prompt_cache == 8192 * 2**20  # counted at llama.cpp's default, with a warning
    assert any("no limit" in w for w in unlimited.warnings)
