"""docs/evidence.md from stored seed-study results (`statebudget study seeds --json`), without a replay.

Each stored result becomes a section: the scenario and whether precision was held equal, a load table
(each policy's hand-off P95 at each load level, saturated levels marked) when it holds several load
levels, then per level what was run (trace sizes, gap scale, seeds, training seeds, static-tuned's
search), a table of every policy's metrics (mean ± 95 % t half width over the seeds) with its saturated
runs, the hand-off P95 ratios against the best baseline where no run of either policy is saturated, and
where the hand-offs' switch latency went per policy (stored results that predate a column show a dash).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from planner_service.sim import decompose
from planner_service.sim.seeds import METRICS
from planner_service.sim.state import SWITCH_PARTS

BASELINES = ("sleep-router", "swap-ttl", "static-tuned")
GOAL = "hand-off P95 ≤ 0.6 × the best baseline at ≤ 1.2 × its GPU memory-time, without a worse completion P95"


def _cell(interval: dict[str, Any] | None, digits: int) -> str:
    if interval is None:
        return "—"
    if interval.get("half_width") is None:
        return f"{interval['mean']:.{digits}f}"
    return f"{interval['mean']:.{digits}f} ± {interval['half_width']:.{digits}f}"


def _headline(data: dict[str, Any]) -> list[str]:
    metrics, overran = data["metrics"], data["saturated_runs"]
    baselines = [b for b in BASELINES if b in metrics]
    if "statebudget" not in metrics or not baselines:
        return []
    best = min(baselines, key=lambda b: metrics[b]["handoff_p95_seconds"]["mean"])
    lines = [f"Best baseline by mean hand-off P95: `{best}`. The goal: {GOAL}."]
    if overran["statebudget"] or overran[best]:
        lines.append(
            f"No ratio is quoted: saturated runs (simulated time > 1.05 × the trace): statebudget "
            f"{overran['statebudget']} / {len(data['seeds'])}, {best} {overran[best]} / {len(data['seeds'])}."
        )
        return lines
    sb, bb = metrics["statebudget"], metrics[best]
    ratio = sb["handoff_p95_seconds"]["mean"] / bb["handoff_p95_seconds"]["mean"]
    memory = sb["gpu_gib_mean"]["mean"] / bb["gpu_gib_mean"]["mean"]
    reached = (
        ratio <= 0.6 and memory <= 1.2 and sb["completion_p95_seconds"]["mean"] <= bb["completion_p95_seconds"]["mean"]
    )
    lines.append(
        f"statebudget / {best}: hand-off P95 {ratio:.2f}, GPU memory-time {memory:.2f}: goal "
        f"{'reached' if reached else 'not reached'} (ratios of means)."
    )
    return lines


def _parts_table(data: dict[str, Any]) -> list[str]:
    """Per policy, where its hand-offs' switch latency went: each part's mean seconds over the hand-offs at or
    above each seed's P95 (what sets the P95), then over all hand-offs, averaged over the seeds."""
    parts = data.get("handoff_switch_parts")
    if not parts:
        return []
    label = {p: p.replace("_", " ") for p in SWITCH_PARTS}
    lines = [
        (
            "Where the hand-off latency goes: mean seconds per part (state.SWITCH_PARTS: placement waits for an "
            "engine to be placed, cold start / wake for it to start / wake, queue for KV room on an engine that "
            "is up; then KV restore, the group's prefill queue, re-prefill of uncovered history) over the "
            "hand-offs at or above each seed's hand-off P95, and over all hand-offs; means over the seeds."
        ),
        "",
        "| policy | hand-offs | " + " | ".join(label[p] for p in SWITCH_PARTS) + " | sum |",
        "|" + "---|" * (len(SWITCH_PARTS) + 3),
    ]
    for policy in data["policies"]:
        for which, name in (("tail", "≥ P95"), ("mean", "all")):
            row = parts[policy][which]
            lines.append(
                f"| {policy} | {name} | "
                + " | ".join(f"{row[p]:.2f}" for p in SWITCH_PARTS)
                + f" | {sum(row[p] for p in SWITCH_PARTS):.2f} |"
            )
    return [*lines, ""]


