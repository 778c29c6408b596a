"""Agent configuration, the executor registry, and the `statebudget-agent` command."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from clients.agent.cli import app
from clients.agent.config import AgentConfig, load_config
from clients.agent.executors import ExecutorName, ExecutorRegistry, UnknownExecutor, default_registry
from clients.agent.executors.local import LocalExecutor
from clients.agent.operations import Capability
from planner_service.domain.scenario import Capability as ServiceCapability


def test_capabilities_match_the_service():
    assert {c.value for c in Capability} == {c.value for c in ServiceCapability}


def test_yaml_file_then_flags(tmp_path):
    path = tmp_path / "agent.yaml"
    path.write_text(
        "server_url: http://planner:8080\nnode_id: n1\nexecutor: vllm\nscale: 0.001\n"
        "engines: {coder: 'http://127.0.0.1:8000'}\ngpus: [{id: n1-g0, hbm_bytes: 1000, device: 0}]\n"
        "model_paths: {coder: /models/coder}\n"
    )
    config = load_config(path, {"node_id": "n2", "token": None})
    assert config.node_id == "n2" and config.executor is ExecutorName.VLLM and config.scale == 0.001
    engine = config.engines["coder"]
    assert engine.url == "http://127.0.0.1:8000" and engine.model_path == "/models/coder"
    assert engine.management == "adopted" and config.gpus[0].hbm_bytes == 1000
    json_path = tmp_path / "agent.json"
    json_path.write_text(json.dumps({"node_id": "n3", "max_parallel": 2}))
    assert load_config(json_path, {}).max_parallel == 2
    with pytest.raises(ValueError, match="scale"):
        load_config(None, {"node_id": "n1", "scale": 2})
    with pytest.raises(ValueError, match="two GPUs share an id"):
        AgentConfig(node_id="n1", gpus=[{"id": "g"}, {"id": "g"}])


def test_engine_gpus_name_a_configured_engine_and_gpus():
    with pytest.raises(ValueError, match="engine_gpus.coder: no engine configured"):
        AgentConfig(node_id="n1", engine_gpus={"coder": ["n1-g0"]})
    with pytest.raises(ValueError, match=r"engine_gpus.coder: \['n1-g9'\] not among `gpus`"):
        AgentConfig(
            node_id="n1", engines={"coder": "http://e"}, gpus=[{"id": "n1-g0"}], engine_gpus={"coder": ["n1-g9"]}
        )


def test_registry_lists_the_choices_and_refuses_a_second_registration():
    registry = default_registry()
    assert registry.names() == ["local", "sglang", "vllm"]
    with pytest.raises(UnknownExecutor, match="unknown executor 'tgi'; choices: local, sglang, vllm"):
        registry.create("tgi", AgentConfig(node_id="n1"))
    with pytest.raises(ValueError, match="already registered"):
        registry.register(ExecutorName.LOCAL, LocalExecutor.from_config)
    fresh = ExecutorRegistry()
    fresh.register(ExecutorName.LOCAL, LocalExecutor.from_config)
    assert isinstance(fresh.create("local", AgentConfig(node_id="n1")), LocalExecutor)
    with pytest.raises(UnknownExecutor, match="unknown executor 'lmcache'"):  # LMCache is a vLLM feature
        registry.create("lmcache", AgentConfig(node_id="n1"))


def test_a_managed_engine_needs_its_launch_spec():
    with pytest.raises(ValueError, match="management: managed needs `launch`"):
        AgentConfig(node_id="n1", engines={"coder": {"url": "http://e", "management": "managed"}})
    config = AgentConfig(
        node_id="n1",
        engines={"coder": {"url": "http://e", "management": "managed", "launch": {"command": ["vllm"], "port": 8000}}},
    )
    assert config.engines["coder"].launch is not None and config.engines["coder"].launch.ready_path == "/health"


def test_cli_lists_executors_and_rejects_bad_configuration(tmp_path):
    runner = CliRunner()
    out = runner.invoke(app, ["executors"])
    assert out.exit_code == 0 and "weights_offload" in out.output and "sglang" in out.output
    bad = runner.invoke(app, ["run", "--node", "n1", "--executor", "tgi"])
    assert bad.exit_code == 2 and "executor" in bad.output
    missing = runner.invoke(app, ["run", "--executor", "local"])
    assert missing.exit_code == 2 and "node_id" in missing.output
    engine = runner.invoke(app, ["run", "--node", "n1", "--executor", "vllm", "--engine", "no-equals-sign"])
    assert engine.exit_code != 0 and "MODEL=URL" in engine.output


def test_flags_win_over_the_environment_which_wins_over_the_file(tmp_path, monkeypatch):
    path = tmp_path / "agent.yaml"
    path.write_text("node_id: n1\nlease_wait_seconds: 3\nmax_parallel: 2\nheartbeat_seconds: 7\n")
    monkeypatch.setenv("STATEBUDGET_AGENT_LEASE_WAIT_SECONDS", "5")
    monkeypatch.setenv("STATEBUDGET_AGENT_MAX_PARALLEL", "6")
    config = load_config(path, {"max_parallel": 9, "node_id": None})
    assert (config.node_id, config.lease_wait_seconds, config.max_parallel, config.heartbeat_seconds) == ("n1", 5, 9, 7)
    with pytest.raises(ValueError, match="no such settings file"):
        load_config(tmp_path / "missing.yaml", {})
