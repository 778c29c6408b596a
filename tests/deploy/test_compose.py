"""The deployment stack without a Docker engine: the compose file against the Compose Specification, the
files it mounts, and Prometheus, Grafana and Kubernetes manifests consistent with each other and with the
metrics the service exports."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft7Validator, validators

REPO = Path(__file__).resolve().parents[2]
COMPOSE_SPEC = REPO.parent / "shared" / "data" / "compose-spec.json"
COMPOSE = REPO / "docker-compose.yml"
DEPLOY = REPO / "deploy"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
ALERT_RULES = DEPLOY / "prometheus" / "alerts.yml"
GRAFANA_DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
GRAFANA_PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "dashboards.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "statebudget.json"
KUBERNETES = DEPLOY / "kubernetes" / "statebudget.yaml"
METRICS_MODULE = REPO / "planner_service" / "metrics.py"

# The service's Prometheus metrics (issue 4), as scraped: counters with `_total`.
HISTOGRAMS = frozenset(
    {
        "statebudget_operation_duration_seconds",
        "statebudget_plan_duration_seconds",
        "statebudget_switch_latency_seconds",
    }
)
EXPORTED_METRICS = HISTOGRAMS | {
    "statebudget_resident_bytes",
    "statebudget_gpu_hbm_used_bytes",
    "statebudget_gpu_hbm_capacity_bytes",
    "statebudget_queue_operations",
    "statebudget_predicted_switch_latency_p95_seconds",
    "statebudget_events_total",
    "statebudget_lease_expiries_total",
    "statebudget_replans_total",
    "statebudget_slo_violations_total",
    "statebudget_unserved_sessions",
    "statebudget_plan_epoch",
}
HISTOGRAM_SERIES = ("_bucket", "_count", "_sum")
METRIC_NAME = re.compile(r"\bstatebudget_[a-z0-9_]+")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def metric_names(expr: str) -> set[str]:
    """The StateBudget metrics a PromQL expression reads, with histogram series folded to their family."""
    names = set()
    for name in METRIC_NAME.findall(expr):
        for suffix in HISTOGRAM_SERIES:
            if name.endswith(suffix) and name.removesuffix(suffix) in HISTOGRAMS:
                name = name.removesuffix(suffix)
        names.add(name)
    return names


def bind_mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(host source, container target) of a compose service's bind mounts, short and long syntax."""
    mounts = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
            if source.startswith((".", "/", "~")):
                mounts.append((source, target))
        elif volume.get("type") == "bind":
            mounts.append((volume["source"], volume["target"]))
    return mounts


def host_path(source: str) -> Path:
    return (REPO / source).resolve()


