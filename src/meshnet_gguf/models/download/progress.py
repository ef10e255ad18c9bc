"""The progress bar of a transfer or a hash: huggingface_hub's tqdm, silent where nobody watches."""

from __future__ import annotations

from huggingface_hub.utils import tqdm as hf_tqdm


def progress_bar(*, total: int, initial: int, desc: str, enabled: bool) -> hf_tqdm:
    # disable=None lets tqdm switch itself off when stderr is not a TTY; huggingface_hub's
    # class also honours HF_HUB_DISABLE_PROGRESS_BARS.
    return hf_tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit="B",
        unit_scale=True,
        disable=None if enabled else True,
    )
