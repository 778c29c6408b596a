"""The README's operator curl examples run top to bottom against a real `statebudget serve --demo --reset`,
twice on the same database, each answer with the shape the README shows (the block that needs tokens against
a service with them, its answers word for word)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (shutil.which("curl") and shutil.which("jq")), reason="the README's examples use curl and jq"
    ),
]

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("readme_curl", REPO / "deploy" / "readme_curl.py")
assert _spec is not None and _spec.loader is not None
readme_curl = importlib.util.module_from_spec(_spec)
sys.modules["readme_curl"] = readme_curl  # its dataclass looks its module up
_spec.loader.exec_module(readme_curl)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(tmp: Path, env_extra: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("STATEBUDGET_")} | env_extra
    log = tmp / "serve.log"
    command = [sys.executable, "-m", "planner_service.cli", "serve", "--demo", "--reset"]
    command += ["--db", str(tmp / "demo.db"), "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(command, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)
    url = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"http://{url}/livez", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"serve did not start:\n{log.read_text()}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run(command: str, url: str, cwd: Path, fail_on_http_error: bool) -> str:
    prelude = "set -euo pipefail\n"
    if fail_on_http_error:
        prelude += 'curl() { command curl --fail-with-body "$@"; }\n'
    out = subprocess.run(
        ["bash", "-c", prelude + command.replace(readme_curl.README_URL, url)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, f"{command}\nexit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def json_values(text: str) -> list[Any] | None:
    """The JSON documents in `text` one after another (jq prints one per line, the README folds them), or
    None when it is not JSON."""
    decoder = json.JSONDecoder()
    values, i = [], 0
    text = text.strip()
    while i < len(text):
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)
        while i < len(text) and text[i].isspace():
            i += 1
    return values


def same_shape(got: Any, shown: Any, where: str, depth: int = 0) -> None:
    """What a README example promises of an answer from another run: the same keys two levels deep (below,
    objects and locations differ by kind), the same types (a null stands for any), lists alike by their first
    element."""
    if got is None or shown is None:
        return
    if isinstance(shown, dict):
        assert isinstance(got, dict), f"{where}: {got!r} is not an object"
        if depth < 2:
            assert set(got) == set(shown), f"{where}: keys {sorted(got)}, the README shows {sorted(shown)}"
            for key in shown:
                same_shape(got[key], shown[key], f"{where}.{key}", depth + 1)
    elif isinstance(shown, list):
        assert isinstance(got, list), f"{where}: {got!r} is not a list"
        if got and shown:
            same_shape(got[0], shown[0], f"{where}[0]", depth + 1)
    elif isinstance(shown, bool) or isinstance(got, bool):
        assert type(got) is type(shown), f"{where}: {got!r} against the README's {shown!r}"
    elif isinstance(shown, int | float):
        assert isinstance(got, int | float), f"{where}: {got!r} is not a number"
    else:
        assert isinstance(got, str), f"{where}: {got!r} is not a string"


def check_answer(command: str, shown: list[str], got: str) -> None:
    if not shown:
        return
    expected = json_values("\n".join(shown))
    if expected is None:  # Prometheus lines: the same series names
        names = {re.split(r"[{ ]", line, maxsplit=1)[0] for line in got.splitlines()}
        for line in shown:
            assert re.split(r"[{ ]", line, maxsplit=1)[0] in names, f"{command}: {line!r} not in\n{got}"
        return
    actual = json_values(got)
    assert actual is not None, f"{command}: not JSON:\n{got}"
    if all(not isinstance(v, dict | list) for v in expected):  # a count or a status code: exact
        assert actual == expected, f"{command}: README shows {expected}, got {actual}"
        return
    assert actual, f"{command}: no answer"
    for got_value, shown_value in zip(actual, expected, strict=False):
        same_shape(got_value, shown_value, command)


def test_the_operator_examples_run_in_order_with_the_answers_the_readme_shows(tmp_path: Path) -> None:
    examples = readme_curl.examples((REPO / "README.md").read_text(encoding="utf-8"))
    open_examples = [e for e in examples if not e.needs_tokens]
    assert len(open_examples) >= 15 and any("whatif" in e.command for e in open_examples)
    proc, url = serve(tmp_path, {"STATEBUDGET_LOG_LEVEL": "warning"})
    try:
        for example in open_examples:
            got = run(example.command, url, tmp_path, fail_on_http_error=True)
            check_answer(example.command, example.output, got)
    finally:
        stop(proc)
    # again on the same database: `serve --reset` starts from the demo, so the GPU the first round added is
    # not there to make its PUT a duplicate
    proc, url = serve(tmp_path, {"STATEBUDGET_LOG_LEVEL": "warning"})
    try:
        upto = next(i for i, e in enumerate(open_examples) if "PUT localhost:8080/v1/cluster" in e.command)
        for example in open_examples[: upto + 1]:
            got = run(example.command, url, tmp_path, fail_on_http_error=True)
            check_answer(example.command, example.output, got)
    finally:
        stop(proc)


def test_the_token_examples_answer_word_for_word(tmp_path: Path) -> None:
    examples = [e for e in readme_curl.examples((REPO / "README.md").read_text(encoding="utf-8")) if e.needs_tokens]
    assert examples
    tokens = {"STATEBUDGET_OPERATOR_TOKENS": '["op-secret"]', "STATEBUDGET_NODE_TOKENS": '{"n1": "n1-secret"}'}
    proc, url = serve(tmp_path, tokens)
    try:
        for example in examples:
            got = run(example.command, url, tmp_path, fail_on_http_error=False)
            assert json_values(got) == json_values("\n".join(example.output)), example.command
    finally:
        stop(proc)


def test_the_printed_script_runs_the_same_commands() -> None:
    script = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "readme_curl.py"), "--url", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    examples = readme_curl.examples((REPO / "README.md").read_text(encoding="utf-8"))
    body = "\n".join(e.command.replace("localhost:8080", "127.0.0.1:9") for e in examples if not e.needs_tokens)
    assert script.endswith("\n" + body + "\n")
    assert "set -euo pipefail" in script and "--fail-with-body" in script
