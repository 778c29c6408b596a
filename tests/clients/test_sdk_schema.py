"""The SDK decodes every answer into the type `schemas/openapi.json` documents for it, and covers every route."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter

from clients.sdk._core import Call, Endpoints

OPENAPI = json.loads((Path(__file__).resolve().parents[2] / "schemas" / "openapi.json").read_text())
REF = "#/components/schemas/{model}"


class Recorder(Endpoints):
    """Endpoints whose transport hands back the call instead of sending it."""

    def _send(self, call: Call) -> Call:
        return call


def every_call() -> dict[str, Call]:
    """SDK method -> its call, path parameters left as the route's placeholders."""
    sb = Recorder()
    return {
        "livez": sb.livez(),
        "readyz": sb.readyz(),
        "metrics": sb.metrics(),
        "get_cluster": sb.get_cluster(),
        "put_cluster": sb.put_cluster({"nodes": []}),
        "list_models": sb.list_models(),
        "put_model": sb.put_model("{model_id}", {}),
        "delete_model": sb.delete_model("{model_id}"),
        "post_events": sb.post_events(),
        "list_sessions": sb.list_sessions(),
        "get_session": sb.get_session("{session_id}"),
        "get_srv": sb.get_srv(),
        "get_plan": sb.get_plan(),
        "get_routes": sb.get_routes(),
        "get_engines": sb.get_engines(),
        "replan": sb.replan(),
        "whatif": sb.whatif([]),
        "pareto": sb.pareto(),
        "explain": sb.explain(model="m"),
        "register_node": sb.register_node("{node_id}"),
        "heartbeat": sb.heartbeat("{node_id}"),
        "lease": sb.lease("{node_id}"),
        "renew_lease": sb.renew_lease("{node_id}", "{lease_id}"),
        "report": sb.report("{op_id}", lease_id="l", status="done"),
        "list_operations": sb.list_operations(),
        "get_calibration": sb.get_calibration(),
        "reset_calibration": sb.reset_calibration(),
        "reset_calibration of one node or GPU": sb.reset_calibration("{scope}", "{key}"),
        "reset_calibration of one field": sb.reset_calibration("{scope}", "{key}", "{field}"),
    }


CALLS = every_call()


def documented(call: Call) -> dict[str, Any]:
    """The route's success answer in openapi.json."""
    operation = OPENAPI["paths"][call.path][call.method.lower()]
    (status,) = [s for s in operation["responses"] if s in ("200", "204")]
    return operation["responses"][status]


def normal(schema: Any) -> Any:
    """A schema without what FastAPI and pydantic write differently and that does not change what it accepts:
    `title`s (FastAPI names a route's list answer) and `"default": null` (FastAPI leaves it out)."""
    if isinstance(schema, dict):
        return {
            k: normal(v)
            for k, v in schema.items()
            if not (k == "title" and isinstance(v, str)) and not (k == "default" and v is None)
        }
    if isinstance(schema, list):
        return [normal(v) for v in schema]
    return schema


def test_the_sdk_covers_every_route() -> None:
    routes = {(method.upper(), path) for path, item in OPENAPI["paths"].items() for method in item}
    assert {(c.method, c.path) for c in CALLS.values()} == routes


@pytest.mark.parametrize("name", sorted(CALLS))
def test_each_answer_type_is_the_documented_one(name: str) -> None:
    call = CALLS[name]
    answer = documented(call)
    if call.answer is None:  # text (the metrics) or nothing (a delete)
        assert "application/json" not in answer.get("content", {}) or answer["content"]["application/json"][
            "schema"
        ] in ({}, {"type": "object"})
        assert call.expect in ("text", "none")
        return
    schema = TypeAdapter(call.answer).json_schema(mode="serialization", ref_template=REF)
    definitions = schema.pop("$defs", {})
    expected = answer["content"]["application/json"]["schema"]
    if "$ref" in expected:  # a model: pydantic writes it in place, FastAPI as a component
        expected = OPENAPI["components"]["schemas"][expected["$ref"].removeprefix(REF.format(model=""))]
    assert normal(schema) == normal(expected)
    for model, definition in definitions.items():
        assert normal(definition) == normal(OPENAPI["components"]["schemas"][model]), model


def test_a_documented_answer_decodes_into_typed_objects() -> None:
    """An answer as the API documents it (the schema's own example shape) comes back typed, not as a dict."""
    lease = TypeAdapter(CALLS["lease"].answer).validate_python(
        {
            "lease_id": "l-1",
            "expires_at": "2026-01-01T00:00:00Z",
            "expires_in_seconds": 30.0,
            "operations": [
                {
                    "id": "3.op-1",
                    "action": "promote",
                    "object": {"kind": "kv", "model": "coder", "session": "s1"},
                    "from": {"tier": "host", "node": "n1"},
                    "to": {"tier": "gpu", "gpu": "n1-g0"},
                    "bytes": 1024,
                    "keep_source": True,
                    "priority": "blocking",
                    "depends_on": ["3.op-0"],
                    "estimated_seconds": 0.01,
                    "reason": "restore",
                    "node": "n1",
                    "epoch": 3,
                }
            ],
        }
    )
    (op,) = lease.operations
    assert op.source.id == "n1" and op.dest.label() == "gpu:n1-g0" and op.object.key() == "kv__coder__s1"
    assert op.frees is None and op.epoch == 3 and op.priority == "blocking"