PRECISION = {
    "native": "Precision held equal: every model served only at its preferred precision, by every policy.",
    "allowed": "Precision not held equal: each policy may serve any precision a model allows; the degraded share "
    "(requests served below the preferred one) is reported beside each figure.",
}


def _level_name(trace: dict[str, Any]) -> str:
    return f"{trace['sessions']} sessions, gap ×{trace.get('gap_scale', 1.0):g}"


def _load_table(levels: list[dict[str, Any]]) -> list[str]:
    """Hand-off P95 (mean ± half width) of each policy at each load level; (sat k/n) where runs saturated."""
    policies = levels[0]["policies"]
    lines = ["| load level | " + " | ".join(policies) + " |", "|" + "---|" * (len(policies) + 1)]
    for level in levels:
        cells = []
        for policy in policies:
            cell = _cell(level["metrics"][policy]["handoff_p95_seconds"], 2)
            over = level["saturated_runs"][policy]
            cells.append(cell + (f" (sat {over}/{len(level['seeds'])})" if over else ""))
        lines.append(f"| {_level_name(level['trace'])} | " + " | ".join(cells) + " |")
    return lines


def render_section(name: str, data: dict[str, Any]) -> str:
    if data.get("kind") == "decomposition":
        return decompose.markdown(name, data)
    if "levels" not in data:
        return render_level(f"## {name}", data)
    levels = data["levels"]
    lines = [f"## {name}", "", f"Scenario `{data['scenario']}`. {PRECISION[data['precision']]}"]
    if len(levels) > 1:
        lines += ["", "Hand-off P95 s by load level (mean ± 95 % half width; sat: runs saturated):", ""]
        lines += _load_table(levels)
    sections = [render_level(f"### {name}: {_level_name(level['trace'])}", level) for level in levels]
    return "\n".join([*lines, "", *sections])


def render_level(heading: str, data: dict[str, Any]) -> str:
    trace = data["trace"]
    lines = [
        heading,
        "",
        (
            f"Synthetic traces of {trace['sessions']} sessions × {trace['hours']:g} h on the scenario, every gap "
            f"between turns × {trace.get('gap_scale', 1.0):g}, reported seeds {', '.join(map(str, data['seeds']))}; "
            f"{data['interval']}."
        ),
    ]
    search = data.get("static_tuned_search")
    if search:
        lines.append(
            f"static-tuned: trained on seeds {', '.join(map(str, data['train_seeds']))}; a space of "
            f"{search['space_size']:,} partitions, {search['candidates_scored']} scored in {search['replays']} "
            f"replays, {search['pruned']} pruned by memory fit, {search.get('failed', 0)} infeasible, "
            f"{'exhaustive' if search['exhaustive'] else 'sampled'}."
        )
    columns = ["policy", *(label for _, label, _ in METRICS), "saturated runs"]
    lines += ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for policy in data["policies"]:
        cells = [_cell(data["metrics"][policy].get(key), 3 if key == "degraded_share" else 2) for key, _, _ in METRICS]
        lines.append(
            f"| {policy} | " + " | ".join(cells) + f" | {data['saturated_runs'][policy]} / {len(data['seeds'])} |"
        )
    lines += ["", *_headline(data), "", *_parts_table(data)]
    return "\n".join(lines)


def render(results: Sequence[Path], preamble: str = "") -> str:
    """The evidence page: the preamble, then a section per stored result (named by its file)."""
    if not results:
        raise ValueError("results: no stored results to render")
    sections = []
    for path in sorted(results):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"results: {path}: {error}") from None
        sections.append(render_section(path.stem, data))
    return "\n".join([preamble.rstrip(), "", *sections]).lstrip() + "\n"
