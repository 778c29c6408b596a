"""The catalog-exceeds-HBM scenario: about 1 TB of weights on the demo's 571 GB of HBM.

The demo's cluster (`demo.py`: 4x L40, 4x A100 40GB PCIe, 8x RTX 3090, every node keeping every
checkpoint on NVMe and serving every model through vLLM with LMCache and sleep mode), with a catalog of
eight models at their native precisions whose weights and routed experts need 999 GB, so no policy can
keep even half of the catalog on GPU. Every size is derived from the model presets (`model_presets.py`,
the HF configs and published counts of ../shared/data/models.json) and every HBM figure from the GPU
presets (`hardware.py`, ../shared/data/gpus.json); `exceeds_sizes()` recomputes them and a test checks
the totals. At native precision (bf16), GB = 10^9 bytes:

| id | preset | weights + experts | allowed precisions |
|---|---|---|---|
| planner | llama-3.1-8b-instruct | 16.1 | bf16 |
| coder | qwen2.5-coder-32b-instruct | 65.5 | bf16, int4 |
| reasoner | qwen3-235b-a22b (MoE, 128 experts, top 8) | 470.2 | bf16, fp8 |
| air | glm-4.5-air (MoE, 128 experts, top 8) | 213.7 | bf16, fp8 |
| summarizer | qwen2.5-7b-instruct | 15.2 | bf16 |
| vision | qwen2.5-vl-7b-instruct | 16.6 | bf16 |
| longctx | llama-3.3-70b-instruct | 141.1 | bf16, fp8 |
| fastmoe | qwen3-30b-a3b (MoE, 128 experts, top 8) | 61.1 | bf16 |

HBM: 4 x 45 GiB (L40) + 4 x 40 GiB (A100) + 8 x 24 GiB (RTX 3090) = 532 GiB = 571 GB, less 2 GiB
reserved per card. Nothing starts on a GPU: the day begins with every checkpoint on NVMe.
The hand-off prior is the demo's, with the small MoE reached from the planner and the coder.
Every engine but longctx's is launched with --max-model-len 32768 (`max_context_tokens`), as an operator
of these cards would: at its config's own limit each would need a KV pool of one such request per group
before it starts (engines.min_kv_pool_bytes_per_gpu), e.g. 16 GiB for the planner on one card.
"""

from __future__ import annotations

from typing import Any

from planner_service.domain.demo import demo_scenario_json
from planner_service.domain.problem import resolve_model
from planner_service.domain.scenario import ModelIn, Scenario, parse_scenario

EXCEEDS_MODELS: tuple[dict[str, Any], ...] = (
    {"id": "planner", "preset": "llama-3.1-8b-instruct", "precisions": ["bf16"]},
    {
        "id": "coder",
        "preset": "qwen2.5-coder-32b-instruct",
        "precisions": ["bf16", "int4"],
        "min_gpus": {"rtx-3090": 4},
    },
    {"id": "reasoner", "preset": "qwen3-235b-a22b", "precisions": ["bf16", "fp8"]},
    {"id": "air", "preset": "glm-4.5-air", "precisions": ["bf16", "fp8"]},
    {"id": "summarizer", "preset": "qwen2.5-7b-instruct", "precisions": ["bf16"]},
    {"id": "vision", "preset": "qwen2.5-vl-7b-instruct", "precisions": ["bf16"]},
    {"id": "longctx", "preset": "llama-3.3-70b-instruct", "precisions": ["bf16", "fp8"]},
    {"id": "fastmoe", "preset": "qwen3-30b-a3b", "precisions": ["bf16"]},
)
ENGINE_FEATURES = ["lmcache", "sleep_mode", "dev_mode"]  # as the demo's engines
SERVED_CONTEXT_TOKENS = 32_768  # --max-model-len of every engine but longctx's (see the docstring)


def exceeds_sizes() -> dict[str, dict[str, int]]:
    """Per model: bytes of each allowed precision's non-expert weights, and of all its routed experts."""
    sizes: dict[str, dict[str, int]] = {}
    for spec in EXCEEDS_MODELS:
        model = resolve_model(ModelIn.model_validate(spec), f"models[{spec['id']}]")
        sizes[model.id] = {str(p): b for p, b in model.weights_bytes.items()}
        if model.is_moe:
            sizes[model.id]["experts"] = model.experts_bytes
    return sizes


def exceeds_scenario_json() -> dict[str, Any]:
    data = demo_scenario_json()
    sizes = exceeds_sizes()
    models = [m["id"] for m in EXCEEDS_MODELS]
    limits = {m: SERVED_CONTEXT_TOKENS for m in models if m != "longctx"}
    for node in data["cluster"]["nodes"]:
        node["engines"] = [{"model": m, "kind": "vllm", "features": list(ENGINE_FEATURES)} for m in models]
    residency = []
    for node in data["cluster"]["nodes"]:
        where = {"tier": "nvme", "node": node["id"]}
        for spec in EXCEEDS_MODELS:
            for precision in spec["precisions"]:
                residency.append(
                    {
                        "object": {"kind": "weights", "model": spec["id"], "precision": precision},
                        "location": where,
                        "bytes": sizes[spec["id"]][precision],
                    }
                )
            if "experts" in sizes[spec["id"]]:
                residency.append(
                    {
                        "object": {"kind": "experts", "model": spec["id"]},
                        "location": where,
                        "bytes": sizes[spec["id"]]["experts"],
                    }
                )
    handoff = data["predictor"]["handoff"]
    handoff["planner"]["fastmoe"] = 0.05
    handoff["coder"]["fastmoe"] = 0.05
    handoff["fastmoe"] = {"fastmoe": 0.5, "planner": 0.3, "coder": 0.2}
    served = [{**m, "max_context_tokens": limits[m["id"]]} if m["id"] in limits else dict(m) for m in EXCEEDS_MODELS]
    data.update(models=served, sessions=[], residency=residency)
    return data


def exceeds_scenario() -> Scenario:
    return parse_scenario(exceeds_scenario_json())
