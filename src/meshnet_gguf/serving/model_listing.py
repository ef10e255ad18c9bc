"""The model a node serves: the names it answers to (`ServedName`), and its listing rows
(`ModelListing`: `GET /v1/models` and `GET /v1/models/{id}`), llama-server's list under the node's
id, behind the admission mode's listing rule."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from meshnet_gguf.common.asgi import JSON_HEADER, respond
from meshnet_gguf.contract.errors import ApiError
from meshnet_gguf.contract.openai_paths import MODEL_PATH_PREFIX, MODELS_PATH
from meshnet_gguf.contract.protocol import model_answers_to
from meshnet_gguf.llama.upstream import UpstreamClient, UpstreamError
from meshnet_gguf.serving.admission_modes import AdmissionMode, unavailable
from meshnet_gguf.serving.request_ids import REQUEST_ID_KEY, client_request_id, send_refusal
from meshnet_gguf.serving.routes import Request
from meshnet_gguf.serving.upstream_target import UpstreamTarget, upstream_headers


@dataclass(frozen=True)
class ServedName:
    """The model a node serves, by its id and the other names it answers to."""

    model_name: str
    aliases: tuple[str, ...] = ()

    def check(self, requested: object) -> None:
        """A request naming a model this node does not serve gets OpenAI's 404, not another model's answer."""
        if requested is None or requested == "":
            return  # llama-server serves its one model; naming it is optional
        if not isinstance(requested, str):
            raise ApiError(400, "invalid_model", "'model' must be a string")
        if not model_answers_to(requested, self.model_name, self.aliases):
            also = f" (also answers to {', '.join(repr(a) for a in self.aliases)})" if self.aliases else ""
            raise ApiError(
                404,
                "model_not_found",
                f"The model {requested!r} is not served here. This node serves {self.model_name!r}{also}; GET /v1/models lists it.",
                error_type="invalid_request_error",
            )


class ModelListing:
    """The listing rows' handlers. `ready` is where llama-server is, or raises the node's 503 while it is not."""

    def __init__(
        self, served: ServedName, ready: Callable[[], UpstreamTarget], client: UpstreamClient, mode: AdmissionMode, retry_after_s: int
    ) -> None:
        self._served, self._ready, self._client, self._mode = served, ready, client, mode
        self._retry_after_s = retry_after_s

    async def serve_model(self, request: Request) -> None:
        """`GET /v1/models/{id}`: the one model object, as OpenAI answers it."""
        await self.serve_models(request, model_id=request.path.removeprefix(MODEL_PATH_PREFIX))

    async def serve_models(self, request: Request, *, model_id: str | None = None) -> None:
        """llama-server's model list; with `model_id`, the one model object."""
        headers, send = request.headers, request.send
        request_id = client_request_id(headers)
        try:
            self._mode.admit_listing(headers)
            if model_id == "":
                raise ApiError(
                    404,
                    "model_not_found",
                    "No model id after /v1/models/; GET /v1/models lists the model",
                    error_type="invalid_request_error",
                )
            if model_id is not None:
                self._served.check(model_id)
            target = self._ready()
            try:
                response = await self._client.send("GET", target.base_url + MODELS_PATH, upstream_headers(target), None)
                try:
                    body = await response.read()
                finally:
                    await response.aclose()
            except UpstreamError as exc:
                raise unavailable(f"llama-server did not answer: {exc}", self._retry_after_s) from None
        except ApiError as exc:
            await send_refusal(send, exc, request_id)
            return
        if model_id is not None and response.status == 200:
            body = self._model_object(body)
        await respond(send, response.status, body, [JSON_HEADER, (REQUEST_ID_KEY, request_id.encode())])

    def _model_object(self, listing: bytes) -> bytes:
        """The served model's entry of llama-server's list, under the node's id (whichever name asked for it)."""
        name = self._served.model_name
        try:
            entries = json.loads(listing).get("data") or []
        except (ValueError, AttributeError):
            entries = []
        entry = next((e for e in entries if isinstance(e, dict) and e.get("id") == name), None)
        if entry is None:
            entry = entries[0] if entries and isinstance(entries[0], dict) else {"object": "model", "owned_by": "llamacpp"}
        return json.dumps({**entry, "id": name}).encode()


__all__ = ["ModelListing", "ServedName"]
