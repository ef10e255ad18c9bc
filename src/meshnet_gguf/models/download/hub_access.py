"""Where and how to reach the hub, and its exceptions in the operator's words."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx2
from huggingface_hub import HfApi, constants, get_token
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers

from meshnet_gguf.models.download.errors import AccessDenied, DownloadError, HubUnreachable, RepoNotFound


@dataclass(frozen=True)
class HubAccess:
    """Where and how to reach the hub. Built per call, because huggingface_hub reads
    `HF_ENDPOINT` once at import time and we must honour the value in effect now."""

    endpoint: str
    token: str | None
    offline: bool

    @classmethod
    def from_environment(cls, *, offline: bool = False) -> HubAccess:
        endpoint = (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
        env_offline = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
        return cls(endpoint=endpoint, token=get_token(), offline=offline or env_offline or constants.HF_HUB_OFFLINE)

    def api(self) -> HfApi:
        return HfApi(endpoint=self.endpoint, token=self.token or False)

    def headers(self) -> dict[str, str]:
        return build_hf_headers(token=self.token or False)


def gated_message(repo_id: str, access: HubAccess, detail: str = "") -> str:
    if access.token:
        return (
            f"{repo_id} is gated and the token in use has no access to it{detail}. Accept the model's terms on its "
            "hub page with the account that owns HF_TOKEN (or use a token of an account that has), then run again."
        )
    return (
        f"{repo_id} is gated: it needs a Hugging Face token{detail}. Accept the model's terms on its hub page, "
        "create an access token and set HF_TOKEN (or run `hf auth login`), then run again."
    )


@contextmanager
def hub_errors(repo_id: str, access: HubAccess) -> Iterator[None]:
    """Turn huggingface_hub/httpx exceptions into operator-facing ones."""
    try:
        yield
    except GatedRepoError as exc:
        raise AccessDenied(gated_message(repo_id, access)) from exc
    except RevisionNotFoundError as exc:
        raise RepoNotFound(f"{repo_id}: revision not found on {access.endpoint}") from exc
    except RepositoryNotFoundError as exc:
        hint = "" if access.token else " If it is private or gated, set HF_TOKEN."
        raise RepoNotFound(f"{repo_id} was not found on {access.endpoint}. Check the spelling (owner/name).{hint}") from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        if status == 403:
            raise AccessDenied(gated_message(repo_id, access, " (403 Forbidden)")) from exc
        raise DownloadError(f"{repo_id}: the hub at {access.endpoint} answered {status}: {exc}") from exc
    except httpx2.TransportError as exc:
        raise HubUnreachable(
            f"cannot reach the hub at {access.endpoint} ({type(exc).__name__}: {exc}). Check the network or "
            "HF_ENDPOINT, or pass --offline to use files already downloaded."
        ) from exc
