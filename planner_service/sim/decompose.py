"""Where `statebudget`'s difference from a fixed deployment comes from, one mechanism at a time.

A ladder of policies, each the one before plus one mechanism, replayed on the same synthetic trace per
reported seed (`seeds.trace`):

    static-tuned                 the best fixed partition a search over training seeds finds
    + online placement           the planner on the operator's groups, told no session's next model
    + switch prediction          the same with the switch predictor (`statebudget-groups`)
    + moving engines             plans may start engines on other groups (`statebudget`)

Each rung's metrics are means with 95 % t-intervals over the seeds, and each step's effect is the paired
difference (this rung − the one below, seed by seed) with its own t-interval, so a step whose interval
holds 0 is not distinguishable from none. Saturated runs are counted per rung, as `seeds.py` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from planner_service.domain.scenario import Scenario
from planner_service.sim.engine import simulate
from planner_service.sim.intervals import t_interval
from planner_service.sim.metrics import summarize
from planner_service.sim.policies import PolicyName, create_policy
from planner_service.sim.policies.static_tuned import tune_static
from planner_service.sim.seeds import check_seeds, trace
from planner_service.sim.slots import saturated
from planner_service.sim.synth import SynthParams

# the metrics a step's effect is reported on: (key in `seeds.METRICS`, how to read it from a summary)
EFFECT_METRICS: tuple[tuple[str, str, Callable[[dict[str, Any]], float]], ...] = (
    ("handoff_p95_seconds", "hand-off P95 s", lambda s: s["switch_latency_seconds"]["handoff"]["p95"]),
    ("completion_p95_seconds", "done P95 s", lambda s: s["completion_seconds"]["p95"]),
    ("gpu_gib_mean", "GPU GiB mean", lambda s: s["gpu_bytes"]["mean"] / 2**30),
    ("cold_starts", "cold starts", lambda s: float(s["engine_transitions"].get("cold_start", 0))),
)


@dataclass(frozen=True)
class Rung:
    label: str
    policy: PolicyName
    options: dict[str, Any]


LADDER: tuple[Rung, ...] = (
    Rung("static-tuned", PolicyName.STATIC_TUNED, {}),
    Rung("+ online placement on the operator's groups", PolicyName.STATEBUDGET_GROUPS, {"predict_switches": False}),
    Rung("+ switch prediction", PolicyName.STATEBUDGET_GROUPS, {}),
    Rung("+ moving engines between groups", PolicyName.STATEBUDGET, {}),
)


def decompose(
    scenario: Scenario,
    params: SynthParams,
    seeds: Sequence[int],
    train_seeds: Sequence[int],
    *,
    tune_budget: int = 200,
    ladder: Sequence[Rung] = LADDER,
    on_progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Replay every rung on each seed's trace; the rungs' intervals and each step's paired effect (module doc)."""
    check_seeds(seeds, train_seeds)
    if not train_seeds:
        raise ValueError("train_seeds: static-tuned is tuned on training seeds; give at least one")
    tuning = tune_static(
        scenario, [trace(scenario, params, s) for s in train_seeds], budget=tune_budget, seed=min(train_seeds)
    )
    if on_progress:
        on_progress(f"static-tuned: {tuning.replays} training replays over a space of {tuning.space_size}")
    values: list[dict[str, list[float]]] = [{key: [] for key, _, _ in EFFECT_METRICS} for _ in ladder]
    overran = [0] * len(ladder)
    for seed in seeds:
        records = trace(scenario, params, seed)
        end = max((r.t for r in records), default=0.0)
        for i, rung in enumerate(ladder):
            options = {"partition": tuning.partition} if rung.policy is PolicyName.STATIC_TUNED else rung.options
            result = simulate(scenario, records, create_policy(rung.policy, **options), seed=seed)
            summary = summarize(result)
            overran[i] += int(saturated(result.duration_seconds, end))
            for key, _, read in EFFECT_METRICS:
                values[i][key].append(float(read(summary)))
            if on_progress:
                on_progress(f"seed {seed} {rung.label}: hand-off P95 {values[i]['handoff_p95_seconds'][-1]:.2f} s")
    rungs = []
    for i, rung in enumerate(ladder):
        effect = None
        if i > 0:
            effect = {
                key: t_interval([a - b for a, b in zip(values[i][key], values[i - 1][key], strict=True)]).to_json()
                for key, _, _ in EFFECT_METRICS
            }
        rungs.append(
            {
                "label": rung.label,
                "policy": str(rung.policy),
                "options": rung.options,
                "metrics": {key: t_interval(values[i][key]).to_json() for key, _, _ in EFFECT_METRICS},
                "effect": effect,
                "saturated_runs": overran[i],
                "runs": values[i],
            }
        )
    return {
        "kind": "decomposition",
        "seeds": list(seeds),
        "train_seeds": list(train_seeds),
        "trace": {
            "sessions": params.sessions,
            "hours": params.hours,
            "users": params.users,
            "gap_scale": params.gap_scale,
        },
        "interval": "95 % Student t over seeds; a step's effect paired by seed",
        "static_tuned_search": tuning.to_json(),
        "rungs": rungs,
    }


def _cell(interval: dict[str, Any], signed: bool = False) -> str:
    mean = f"{interval['mean']:+.2f}" if signed else f"{interval['mean']:.2f}"
    return mean if interval.get("half_width") is None else f"{mean} ± {interval['half_width']:.2f}"


def markdown(name: str, data: dict[str, Any]) -> str:
    """The stored decomposition as a section of docs/evidence.md: per load level, each rung's figures and
    each step's paired effect."""
    labels = [label for _, label, _ in EFFECT_METRICS]
    header = ["rung", *labels, *(f"step: {label}" for label in labels), "saturated runs"]
    intro = (
        f"Scenario `{data['scenario']}`, precision {data['precision']}: from `static-tuned`, one mechanism at a "
        "time (sim/decompose.py). A step's effect is its rung minus the rung above it, paired by seed."
    )
    lines = [f"## {name}", "", intro]
    for level in data["levels"]:
        trace, seeds = level["trace"], level["seeds"]
        about = (
            f"Synthetic traces of {trace['sessions']} sessions × {trace['hours']:g} h, reported seeds "
            f"{', '.join(map(str, seeds))}; static-tuned trained on seeds "
            f"{', '.join(map(str, level['train_seeds']))} in {level['static_tuned_search']['replays']} replays; "
            f"{level['interval']}."
        )
        lines += ["", f"### {name}: {trace['sessions']} sessions, gap ×{trace['gap_scale']:g}", "", about, ""]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for rung in level["rungs"]:
            figures = [_cell(rung["metrics"][key]) for key, _, _ in EFFECT_METRICS]
            effects = [
                _cell(rung["effect"][key], signed=True) if rung["effect"] else "" for key, _, _ in EFFECT_METRICS
            ]
            cells = [rung["label"], *figures, *effects, f"{rung['saturated_runs']} / {len(seeds)}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
