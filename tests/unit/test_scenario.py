"""Scenario files: validation errors name the field path; sizes resolve from presets, configs or explicit values."""

import json

import pytest

from planner_service.domain.demo import demo_scenario, demo_scenario_json
from planner_service.domain.hardware import gpu_preset
from planner_service.domain.model_presets import model_preset
from planner_service.domain.problem import compile_problem
from planner_service.domain.scenario import ScenarioError, load_scenario, parse_scenario
from planner_service.domain.units import GIB


def minimal(**overrides):
    data = {
        "cluster": {"nodes": [{"id": "n1", "gpus": [{"id": "g1", "type": "l40"}]}]},
        "models": [{"id": "m", "preset": "qwen2.5-7b-instruct"}],
    }
    data.update(overrides)
    return data


def test_minimal_scenario_resolves_preset_sizes() -> None:
    problem = compile_problem(parse_scenario(minimal()), {})
    model = problem.models["m"]
    arch = model_preset("qwen2.5-7b-instruct").architecture
    assert model.weights_bytes["bf16"] == arch.weight_bytes("bf16")
    assert model.kv_bytes_per_token == 57344  # models.json kv_cache.bytes_per_token_bf16 for Qwen2.5-7B
    assert model.precisions[0] == "bf16"
    assert problem.gpus["g1"].capacity_bytes > 40 * GIB


def test_explicit_values_override_preset() -> None:
    data = minimal(
        models=[
            {"id": "m", "preset": "qwen2.5-7b-instruct", "kv_bytes_per_token": 1000, "weights_bytes": {"bf16": 123}}
        ]
    )
    model = compile_problem(parse_scenario(data), {}).models["m"]
    assert model.kv_bytes_per_token == 1000
    assert model.weights_bytes["bf16"] == 123


def test_explicit_only_model_needs_kv_bytes() -> None:
    data = minimal(models=[{"id": "m", "weights_bytes": {"bf16": 10 * GIB}}])
    with pytest.raises(ScenarioError, match=r"models\[0\]\.kv_bytes_per_token"):
        compile_problem(parse_scenario(data), {})


def test_moe_preset_splits_dense_and_experts() -> None:
    data = minimal(models=[{"id": "r", "preset": "deepseek-v3", "precisions": ["fp8"]}])
    model = compile_problem(parse_scenario(data), {}).models["r"]
    assert model.is_moe
    assert model.experts_bytes == 653908770816  # models.json routed_expert.bytes_all_routed_experts.fp8
    assert model.expert_bytes == 44040192  # models.json routed_expert.bytes_per_expert.fp8
    # the non-expert part is what remains of the 671B parameters at 1 byte each
    assert model.weights_bytes["fp8"] == 671026419200 - 653908770816


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d["cluster"]["nodes"][0]["gpus"][0].update(type=None), "cluster.nodes.0.gpus.0"),
        (
            lambda d: d["cluster"]["nodes"][0]["gpus"][0].update(reserved_bytes=-1),
            "cluster.nodes.0.gpus.0.reserved_bytes",
        ),
        (lambda d: d.update(sessions=[{"id": "s", "model": "nope"}]), "sessions[0].model"),
        (lambda d: d.update(sessions=[{"id": "s", "model": "m", "slo": "urgent"}]), "sessions.0.slo"),
        (lambda d: d["models"][0].update(precisions=["fp16"]), "models.0.precisions.0"),
        (
            lambda d: d.update(
                residency=[
                    {"object": {"kind": "weights", "model": "m"}, "location": {"tier": "gpu", "gpu": "g1"}, "bytes": 1}
                ]
            ),
            "residency.0.object",
        ),
        (
            lambda d: d.update(
                residency=[
                    {"object": {"kind": "experts", "model": "m"}, "location": {"tier": "gpu", "gpu": "g9"}, "bytes": 1}
                ]
            ),
            "residency[0].location.gpu",
        ),
        (lambda d: d["cluster"]["nodes"][0].update(engines=[{"model": "m", "gpus": ["g9"]}]), "engines[0].gpus[0]"),
        (
            lambda d: d["cluster"]["nodes"][0].update(engines=[{"model": "m", "gpus": "g1"}]),
            "cluster.nodes.0.engines.0.gpus",
        ),
        (
            lambda d: d["cluster"]["nodes"][0].update(engines=[{"model": "nope", "gpus": ["g1"]}]),
            "cluster.nodes[0].engines[0].model",
        ),
        (
            lambda d: d["cluster"]["nodes"][0].update(engines=[{"model": "m", "gpus": ["g1"]}] * 2),
            "duplicate engine model 'm'",
        ),
    ],
)
def test_malformed_scenario_names_the_field(mutate, field) -> None:
    data = minimal()
    mutate(data)
    with pytest.raises(ScenarioError) as error:
        parse_scenario(data)
    assert field in str(error.value)


def test_unknown_preset_lists_choices() -> None:
    with pytest.raises(ScenarioError, match="qwen2.5-7b-instruct"):
        compile_problem(parse_scenario(minimal(models=[{"id": "m", "preset": "gpt-5"}])), {})


def test_residency_over_capacity_is_rejected() -> None:
    data = minimal(
        residency=[
            {
                "object": {"kind": "weights", "model": "m", "precision": "bf16"},
                "location": {"tier": "gpu", "gpu": "g1"},
                "bytes": 10**15,
            }
        ]
    )
    with pytest.raises(ScenarioError, match="more than its full size"):
        compile_problem(parse_scenario(data), {})


def test_yaml_and_json_files_load(tmp_path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps(minimal()))
    assert load_scenario(path).models[0].id == "m"
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: [unclosed")
    with pytest.raises(ScenarioError, match="not valid JSON or YAML"):
        load_scenario(bad)


def test_demo_is_the_target_cluster_under_memory_pressure() -> None:
    scenario = demo_scenario()
    problem = compile_problem(scenario, {})
    types = {g.type for g in problem.gpus.values()}
    assert len(problem.nodes) == 4 and len(problem.gpus) == 16
    assert types == {"rtx-3090", "a100-40gb-pcie", "l40"}
    hbm = sum(gpu_preset(g.type).hbm_bytes for g in problem.gpus.values()) / GIB
    assert 520 < hbm < 560  # "about 540 GiB of HBM in all"
    catalog = sum(m.weights_bytes[m.preferred] + m.experts_bytes for m in problem.models.values()) / GIB
    assert catalog > hbm, "the demo catalog must not fit in HBM at once"
    assert len(problem.models) == 7 and len(problem.sessions) == 10
    assert demo_scenario_json()["cluster"]["nodes"][0]["id"] == "n1"


def test_a_node_s_engines_resolve_to_the_models_it_serves_and_their_gpus() -> None:
    data = minimal()
    data["cluster"]["nodes"][0]["gpus"].append({"id": "g0", "type": "l40"})
    data["cluster"]["nodes"][0]["engines"] = [{"model": "m", "gpus": ["g1", "g0"]}]
    node = compile_problem(parse_scenario(data), {}).nodes["n1"]
    assert dict(node.engine_gpus) == {"m": ("g0", "g1")} and node.serves == {"m"}
    assert node.can_serve("m") and not node.can_serve("other")
    del data["cluster"]["nodes"][0]["engines"]  # no engines listed: any model, on any group
    node = compile_problem(parse_scenario(data), {}).nodes["n1"]
    assert node.serves is None and node.can_serve("other") and not node.engine_gpus
