"""The quant advisor on recorded machines: name what fits before a 100 GB download, refuse what does not."""

from __future__ import annotations

import pytest

from meshnet_gguf.common.units import GB
from meshnet_gguf.hardware.report import MemoryCapacity
from meshnet_gguf.prepare.quant_advisor import QuantDoesNotFit, QuantOption, advise_quant, check_quant
from support.hardware_fixtures import deepseek_facts, deepseek_quants, load_box

MODEL = deepseek_facts("UD-IQ3_XXS")  # the attention shape is the same for every quant
# 4 slots x 4,096 tokens, the least a plan launches with; KV cache 43 x 1 x (512 + 512) x 2 = 88,064 B per token,
# so 1,442,840,576 B at this context; compute buffers 2 GiB = 2,147,483,648 B: 3,590,324,224 B on top of weights.
TARGET_CTX = 16_384


def test_iq4_xs_on_strix_halo_128_is_refused_naming_ud_iq3_xxs() -> None:
    capacity = load_box("strix-halo-128").capacity()

    with pytest.raises(QuantDoesNotFit) as refused:
        check_quant("IQ4_XS", deepseek_quants(), capacity, model=MODEL, target_ctx=TARGET_CTX)

    message = str(refused.value)
    # 136,000,000,000 + 3,590,324,224 = 139.6 GB against the box's 129,065,631,744 B (test_hardware)
    assert message.startswith("IQ4_XS needs at least 139.6 GB ")
    assert "this box can give the GPU" in message
    assert "UD-IQ3_XXS fits" in message and "--force" in message
    assert refused.value.suggestion == "UD-IQ3_XXS"


def test_ud_iq3_xxs_on_strix_halo_128_fits_on_the_gpu() -> None:
    capacity = load_box("strix-halo-128").capacity()
    fit = check_quant("UD-IQ3_XXS", deepseek_quants(), capacity, model=MODEL, target_ctx=TARGET_CTX)

    assert fit.fits and fit.fits_gpu
    # 104,200,000,000 weights + 3,590,324,224 KV and compute = 107,790,324,224 <= 129,065,631,744 on the GPU
    assert fit.need_bytes == 107_790_324_224
    assert fit.kv_bytes == 1_442_840_576


def test_advice_names_the_largest_quant_that_fits() -> None:
    advice = advise_quant(deepseek_quants(), load_box("strix-halo-128").capacity(), model=MODEL, target_ctx=TARGET_CTX)

    assert advice.best is not None and advice.best.quant.name == "UD-IQ3_XXS"
    sizes = [o.quant.total_bytes for o in advice.options]
    assert sizes == sorted(sizes, reverse=True)
    assert "<- best" in advice.describe()


def test_nothing_fits_on_the_80_gb_box_and_the_message_says_so() -> None:
    capacity = load_box("strix-halo-80").capacity()

    with pytest.raises(QuantDoesNotFit) as refused:
        check_quant("UD-IQ3_XXS", deepseek_quants(), capacity, model=MODEL, target_ctx=TARGET_CTX)

    # the 80 GB box holds 77,085,016,064 B (carve-out 379,584,512 + RAM 79,101,952 kB - 4 GiB);
    # the smallest quant needs 78,400,000,000 + 3,590,324,224 = 81,990,324,224 B
    assert "no quant of this model fits here" in str(refused.value)
    assert "needs at least 82.0 GB" in str(refused.value)
    assert "the smallest, UD-IQ2_XXS" in str(refused.value)
    assert refused.value.suggestion is None


def test_a_quant_that_only_fits_partly_on_the_cpu_says_so() -> None:
    capacity = load_box("nvidia-rtx4090").capacity()
    advice = advise_quant(deepseek_quants(), capacity, model=MODEL, target_ctx=TARGET_CTX)

    best = advice.best
    assert best is not None and best.fits and not best.fits_gpu
    with pytest.raises(QuantDoesNotFit, match="fits, partly on the CPU,"):
        check_quant("IQ4_XS", deepseek_quants(), capacity, model=MODEL, target_ctx=TARGET_CTX)


def test_whole_on_the_gpu_beats_a_larger_quant_split_with_the_cpu() -> None:
    capacity = MemoryCapacity(total_bytes=80 * GB, gpu_bytes=24 * GB, gpu_name="a 24 GB card", unified=False)
    quants = [QuantOption("Q8_0", 34 * GB), QuantOption("Q4_K_M", 19 * GB)]
    advice = advise_quant(quants, capacity, model=None, target_ctx=0)

    assert advice.best is not None and advice.best.quant.name == "Q4_K_M"


def test_quant_names_match_without_case_or_the_ud_prefix() -> None:
    capacity = load_box("strix-halo-128").capacity()
    fit = check_quant("iq3_xxs", deepseek_quants(), capacity, model=MODEL, target_ctx=TARGET_CTX)
    assert fit.quant.name == "UD-IQ3_XXS"
    with pytest.raises(ValueError, match="not one of"):
        check_quant("Q9_9", deepseek_quants(), capacity, model=MODEL, target_ctx=TARGET_CTX)