def container_target_of(service: dict[str, Any], repo_path: Path) -> str:
    """Where a compose service mounts a file or folder of the repository."""
    for source, target in bind_mounts(service):
        if host_path(source) == repo_path.resolve():
            return target
    raise AssertionError(f"{repo_path.relative_to(REPO)} is not mounted into the service")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE)


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and template variable queries."""
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


# --------------------------------------------------------------------------------------- compose


def test_compose_file_matches_the_compose_specification(compose: dict[str, Any]) -> None:
    if not COMPOSE_SPEC.is_file():
        pytest.skip(f"Compose Specification schema not found at {COMPOSE_SPEC}")
    schema = json.loads(COMPOSE_SPEC.read_text(encoding="utf-8"))
    # The schema declares draft-07 as "https://json-schema.org/draft-07/schema", a spelling jsonschema's
    # lookup does not know: say which draft to fall back to rather than the latest.
    validator_class = validators.validator_for(schema, default=Draft7Validator)
    validator_class.check_schema(schema)
    errors = sorted(validator_class(schema).iter_errors(compose), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors)


def test_compose_defines_the_planner_and_its_monitoring(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"planner", "prometheus", "grafana"} <= services.keys()
    planner = services["planner"]
    assert planner["build"]["context"] == "."
    assert any(str(port).split(":")[-1] == "8000" for port in planner["ports"])
    assert any(str(volume).endswith(":/data") for volume in planner["volumes"]), "the database volume"
    assert "healthcheck" in planner
    assert services["prometheus"]["image"].startswith("prom/prometheus")
    assert services["grafana"]["image"].startswith("grafana/grafana")
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"


def test_every_file_the_compose_file_uses_exists(compose: dict[str, Any]) -> None:
    missing = []
    for name, service in compose["services"].items():
        if "build" in service:
            build = service["build"] if isinstance(service["build"], dict) else {"context": service["build"]}
            context = host_path(build.get("context", "."))
            for path in (context, context / build.get("dockerfile", "Dockerfile")):
                if not path.exists():
                    missing.append(f"{name}: build {path}")
        for source, target in bind_mounts(service):
            if not host_path(source).exists():
                missing.append(f"{name}: {source} -> {target}")
        for env_file in service.get("env_file", []):
            path = env_file if isinstance(env_file, str) else env_file["path"]
            required = True if isinstance(env_file, str) else env_file.get("required", True)
            if required and not host_path(path).exists():
                missing.append(f"{name}: env_file {path}")
    assert not missing, "compose refers to files the repository lacks:\n" + "\n".join(missing)


def test_named_volumes_are_declared(compose: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")
            kind = "volume" if isinstance(volume, str) else volume.get("type")
            if kind == "volume" and source and not source.startswith((".", "/", "~")):
                assert source in declared, f"{name} mounts undeclared volume {source!r}"


def test_depends_on_names_real_services(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in services.items():
        for dependency, spec in (service.get("depends_on") or {}).items():
            assert dependency in services, f"{name} depends on unknown service {dependency}"
            if spec.get("condition") == "service_healthy":
                assert "healthcheck" in services[dependency], f"{name} waits on {dependency}, which has no healthcheck"


# ------------------------------------------------------------------------------------ prometheus


def test_prometheus_scrapes_the_planner(compose: dict[str, Any]) -> None:
    config = load_yaml(PROMETHEUS_CONFIG)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert "statebudget" in jobs
    job = jobs["statebudget"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [target for static in job["static_configs"] for target in static["targets"]]
    assert "planner:8000" in targets
    host = targets[0].split(":")[0]
    assert host in compose["services"], f"scrape target {host} is not a compose service"


def test_prometheus_loads_the_mounted_alert_rules(compose: dict[str, Any]) -> None:
    config = load_yaml(PROMETHEUS_CONFIG)
    prometheus = compose["services"]["prometheus"]
    assert container_target_of(prometheus, PROMETHEUS_CONFIG) == "/etc/prometheus/prometheus.yml"
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    assert config["rule_files"] == [container_target_of(prometheus, ALERT_RULES)]


def test_alert_rules_are_complete_and_use_exported_metrics() -> None:
    rules = [rule for group in load_yaml(ALERT_RULES)["groups"] for rule in group["rules"]]
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)), "alert names must be unique"
    for rule in rules:
        assert rule["expr"].strip() and rule.get("for"), rule["alert"]
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        unknown = metric_names(rule["expr"]) - EXPORTED_METRICS
        assert not unknown, f"{rule['alert']} reads metrics the service does not export: {sorted(unknown)}"
    exprs = " ".join(rule["expr"] for rule in rules)
    assert 'up{job="statebudget"} == 0' in exprs, "an alert for the planner being down"
    for required in (
        "statebudget_unserved_sessions",
        "statebudget_lease_expiries_total",
        "statebudget_predicted_switch_latency_p95_seconds",
    ):
        assert required in exprs, f"an alert on {required}"


# --------------------------------------------------------------------------------------- grafana


def test_grafana_datasource_is_the_compose_prometheus(compose: dict[str, Any], dashboard: dict[str, Any]) -> None:
    provisioning = load_yaml(GRAFANA_DATASOURCES)
    assert provisioning["apiVersion"] == 1
    (source,) = [s for s in provisioning["datasources"] if s["type"] == "prometheus"]
    assert source["url"] == "http://prometheus:9090"
    assert "prometheus" in compose["services"]
    (variable,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert variable["current"]["value"] == source["uid"], "the dashboard defaults to the provisioned data source"


def test_grafana_provisioning_is_mounted_and_finds_the_dashboard(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    assert container_target_of(grafana, GRAFANA_DATASOURCES.parent) == "/etc/grafana/provisioning/datasources"
    assert container_target_of(grafana, GRAFANA_PROVIDERS.parent) == "/etc/grafana/provisioning/dashboards"
    providers = load_yaml(GRAFANA_PROVIDERS)
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"] == container_target_of(grafana, DASHBOARD.parent)
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"


def test_dashboard_panels_query_exported_metrics(dashboard: dict[str, Any]) -> None:
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"] and dashboard["title"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    rows = [panel["title"] for panel in dashboard["panels"] if panel["type"] == "row"]
    assert rows == ["Overview", "Memory", "Queues", "Planner"]
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel.get("targets"), f"panel {panel['title']!r} has no targets"
        for target in panel["targets"]:
            assert target["expr"].strip() and target["refId"], panel["title"]
    used = set().union(*(metric_names(expr) for expr in dashboard_queries(dashboard)))
    assert used <= EXPORTED_METRICS, f"metrics the service does not export: {sorted(used - EXPORTED_METRICS)}"
    assert used == EXPORTED_METRICS, f"exported metrics without a panel: {sorted(EXPORTED_METRICS - used)}"


def test_dashboard_quantiles_come_from_bucket_rates(dashboard: dict[str, Any]) -> None:
    quantile = re.compile(
        r"histogram_quantile\(\s*0?\.\d+\s*,"
        r"\s*sum by \(([^)]*)\)\s*\(\s*rate\((statebudget_[a-z0-9_]+)_bucket[^\[]*\[5m\]\)\s*\)\s*\)"
    )
    exprs = [e for e in dashboard_queries(dashboard) if "histogram_quantile" in e]
    assert exprs
    for expr in exprs:
        match = quantile.fullmatch(expr.strip())
        assert match, f"not histogram_quantile(q, sum by (le, ...) (rate(<histogram>_bucket[5m]))): {expr}"
        assert "le" in [label.strip() for label in match.group(1).split(",")], expr
        assert match.group(2) in HISTOGRAMS, expr


def test_dashboard_units_are_base_units(dashboard: dict[str, Any]) -> None:
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        unit = panel["fieldConfig"]["defaults"].get("unit")
        exprs = [target["expr"] for target in panel["targets"]]
        names = set().union(*(metric_names(expr) for expr in exprs))
        ratio = any("/" in expr for expr in exprs)
        if not ratio and all(name.endswith("_bytes") for name in names):
            assert unit == "bytes", panel["title"]
        if all(name.endswith("_seconds") for name in names) and not any("_count" in e for e in exprs):
            assert unit == "s", panel["title"]


def test_dashboard_panels_do_not_overlap(dashboard: dict[str, Any]) -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def string_constants(path: Path) -> set[str]:
    return {
        node.value
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def test_dashboard_metrics_are_defined_in_the_metrics_module() -> None:
    constants = string_constants(METRICS_MODULE)
    namespaced = "statebudget" in constants  # prometheus_client's namespace="statebudget" + a short name

    def defined(name: str) -> bool:
        # prometheus_client adds `_total` to counters, so the module may spell them either way.
        spellings = {name, name.removesuffix("_total")}
        if namespaced:
            spellings |= {spelling.removeprefix("statebudget_") for spelling in spellings}
        return bool(spellings & constants)

    missing = sorted(name for name in EXPORTED_METRICS if not defined(name))
    assert not missing, f"planner_service/metrics.py does not define {missing}"


# ------------------------------------------------------------------------------------ settings


def compose_and_kubernetes_env_names(compose: dict[str, Any]) -> set[str]:
    names = set()
    for service in compose["services"].values():
        env = service.get("environment") or {}
        names |= {item.split("=")[0] for item in env} if isinstance(env, list) else set(env)
    for container in kubernetes_deployment()["spec"]["template"]["spec"]["containers"]:
        names |= {item["name"] for item in container.get("env", [])}
    return {name for name in names if name.startswith("STATEBUDGET_")}


def test_deployment_env_variables_are_settings(compose: dict[str, Any]) -> None:
    from planner_service import settings as settings_module

    settings_classes = [
        obj
        for obj in vars(settings_module).values()
        if isinstance(obj, type)
        and obj.__module__ == settings_module.__name__
        and hasattr(obj, "model_fields")
        and "env_prefix" in getattr(obj, "model_config", {})
    ]
    assert settings_classes, "no pydantic-settings class in planner_service/settings.py"
    from clients.gateway.settings import GatewaySettings

    settings_classes.append(GatewaySettings)  # the gateway's service reads its own
    known = set()
    for cls in settings_classes:
        prefix = cls.model_config.get("env_prefix", "")
        for field_name, field in cls.model_fields.items():
            known.add(f"{prefix}{field_name}".upper())
            for alias in (field.alias, field.validation_alias):
                if isinstance(alias, str):
                    known.add(alias.upper())
    unknown = sorted(compose_and_kubernetes_env_names(compose) - known)
    assert not unknown, f"deployment sets variables the settings do not read: {unknown}; known: {sorted(known)}"


# ---------------------------------------------------------------------------------- kubernetes


def kubernetes_objects() -> dict[str, dict[str, Any]]:
    documents = [doc for doc in yaml.safe_load_all(KUBERNETES.read_text(encoding="utf-8")) if doc]
    return {doc["kind"]: doc for doc in documents}


def kubernetes_deployment() -> dict[str, Any]:
    return kubernetes_objects()["Deployment"]


def test_kubernetes_runs_one_writer_with_probes_and_a_volume() -> None:
    objects = kubernetes_objects()
    assert {"Deployment", "PersistentVolumeClaim", "Service"} <= objects.keys()
    deployment = objects["Deployment"]
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate", "SQLite is single-writer: no rolling overlap"
    pod = deployment["spec"]["template"]["spec"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] in ports
    assert {"cpu", "memory"} <= container["resources"]["requests"].keys()

    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v
    }
    (data_mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/data"]
    assert claims[data_mount["name"]] == objects["PersistentVolumeClaim"]["metadata"]["name"]

    env = {item["name"]: item for item in container["env"]}
    secret = env["STATEBUDGET_OPERATOR_TOKENS"]["valueFrom"]["secretKeyRef"]
    assert secret["name"] and secret["key"] and not secret.get("optional", False)

    service = objects["Service"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] in ports and service_port["port"] == 8000
