"""The Dockerfile without a Docker engine: its stages, user, health check and volume, and an entry point
that is the project's real console script running a real subcommand."""

from __future__ import annotations

import importlib
import json
import shlex
import subprocess
import sys
import threading
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
PYPROJECT = REPO / "pyproject.toml"
COMPOSE = REPO / "docker-compose.yml"
KUBERNETES = REPO / "deploy" / "kubernetes" / "statebudget.yaml"


class Instruction(NamedTuple):
    keyword: str  # upper case: FROM, RUN, USER ...
    arguments: str  # the rest of the logical line, continuations joined


class Stage(NamedTuple):
    base: str  # the FROM image, build arguments substituted
    name: str | None
    instructions: list[Instruction]


def instructions(text: str) -> list[Instruction]:
    """Logical Dockerfile lines: comments dropped, backslash continuations joined."""
    result, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, arguments = (pending + line).partition(" ")
        result.append(Instruction(keyword.upper(), arguments.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return result


def stages(parsed: list[Instruction]) -> list[Stage]:
    """Build stages in order; global ARG defaults (before the first FROM) substituted into each FROM."""
    build_args: dict[str, str] = {}
    result: list[Stage] = []
    for instruction in parsed:
        if instruction.keyword == "FROM":
            words = [w for w in instruction.arguments.split() if not w.startswith("--")]
            base = words[0]
            for name, value in build_args.items():
                base = base.replace(f"${{{name}}}", value).replace(f"${name}", value)
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            result.append(Stage(base, name, []))
        elif not result:
            assert instruction.keyword == "ARG", f"{instruction.keyword} before the first FROM"
            name, _, value = instruction.arguments.partition("=")
            build_args[name] = value
        else:
            result[-1].instructions.append(instruction)
    return result


def exec_form(instruction: Instruction) -> list[str]:
    """The JSON (exec) form of ENTRYPOINT / CMD / HEALTHCHECK CMD; shell form is refused."""
    arguments = instruction.arguments
    assert arguments.startswith("["), f"{instruction.keyword} must use the exec (JSON) form: {arguments}"
    value = json.loads(arguments)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value)
    return value


def last(stage: Stage, keyword: str) -> Instruction:
    found = [i for i in stage.instructions if i.keyword == keyword]
    assert found, f"no {keyword} in stage {stage.name or stage.base}"
    return found[-1]


@pytest.fixture(scope="module")
def build() -> list[Stage]:
    return stages(instructions(DOCKERFILE.read_text(encoding="utf-8")))


@pytest.fixture(scope="module")
def final(build: list[Stage]) -> Stage:
    return build[-1]


def image_command(final: Stage) -> list[str]:
    return exec_form(last(final, "CMD"))


def option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_build_is_multi_stage_on_python_slim(build: list[Stage], final: Stage) -> None:
    assert len(build) >= 2, "a builder stage and a runtime stage"
    assert final.base == "python:3.11-slim"
    named = {stage.name for stage in build[:-1]}
    sources = [
        word.removeprefix("--from=")
        for instruction in final.instructions
        if instruction.keyword == "COPY"
        for word in instruction.arguments.split()
        if word.startswith("--from=")
    ]
    assert sources and set(sources) <= named, "the runtime stage copies its environment from an earlier stage"


def test_final_stage_runs_as_a_non_root_user(final: Stage) -> None:
    user = last(final, "USER").arguments.split(":")[0]
    assert user not in {"root", "0", ""}


def test_health_check_asks_livez_on_the_exposed_port(final: Stage) -> None:
    health = last(final, "HEALTHCHECK")
    assert health.arguments.upper() != "NONE"
    command = Instruction("CMD", health.arguments[health.arguments.index("CMD") + 3 :].strip())
    words = exec_form(command)
    assert words[:2] == ["python", "-c"], "slim images have no curl: the check uses python's urllib"
    exposed = last(final, "EXPOSE").arguments.split()
    assert exposed == ["8000"]
    assert "http://127.0.0.1:8000/livez" in words[2]


class HealthServer(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/livez" else 404)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
def test_health_check_command_tells_healthy_from_unhealthy(final: Stage, status: int, healthy: bool) -> None:
    health = last(final, "HEALTHCHECK")
    code = exec_form(Instruction("CMD", health.arguments[health.arguments.index("CMD") + 3 :].strip()))[2]
    handler = type("Handler", (HealthServer,), {"status": status})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        probe = code.replace("127.0.0.1:8000", f"127.0.0.1:{server.server_address[1]}")
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=30, check=False)
    finally:
        server.shutdown()
        server.server_close()
    assert (result.returncode == 0) is healthy, result.stderr.decode()


def test_data_volume_holds_the_database(final: Stage) -> None:
    volumes = exec_form(last(final, "VOLUME"))
    assert volumes == ["/data"]
    setup = " ".join(i.arguments for i in final.instructions if i.keyword == "RUN")
    assert "chown" in setup and "/data" in setup, "the volume belongs to the unprivileged user"
    assert option(image_command(final), "--db").startswith("/data/")
    assert option(image_command(final), "--port") == "8000"


def test_entrypoint_is_the_projects_console_script(final: Stage) -> None:
    scripts = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["scripts"]
    entrypoint = exec_form(last(final, "ENTRYPOINT"))
    assert entrypoint == ["statebudget"]
    assert scripts["statebudget"] == "planner_service.cli:app"
    module, _, attribute = scripts["statebudget"].partition(":")
    import typer

    assert isinstance(getattr(importlib.import_module(module), attribute), typer.Typer)


def test_cmd_is_a_real_subcommand_with_real_options(final: Stage) -> None:
    from typer.testing import CliRunner

    from planner_service.cli import app

    command = image_command(final)
    runner = CliRunner()
    result = runner.invoke(app, [command[0], "--help"])
    assert result.exit_code == 0, result.output
    # Click rejects an unknown option while parsing, before the eager --help answers: every flag is real.
    result = runner.invoke(app, [*command, "--help"])
    assert result.exit_code == 0, result.output


def test_compose_and_kubernetes_run_the_image_command(final: Stage) -> None:
    command = image_command(final)
    compose = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    planner = compose["services"]["planner"]
    if "command" in planner:
        given = planner["command"]
        assert (shlex.split(given) if isinstance(given, str) else given) == command
    documents = yaml.safe_load_all(KUBERNETES.read_text(encoding="utf-8"))
    deployments = [d for d in documents if d and d["kind"] == "Deployment"]
    (container,) = deployments[0]["spec"]["template"]["spec"]["containers"]
    assert "command" not in container, "keep the image's ENTRYPOINT"
    assert container.get("args", command) == command
    assert container["securityContext"].get("readOnlyRootFilesystem") is not True or any(
        mount["mountPath"] == "/tmp" for mount in container["volumeMounts"]
    )
    user = int(last(final, "USER").arguments.split(":")[0])
    assert deployments[0]["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == user


def test_build_context_carries_what_the_wheel_needs() -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", "exclude everything, then allow what the build needs"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    assert {"pyproject.toml", project["readme"]} <= allowed
    assert "planner_service" in allowed
    for package_dir in ("planner_service", "clients"):
        if (REPO / package_dir).is_dir():
            assert package_dir in allowed, f"{package_dir}/ is a package the wheel includes"


def test_the_image_installs_the_gateway_extra_the_compose_gateway_runs_on(build: list[Stage]) -> None:
    """The Compose file's gateway service runs this image's `statebudget gateway`, which refuses to start without
    its extra (httptools, uvloop): the builder installs the wheel with it and imports both."""
    compose = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    assert compose["services"]["gateway"]["command"][0] == "gateway"
    extras = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["optional-dependencies"]["gateway"]
    runs = " ".join(i.arguments for stage in build for i in stage.instructions if i.keyword == "RUN")
    assert ".whl)[gateway]" in runs
    modules = sorted(requirement.split(">")[0] for requirement in extras)
    assert f"import {', '.join(modules)}" in runs
