"""The Kubernetes deployment without a cluster: the kustomize base and overlays rendered by `kubectl
kustomize`, every object validated against the vendored Kubernetes and prometheus-operator schemas
(deploy/kubernetes/schemas/), and the objects consistent with each other, with the image, with the settings
and agent flags they use, with the alert rules and with the operator's instructions."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import typer
import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
BASE = KUBERNETES / "base"
COMPONENT = KUBERNETES / "components" / "prometheus-operator"
OVERLAYS = KUBERNETES / "overlays"
SCHEMAS = KUBERNETES / "schemas"
KUBERNETES_SCHEMAS = SCHEMAS / "kubernetes" / "v1.32.0-local-strict"
OPERATOR_SCHEMAS = SCHEMAS / "prometheus-operator" / "v0.80.1.0"
ALERT_RULES = DEPLOY / "prometheus" / "alerts.yml"
DEPLOY_README = DEPLOY / "README.md"
DOCKERFILE = REPO / "Dockerfile"

# The files of the base and the component that are whole objects (an overlay's patches are not).
MANIFESTS = [*sorted(BASE.glob("*.yaml")), COMPONENT / "servicemonitor.yaml", COMPONENT / "prometheusrule.yaml"]
MANIFESTS = [path for path in MANIFESTS if path.name != "kustomization.yaml"]
TARGETS = {"base": BASE, "production": OVERLAYS / "production", "dev": OVERLAYS / "dev"}
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule-monitoring-v1.json",
}
PLANNER = {"app.kubernetes.io/name": "statebudget", "app.kubernetes.io/component": "planner"}
AGENT = {"app.kubernetes.io/name": "statebudget", "app.kubernetes.io/component": "agent"}
Object = dict[str, Any]


# ------------------------------------------------------------------------------------------ helpers


def load_all(path: Path) -> list[Object]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


@cache
def render(target: str) -> tuple[Object, ...]:
    """The objects `kubectl kustomize` builds for a base or an overlay."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not found: the kustomize base and overlays cannot be rendered here")
    result = subprocess.run(
        [kubectl, "kustomize", str(TARGETS[target])], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"kubectl kustomize {target} failed:\n{result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def one(objects: tuple[Object, ...] | list[Object], kind: str, name: str | None = None) -> Object:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_spec(workload: Object) -> Object:
    spec: Object = workload["spec"]["template"]["spec"]
    return spec


def container(workload: Object, name: str) -> Object:
    (found,) = [c for c in pod_spec(workload)["containers"] if c["name"] == name]
    return found


def volume_of_mount(workload: Object, container_name: str, mount_path: str) -> Object:
    (mount,) = [m for m in container(workload, container_name)["volumeMounts"] if m["mountPath"] == mount_path]
    (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"]]
    return volume


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


@cache
def kubernetes_registry() -> Registry:
    definitions = json.loads((KUBERNETES_SCHEMAS / "_definitions.json").read_text(encoding="utf-8"))
    return Resource.from_contents(definitions) @ Registry()


def schema_for(obj: Object) -> Object:
    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_SCHEMAS:
        schema: Object = json.loads((OPERATOR_SCHEMAS / CRD_SCHEMAS[key]).read_text(encoding="utf-8"))
        return schema
    # kubernetes-validate's file names: `<kind>-<group without its domain>-<version>.json`, `<kind>-v1.json` for core
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", obj["apiVersion"])
    path = KUBERNETES_SCHEMAS / f"{obj['kind'].lower()}-{group_version}.json"
    assert path.is_file(), f"no vendored schema for {key}: add the kind to deploy/kubernetes/schemas/vendor.py"
    schema = json.loads(path.read_text(encoding="utf-8"))
    return schema


def schema_errors(obj: Object) -> list[str]:
    validator = Draft202012Validator(schema_for(obj), registry=kubernetes_registry())
    name = f"{obj['kind']}/{obj.get('metadata', {}).get('name')}"
    return [
        f"{name}: {'/'.join(map(str, error.absolute_path)) or '<root>'}: {error.message}"
        for error in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    ]


def load_script(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def alert_jobs() -> set[str]:
    """The `job` values the alert expressions select."""
    alerts = yaml.safe_load(ALERT_RULES.read_text(encoding="utf-8"))
    exprs = " ".join(rule["expr"] for group in alerts["groups"] for rule in group["rules"])
    return set(re.findall(r'\bjob\s*=\s*"([^"]+)"', exprs))


# ------------------------------------------------------------------------------------------ schemas


def test_vendored_schemas_are_valid_json_schemas() -> None:
    paths = [*KUBERNETES_SCHEMAS.glob("*.json"), *OPERATOR_SCHEMAS.glob("*.json")]
    assert len(paths) >= 10
    for path in paths:
        # without the `regex` format check: the CRDs' patterns are Go (RE2) syntax, such as a `(?i)` after `^`,
        # which Python's `re` refuses; no manifest sets a field they constrain that way
        Draft202012Validator.check_schema(json.loads(path.read_text(encoding="utf-8")), format_checker=None)


def test_the_strict_schemas_refuse_what_the_api_server_refuses() -> None:
    """The validation has teeth: an unknown field, a wrong type and a bad CRD enum are errors."""
    deployment = one(load_all(BASE / "statebudget.yaml"), "Deployment")
    assert not schema_errors(deployment)
    typo = json.loads(json.dumps(deployment))
    typo["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    assert any("readinessprobe" in error for error in schema_errors(typo))
    wrong_type = json.loads(json.dumps(deployment))
    wrong_type["spec"]["replicas"] = "one"
    assert schema_errors(wrong_type)
    monitor = one(load_all(COMPONENT / "servicemonitor.yaml"), "ServiceMonitor")
    assert not schema_errors(monitor)
    bad_scheme = json.loads(json.dumps(monitor))
    bad_scheme["spec"]["endpoints"][0]["scheme"] = "gopher"
    assert schema_errors(bad_scheme)
    unknown = json.loads(json.dumps(monitor))
    unknown["spec"]["endpoints"][0]["intervall"] = "15s"
    assert any("intervall" in error for error in schema_errors(unknown))


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(KUBERNETES)))
def test_every_manifest_file_validates(path: Path) -> None:
    errors = [error for obj in load_all(path) for error in schema_errors(obj)]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_rendered_object_validates(target: str) -> None:
    objects = render(target)
    assert objects
    errors = [error for obj in objects for error in schema_errors(obj)]
    assert not errors, "\n".join(errors)


# ------------------------------------------------------------------------------------------ planner


def test_the_planner_runs_one_writer_on_its_volume() -> None:
    objects = render("base")
    deployment = one(objects, "Deployment", "statebudget")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate", "SQLite is single-writer: no rolling overlap"
    assert selects(deployment["spec"]["selector"]["matchLabels"], deployment["spec"]["template"]["metadata"]["labels"])
    planner = container(deployment, "planner")
    db = planner["args"][planner["args"].index("--db") + 1]
    data = volume_of_mount(deployment, "planner", str(Path(db).parent))
    assert data["persistentVolumeClaim"]["claimName"] == one(objects, "PersistentVolumeClaim")["metadata"]["name"]
    assert "emptyDir" in volume_of_mount(deployment, "planner", "/tmp")


def test_the_planner_is_locked_down_and_probed() -> None:
    deployment = one(render("base"), "Deployment", "statebudget")
    pod = pod_spec(deployment)
    planner = container(deployment, "planner")
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert planner["securityContext"]["readOnlyRootFilesystem"] is True
    assert planner["securityContext"]["allowPrivilegeEscalation"] is False
    assert planner["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert pod["automountServiceAccountToken"] is False
    ports = {port["name"] for port in planner["ports"]}
    assert planner["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert planner["startupProbe"]["httpGet"]["path"] == "/livez"
    assert planner["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert planner[probe]["httpGet"]["port"] in ports
    assert {"cpu", "memory"} <= planner["resources"]["requests"].keys()
    assert "memory" in planner["resources"]["limits"]


def dockerfile_instruction(name: str) -> str:
    (line,) = [line for line in DOCKERFILE.read_text(encoding="utf-8").splitlines() if line.startswith(f"{name} ")]
    return line.removeprefix(f"{name} ").strip()


def test_the_workloads_run_the_dockerfile_image() -> None:
    """The image's user, port and entry point are what the pods assume."""
    user, group = (int(part) for part in dockerfile_instruction("USER").split(":"))
    (entrypoint,) = json.loads(dockerfile_instruction("ENTRYPOINT"))
    objects = render("base")
    deployment = one(objects, "Deployment", "statebudget")
    daemonset = one(objects, "DaemonSet", "statebudget-agent")
    for workload in (deployment, daemonset):
        context = pod_spec(workload)["securityContext"]
        assert (context["runAsUser"], context["runAsGroup"]) == (user, group)
        for item in pod_spec(workload)["containers"]:
            assert item["image"].split(":")[0] == "statebudget"
    planner = container(deployment, "planner")
    assert "command" not in planner, f"the image's entry point ({entrypoint}) runs the planner"
    assert planner["args"][0] == "serve"
    assert str(planner["ports"][0]["containerPort"]) == dockerfile_instruction("EXPOSE")
    assert planner["args"][planner["args"].index("--port") + 1] == dockerfile_instruction("EXPOSE")


def test_the_service_reaches_the_planner() -> None:
    objects = render("base")
    deployment = one(objects, "Deployment", "statebudget")
    service = one(objects, "Service", "statebudget")
    assert selects(service["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    assert not selects(service["spec"]["selector"], one(objects, "DaemonSet")["spec"]["template"]["metadata"]["labels"])
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] in {p["name"] for p in container(deployment, "planner")["ports"]}


def planner_environment(deployment: Object) -> dict[str, str]:
    """The planner's environment as the pod would see it, with example values for the Secret's keys."""
    examples = {"operator-tokens": '["op-secret"]', "node-tokens": '{"n1": "n1-secret"}'}
    env = {}
    for item in container(deployment, "planner")["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            env[item["name"]] = examples[item["valueFrom"]["secretKeyRef"]["key"]]
    return env


def test_a_fresh_planner_is_seeded_from_the_scenario_config_map_not_the_demo(monkeypatch: pytest.MonkeyPatch) -> None:
    from planner_service.api.app import seed_for
    from planner_service.domain.demo import demo_scenario
    from planner_service.settings import Settings

    deployment = one(render("base"), "Deployment", "statebudget")
    for name in [name for name in os.environ if name.startswith("STATEBUDGET_")]:
        monkeypatch.delenv(name)
    for name, value in planner_environment(deployment).items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.scenario_path is not None
    assert settings.operator_tokens == ["op-secret"] and settings.node_tokens == {"n1": "n1-secret"}
    assert seed_for(settings) is not demo_scenario
    scenario = volume_of_mount(deployment, "planner", str(settings.scenario_path.parent))
    assert scenario["configMap"]["name"] == "statebudget-scenario"
    assert [item["path"] for item in scenario["configMap"]["items"]] == [settings.scenario_path.name]
    assert not scenario["configMap"].get("optional", False), "without its scenario the planner must not start"


def test_the_tokens_come_from_the_secret() -> None:
    deployment = one(render("base"), "Deployment", "statebudget")
    env = {item["name"]: item for item in container(deployment, "planner")["env"]}
    for name in ("STATEBUDGET_OPERATOR_TOKENS", "STATEBUDGET_NODE_TOKENS"):
        reference = env[name]["valueFrom"]["secretKeyRef"]
        assert reference["name"] == "statebudget-tokens" and not reference.get("optional", False)


# ------------------------------------------------------------------------------------------ agents


def test_one_agent_per_gpu_node_without_taking_its_gpus() -> None:
    daemonset = one(render("production"), "DaemonSet", "statebudget-agent")
    pod = pod_spec(daemonset)
    assert pod["nodeSelector"] == {"statebudget.io/agent": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["runtimeClassName"] == "nvidia"
    agent = container(daemonset, "agent")
    env = {item["name"]: item for item in agent["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert "utility" in env["NVIDIA_DRIVER_CAPABILITIES"]["value"].split(","), "nvidia-smi needs `utility`"
    for section in ("requests", "limits"):
        assert "nvidia.com/gpu" not in agent["resources"].get(section, {}), "the engines hold the GPUs"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert agent["securityContext"]["readOnlyRootFilesystem"] is True
    assert "emptyDir" in volume_of_mount(daemonset, "agent", "/tmp")
    assert pod["automountServiceAccountToken"] is False


def test_the_dev_overlay_runs_agents_without_the_nvidia_runtime() -> None:
    daemonset = one(render("dev"), "DaemonSet", "statebudget-agent")
    assert "runtimeClassName" not in pod_spec(daemonset)
    assert "tolerations" not in pod_spec(daemonset)
    names = {item["name"] for item in container(daemonset, "agent")["env"]}
    assert "NODE_NAME" in names and not any(name.startswith("NVIDIA_") for name in names)


def agent_script(daemonset: Object) -> str:
    agent = container(daemonset, "agent")
    assert agent["command"] == ["/bin/sh", "-c"]
    (script,) = agent["args"]
    return str(script)


def agent_run_flags() -> set[str]:
    from clients.agent.cli import app

    command = typer.main.get_command(app)  # a group (typer's own click): `run` is one of its commands
    run = command.commands["run"]
    return {opt for param in run.params for opt in param.opts if opt.startswith("--")}


def test_the_agent_command_line_uses_real_flags() -> None:
    script = agent_script(one(render("base"), "DaemonSet", "statebudget-agent"))
    (line,) = [line for line in script.splitlines() if "statebudget-agent run" in line]
    used = set(re.findall(r"(--[a-z][a-z-]*)", line))
    assert used, line
    assert used <= agent_run_flags(), f"`statebudget-agent run` has no {sorted(used - agent_run_flags())}"


def mount_root(daemonset: Object, volume_key: str, name_key: str, name: str) -> Path:
    """Where the agent container mounts the ConfigMap or Secret `name`."""
    (volume,) = [v for v in pod_spec(daemonset)["volumes"] if v.get(volume_key, {}).get(name_key) == name]
    (mount,) = [m for m in container(daemonset, "agent")["volumeMounts"] if m["name"] == volume["name"]]
    return Path(mount["mountPath"])


def run_agent_script(
    daemonset: Object, tmp_path: Path, node: str, config_keys: dict[str, str], token_keys: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """The agent container's script under /bin/sh, its mounts moved under tmp_path and `statebudget-agent`
    replaced by a program that prints its arguments and its token."""
    shell = shutil.which("sh")
    if shell is None:
        pytest.skip("no POSIX shell to run the agent's start script")
    config_dir = mount_root(daemonset, "configMap", "name", "statebudget-agent")
    token_dir = mount_root(daemonset, "secret", "secretName", "statebudget-node-tokens")
    script = agent_script(daemonset)
    for mounted, files in ((config_dir, config_keys), (token_dir, token_keys)):
        local = tmp_path / mounted.relative_to("/")
        local.mkdir(parents=True)
        for key, content in files.items():
            (local / key).write_text(content, encoding="utf-8")
        script = script.replace(str(mounted), str(local))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "statebudget-agent"
    fake.write_text('#!/bin/sh\necho "args: $*"\necho "token: $STATEBUDGET_AGENT_TOKEN"\n', encoding="utf-8")
    fake.chmod(0o755)
    env = {item["name"]: item.get("value", "") for item in container(daemonset, "agent")["env"]}
    env.update(NODE_NAME=node, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run([shell, "-c", script], env=env, capture_output=True, text=True, timeout=30, check=False)


def test_each_agent_pod_picks_its_own_nodes_config_and_token(tmp_path: Path) -> None:
    daemonset = one(render("base"), "DaemonSet", "statebudget-agent")
    result = run_agent_script(
        daemonset,
        tmp_path,
        "gpu-node-2",
        {"gpu-node-1.yaml": "node_id: n1\n", "gpu-node-2.yaml": "node_id: n2\n"},
        {"gpu-node-1": "n1-secret", "gpu-node-2": "n2-secret"},
    )
    assert result.returncode == 0, result.stderr
    args = result.stdout.splitlines()[0]
    assert args.startswith("args: run --config ") and args.split()[3].endswith("/gpu-node-2.yaml")
    assert "--server http://statebudget:8000" in args
    assert result.stdout.splitlines()[1] == "token: n2-secret"
    assert "n2-secret" not in args, "the token is on no command line"


@pytest.mark.parametrize(("missing", "message"), [("config", "ConfigMap statebudget-agent"), ("token", "Secret")])
def test_an_agent_on_a_node_without_its_keys_says_which(tmp_path: Path, missing: str, message: str) -> None:
    daemonset = one(render("base"), "DaemonSet", "statebudget-agent")
    configs = {} if missing == "config" else {"gpu-node-3.yaml": "node_id: n3\n"}
    tokens = {} if missing == "token" else {"gpu-node-3": "n3-secret"}
    result = run_agent_script(daemonset, tmp_path, "gpu-node-3", configs, tokens)
    assert result.returncode == 2
    assert "gpu-node-3" in result.stderr and message in result.stderr
    assert "args:" not in result.stdout


def test_agents_reach_the_planners_service() -> None:
    objects = render("base")
    daemonset = one(objects, "DaemonSet", "statebudget-agent")
    env = {item["name"]: item.get("value") for item in container(daemonset, "agent")["env"]}
    service = one(objects, "Service", "statebudget")
    (port,) = service["spec"]["ports"]
    assert env["STATEBUDGET_SERVER_URL"] == f"http://{service['metadata']['name']}:{port['port']}"


# ------------------------------------------------------------------------------------------ monitoring


def test_the_service_monitor_scrapes_the_planner_as_the_job_the_alerts_name() -> None:
    objects = render("production")
    service = one(objects, "Service", "statebudget")
    monitor = one(objects, "ServiceMonitor", "statebudget")
    assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    # prometheus-operator names the job after the Service label that jobLabel names (else the Service's name)
    job = service["metadata"]["labels"][monitor["spec"]["jobLabel"]]
    assert alert_jobs() == {job}, f"the alerts select job {sorted(alert_jobs())}, the ServiceMonitor makes {job!r}"
    for obj in (monitor, one(objects, "PrometheusRule")):
        assert obj["metadata"]["namespace"] == service["metadata"]["namespace"]
        assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_the_prometheus_rule_carries_the_alert_rules_unchanged() -> None:
    alerts = yaml.safe_load(ALERT_RULES.read_text(encoding="utf-8"))
    rule = one(render("production"), "PrometheusRule", "statebudget")
    assert rule["spec"]["groups"] == alerts["groups"]


def test_the_prometheus_rule_file_is_generated_from_the_alerts() -> None:
    generator = load_script(KUBERNETES / "generate_prometheusrule.py")
    expected = generator.render(ALERT_RULES)
    actual = (COMPONENT / "prometheusrule.yaml").read_text(encoding="utf-8")
    assert actual == expected, "run `python deploy/kubernetes/generate_prometheusrule.py`"
    (rule,) = load_all(COMPONENT / "prometheusrule.yaml")
    assert rule["spec"]["groups"] == yaml.safe_load(ALERT_RULES.read_text(encoding="utf-8"))["groups"]


def test_the_dev_overlay_needs_no_prometheus_operator() -> None:
    kinds = {obj["kind"] for obj in render("dev")}
    assert not kinds & {"ServiceMonitor", "PrometheusRule"}
    assert {"Deployment", "DaemonSet", "Service", "NetworkPolicy"} <= kinds


# ------------------------------------------------------------------------------------------ network


def ingress_peers(policy: Object) -> Iterator[tuple[Object, list[Object]]]:
    for rule in policy["spec"].get("ingress", []):
        for peer in rule["from"]:
            yield peer, rule["ports"]


def test_only_agents_routers_and_prometheus_reach_the_planner() -> None:
    objects = render("production")
    deployment = one(objects, "Deployment", "statebudget")
    daemonset = one(objects, "DaemonSet", "statebudget-agent")
    policy = one(objects, "NetworkPolicy", "statebudget-planner")
    assert selects(policy["spec"]["podSelector"]["matchLabels"], deployment["spec"]["template"]["metadata"]["labels"])
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert policy["spec"]["egress"] == [], "the planner opens no connection"
    planner_ports = {port["name"] for port in container(deployment, "planner")["ports"]}
    peers = list(ingress_peers(policy))
    assert len(peers) == 3
    for peer, ports in peers:
        assert ports and {port["port"] for port in ports} <= planner_ports, "the planner's port, nothing else"
        assert peer.get("podSelector", {}).get("matchLabels"), f"a peer that admits every pod: {peer}"
    pods = [peer["podSelector"]["matchLabels"] for peer, _ in peers]
    agent_pods = daemonset["spec"]["template"]["metadata"]["labels"]
    (agents,) = [peer for peer, _ in peers if selects(peer["podSelector"]["matchLabels"], agent_pods)]
    assert "namespaceSelector" not in agents, "agents of this namespace only"
    assert {"statebudget.io/client": "true"} in pods, "routers label their pods to reach the planner"
    (prometheus,) = [
        peer for peer, _ in peers if peer["podSelector"]["matchLabels"].get("app.kubernetes.io/name") == "prometheus"
    ]
    assert prometheus["namespaceSelector"]["matchLabels"], "Prometheus from its own namespace only"


def test_nothing_connects_to_the_agents() -> None:
    objects = render("base")
    daemonset = one(objects, "DaemonSet", "statebudget-agent")
    policy = one(objects, "NetworkPolicy", "statebudget-agent")
    assert selects(policy["spec"]["podSelector"]["matchLabels"], daemonset["spec"]["template"]["metadata"]["labels"])
    assert policy["spec"]["policyTypes"] == ["Ingress"] and policy["spec"]["ingress"] == []


# ------------------------------------------------------------------------------------------ overlays


@pytest.mark.parametrize(("target", "namespace"), [("production", "statebudget"), ("dev", "statebudget-dev")])
def test_overlays_put_everything_in_their_namespace(target: str, namespace: str) -> None:
    for obj in render(target):
        assert obj["metadata"].get("namespace") == namespace, f"{obj['kind']}/{obj['metadata']['name']}"


def test_the_production_overlay_pulls_the_image_from_a_registry() -> None:
    objects = render("production")
    images = {c["image"] for kind in ("Deployment", "DaemonSet") for c in pod_spec(one(objects, kind))["containers"]}
    (image,) = images
    assert "/" in image and image.rsplit(":", 1)[1], "a registry path and a tag"


# ------------------------------------------------------------------------------------------ instructions


def kubernetes_section() -> str:
    text = DEPLOY_README.read_text(encoding="utf-8")
    start = text.index("## Deploy on Kubernetes")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_the_readme_creates_every_config_map_and_secret_the_pods_need() -> None:
    section = kubernetes_section()
    objects = render("production")
    needed: set[tuple[str, str, str]] = set()
    for workload in (one(objects, "Deployment"), one(objects, "DaemonSet")):
        for volume in pod_spec(workload)["volumes"]:
            if "configMap" in volume:
                keys = [item["key"] for item in volume["configMap"].get("items", [])]
                needed |= {("configmap", volume["configMap"]["name"], key) for key in keys or [""]}
            if "secret" in volume:
                needed.add(("secret generic", volume["secret"]["secretName"], ""))
        for item in pod_spec(workload)["containers"][0].get("env", []):
            reference = item.get("valueFrom", {}).get("secretKeyRef")
            if reference:
                needed.add(("secret generic", reference["name"], reference["key"]))
    for kind, name, key in sorted(needed):
        commands = [line for line in section.splitlines() if f"create {kind} {name}" in line]
        assert commands, f"deploy/README.md does not say how to create {kind} {name}"
        if key:
            following = section[section.index(commands[0]) :].split("\n\n")[0]
            assert f"{key}=" in following, f"deploy/README.md creates {name} without its key {key}"
    for overlay in ("production", "dev"):
        assert f"kubectl apply -k deploy/kubernetes/overlays/{overlay}" in section
    assert "kubectl label node" in section and "statebudget.io/agent=true" in section
