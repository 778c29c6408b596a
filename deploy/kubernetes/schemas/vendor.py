"""Write the JSON Schemas that tests/deploy/test_kubernetes.py validates the manifests against.

Run it in a scratch virtual environment that holds the two packages the schemas come from (README.md here
names the versions), never in the project's own:

    python -m venv /tmp/schemas && /tmp/schemas/bin/pip install \
        kubernetes-validate==1.37.0 cloudcoil-models-prometheus-operator==0.80.1.0
    /tmp/schemas/bin/python deploy/kubernetes/schemas/vendor.py

- Kubernetes built-in kinds: kubernetes-validate's `v1.32.0-local-strict` schemas, copied unchanged: the
  top-level schema of each kind the manifests use, and of `_definitions.json` only the definitions those
  kinds reach through `$ref` (the whole file is 1.3 MB).
- prometheus-operator kinds: cloudcoil's pydantic models of the `monitoring.coreos.com/v1` CRDs, written as
  JSON Schema by pydantic (`model_json_schema(by_alias=True)`), then made strict the way
  kubernetes-validate's `-strict` variants are: an object schema that lists its properties and says nothing
  of others gets `additionalProperties: false` (the API server, under kubectl's default
  `--validate=strict`, refuses unknown fields of a custom resource too).
"""

from __future__ import annotations

import importlib.metadata
import json
import re
from importlib.resources import files
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
KUBERNETES_VERSION = "v1.32.0"
KUBERNETES_FLAVOUR = f"{KUBERNETES_VERSION}-local-strict"
# kind -> the file kubernetes-validate names it by (`<kind>-<group>-<version>.json`, core kinds without a group)
KUBERNETES_KINDS = {
    ("v1", "ConfigMap"): "configmap-v1.json",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaim-v1.json",
    ("v1", "Secret"): "secret-v1.json",
    ("v1", "Service"): "service-v1.json",
    ("v1", "ServiceAccount"): "serviceaccount-v1.json",
    ("apps/v1", "DaemonSet"): "daemonset-apps-v1.json",
    ("apps/v1", "Deployment"): "deployment-apps-v1.json",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicy-networking-v1.json",
}
CRD_KINDS = ("ServiceMonitor", "PrometheusRule")
DEFINITION_REF = re.compile(r"^(?:/api/_definitions\.json)?#/\$defs/(.+)$")  # from a kind, or within the file


def refs(node: Any) -> set[str]:
    """Every `$ref` string anywhere in a schema."""
    found: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                found.add(value)
            else:
                found |= refs(value)
    elif isinstance(node, list):
        for item in node:
            found |= refs(item)
    return found


def definitions_closure(roots: list[Any], definitions: dict[str, Any]) -> dict[str, Any]:
    """The definitions the roots reach, directly or through other definitions."""
    wanted: dict[str, Any] = {}
    pending = [ref for root in roots for ref in refs(root)]
    while pending:
        match = DEFINITION_REF.match(pending.pop())
        if match is None or match.group(1) in wanted:
            continue
        name = match.group(1)
        wanted[name] = definitions[name]
        pending.extend(refs(definitions[name]))
    return dict(sorted(wanted.items()))


# keywords whose value maps names to schemas (the mapping itself is not a schema)
SCHEMA_MAPS = ("properties", "$defs", "patternProperties")


def strict(node: Any) -> Any:
    """A copy where every object schema that lists properties and allows nothing else says so."""
    if isinstance(node, list):
        return [strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    copy = {
        key: {name: strict(schema) for name, schema in value.items()} if key in SCHEMA_MAPS else strict(value)
        for key, value in node.items()
    }
    if isinstance(copy.get("properties"), dict) and "additionalProperties" not in copy:
        copy["additionalProperties"] = False
    return copy


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def vendor_kubernetes() -> None:
    source = files("kubernetes_validate").joinpath("kubernetes-json-schema", KUBERNETES_FLAVOUR)
    out = HERE / "kubernetes" / KUBERNETES_FLAVOUR
    roots = {name: json.loads(source.joinpath(name).read_text(encoding="utf-8")) for name in KUBERNETES_KINDS.values()}
    definitions = json.loads(source.joinpath("_definitions.json").read_text(encoding="utf-8"))
    subset = dict(definitions, **{"$defs": definitions_closure(list(roots.values()), definitions["$defs"])})
    for name, schema in roots.items():
        write_json(out / name, schema)
    write_json(out / "_definitions.json", subset)


def vendor_prometheus_operator() -> None:
    from cloudcoil.models.prometheus_operator import v1

    out = HERE / "prometheus-operator" / f"v{importlib.metadata.version('cloudcoil-models-prometheus-operator')}"
    for kind in CRD_KINDS:
        schema = getattr(v1, kind).model_json_schema(by_alias=True)
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        write_json(out / f"{kind.lower()}-monitoring-v1.json", strict(schema))


if __name__ == "__main__":
    vendor_kubernetes()
    vendor_prometheus_operator()
