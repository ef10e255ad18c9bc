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
from meshnet_gguf.llama.model_children import ModelChildren, ModelStatus
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
    # The models served beside this one (each answers to its own id alone): named in the 404, for the client.
    others: tuple[str, ...] = ()

    def check(self, requested: object) -> None:
        """A request naming a model this node does not serve gets OpenAI's 404, not another model's answer."""
        if requested is None or requested == "":
            return  # llama-server serves its one model; naming it is optional
        if not isinstance(requested, str):
            raise ApiError(400, "invalid_model", "'model' must be a string")
        if not model_answers_to(requested, self.model_name, self.aliases):
            also = f" (also answers to {', '.join(repr(a) for a in self.aliases)})" if self.aliases else ""
            beside = "".join(f", {other!r}" for other in self.others)
            lists = "them" if self.others else "it"
            raise ApiError(
                404,
                "model_not_found",
                f"The model {requested!r} is not served here. "
                f"This node serves {self.model_name!r}{also}{beside}; GET /v1/models lists {lists}.",
                error_type="invalid_request_error",
            )


class ModelListing:
    """The listing rows' handlers. `ready` is where llama-server is, or raises the node's 503 while it is not."""

    def __init__(
        self,
        served: ServedName,
        ready: Callable[[], UpstreamTarget],
        client: UpstreamClient,
        mode: AdmissionMode,
        retry_after_s: int,
        others: ModelChildren | None = None,
    ) -> None:
        self._served, self._ready, self._client, self._mode = served, ready, client, mode
        self._retry_after_s = retry_after_s
        # Models beside the first: listed after it, each with its state (`status.value`, as llama-server's router says it).
        self._others = others

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
            other = self._other(model_id)
            if other is not None:
                await respond(send, 200, json.dumps(_model_entry(other)).encode(), [JSON_HEADER, (REQUEST_ID_KEY, request_id.encode())])
                return
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
        elif self._others is not None and response.status == 200:
            body = self._with_others(body)
        await respond(send, response.status, body, [JSON_HEADER, (REQUEST_ID_KEY, request_id.encode())])

    def _other(self, model_id: str | None) -> ModelStatus | None:
        if self._others is None or not model_id:
            return None
        model = self._others.models.get(model_id)
        return next((s for s in self._others.status() if model is not None and s.alias == model.alias), None)

    def _with_others(self, listing: bytes) -> bytes:
        """llama-server's list of the first model, marked pinned and loaded, then every model beside it with its state."""
        try:
            parsed = json.loads(listing)
            entries = [e for e in parsed.get("data") or [] if isinstance(e, dict)]
        except (ValueError, AttributeError):
            return listing
        first = {"value": "loaded", "pinned": True}
        listed = [{**e, "status": first} for e in entries]
        listed += [_model_entry(s) for s in self._others.status()] if self._others is not None else []
        return json.dumps({**parsed, "data": listed}).encode()

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


def _model_entry(status: ModelStatus) -> dict[str, object]:
    """A model beside the first as OpenAI's list has it, with its state as llama-server's router lists its models."""
    state: dict[str, object] = {"value": status.state, "pinned": status.pinned}
    if status.expected_load_s is not None:
        state["expected_load_s"] = round(status.expected_load_s, 3)
    if status.error is not None:
        state["failed"], state["error"] = True, status.error
    return {"id": status.alias, "object": "model", "owned_by": "meshnet-gguf", "status": state}


__all__ = ["ModelListing", "ServedName"]
