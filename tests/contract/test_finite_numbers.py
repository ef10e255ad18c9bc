"""Finite numbers only on the wire: every float of every model in the contract refuses NaN and ±inf,
found by walking the contract's modules, so a field or a model added later cannot slip through."""

from __future__ import annotations

import importlib
import math
import pkgutil
import types
from collections.abc import Iterator
from typing import Annotated, Any, Union, get_args, get_origin

import pytest
from pydantic import BaseModel, ValidationError

import meshnet_gguf.contract
from meshnet_gguf.contract.protocol import Heartbeat, HealthReport

NOT_FINITE = (math.nan, math.inf, -math.inf)


def contract_models() -> list[type[BaseModel]]:
    """Every pydantic model defined in a module of the contract."""
    found = []
    for module_info in pkgutil.iter_modules(meshnet_gguf.contract.__path__, meshnet_gguf.contract.__name__ + "."):
        module = importlib.import_module(module_info.name)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseModel) and value.__module__ == module.__name__:
                found.append(value)
    return found


def poisoned(annotation: Any) -> Iterator[Any]:
    """Values of this type that carry a non-finite float where a float may stand (nested models are walked as models)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is float:
        yield from NOT_FINITE
    elif origin is Annotated:
        yield from poisoned(args[0])
    elif origin in (Union, types.UnionType):
        for arg in args:
            yield from poisoned(arg)
    elif origin in (list, tuple, set, frozenset):
        for bad in poisoned(args[0]):
            yield [bad]
    elif origin is dict:
        for bad in poisoned(args[1]):
            yield {"k": bad}


def float_fields() -> list[tuple[type[BaseModel], str, Any]]:
    return [
        (model, name, bad)
        for model in contract_models()
        for name, field in model.model_fields.items()
        for bad in poisoned(field.annotation)
    ]


def test_the_walk_finds_the_contracts_floats() -> None:
    """The walk is not empty: it reaches the fields a node's heartbeat and health carry."""
    fields = {(model.__name__, name) for model, name, _ in float_fields()}
    assert {("NodeLoad", "recent_tokens_per_s"), ("HealthReport", "recent_tokens_per_s"), ("UsageRecord", "started_at")} <= fields
    assert len(fields) >= 15


@pytest.mark.parametrize(("model", "name", "bad"), float_fields(), ids=lambda v: getattr(v, "__name__", str(v)))
def test_every_float_in_the_contract_refuses_nan_and_infinity(model: type[BaseModel], name: str, bad: Any) -> None:
    with pytest.raises(ValidationError) as refused:
        model.__pydantic_validator__.validate_assignment(model.model_construct(), name, bad)
    assert refused.value.errors()[0]["loc"][0] == name and refused.value.errors()[0]["type"] == "finite_number"


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
def test_what_pythons_json_writes_for_a_non_finite_float_is_refused_with_the_field_named(number: str) -> None:
    beat = '{"node_id": "n", "state": "online", "load": {"slots_total": 2, "recent_tokens_per_s": %s}}' % number
    with pytest.raises(ValidationError) as refused:
        Heartbeat.model_validate_json(beat)
    assert refused.value.errors()[0]["loc"] == ("load", "recent_tokens_per_s")
    with pytest.raises(ValidationError):
        HealthReport.model_validate_json('{"state": "ready", "uptime_s": %s}' % number)


def test_finite_figures_still_pass() -> None:
    beat = Heartbeat.model_validate_json('{"node_id": "n", "state": "online", "load": {"slots_total": 2, "recent_tokens_per_s": 1.5e3}}')
    assert beat.load.recent_tokens_per_s == 1500.0
