"""docs/evidence.md from stored seed-study results (`statebudget study seeds --json`), without a replay.

Each stored result becomes a section: the scenario and whether precision was held equal, a load table
(each policy's hand-off P95 at each load level, saturated levels marked) when it holds several load
levels, then per level what was run (trace sizes, gap scale, seeds, training seeds, static-tuned's
search), a table of every policy's metrics (mean ± 95 % t half width over the seeds) with its saturated
runs, the hand-off P95 ratios against the best baseline where no run of either policy is saturated, and
where the hand-offs' switch latency went per policy (stored results that predate a column show a dash).
A result of a real trace (`study seeds --trace`, `windows.py`) reads the same, by window instead of by seed,
its request metrics with their bootstrap interval as `mean [low, high]`.
A stored gateway study (`statebudget study gateway --json`, `"kind": "gateway"`) becomes its own section:
per workload, each policy with and without warm-ups, paired per seed (`render_gateway`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
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
    if interval.get("method") == "bootstrap":  # a real trace's interval (windows.py): not symmetric
        return f"{interval['mean']:.{digits}f} [{interval['low']:.{digits}f}, {interval['high']:.{digits}f}]"
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
    if "source" in trace:
        return f"{trace['source']}, windows of {trace['hours']:g} h"
    rate = trace.get("handoff_rate")
    context = trace.get("context", "shared")
    return (
        f"{trace['sessions']} sessions, gap ×{trace.get('gap_scale', 1.0):g}"
        + (f", hand-offs {rate:.0%}" if rate is not None else "")
        + (", fresh sub-agent contexts" if context == "fresh" else "")
    )


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


def _paired_cell(interval: dict[str, Any], digits: int, signed: bool = True) -> str:
    if interval.get("mean") is None:
        return "—"
    sign = "+" if signed else ""
    if interval.get("half_width") is None:
        return f"{interval['mean']:{sign}.{digits}f}"
    return f"{interval['mean']:{sign}.{digits}f} ± {interval['half_width']:.{digits}f}"


def _workload_heading(name: str, data: dict[str, Any], w: dict[str, Any]) -> list[str]:
    """A gateway study's workload: its heading and what its seeds and pairings are."""
    return [
        "",
        f"### {name}: {w['description']}",
        "",
        (
            f"Seeds {', '.join(map(str, w['seeds']))}; {data['interval']}; Δ and the GPU memory-time ratio are "
            f"paired per seed against `{next(iter(data['arms']))}` on the same trace."
        ),
        "",
    ]


# a gateway study's table column: its header, and its cell from an arm's metrics and its pairing (None: the first arm)
Column = tuple[str, Callable[[dict[str, Any], dict[str, Any] | None], str]]


def _mean(key: str, digits: int) -> Callable[[dict[str, Any], dict[str, Any] | None], str]:
    return lambda metrics, _: _cell(metrics[key], digits)


def _paired(key: str, digits: int, signed: bool = True) -> Callable[[dict[str, Any], dict[str, Any] | None], str]:
    return lambda _, pair: _paired_cell(pair[key], digits, signed) if pair else "—"


def _arm_table(data: dict[str, Any], w: dict[str, Any], columns: Sequence[Column]) -> list[str]:
    """A row per policy and arm of a gateway study's workload: the columns, then the saturated runs."""
    lines = [
        "| policy | arm | " + " | ".join(header for header, _ in columns) + " | saturated runs |",
        "|" + "---|" * (len(columns) + 3),
    ]
    for policy in data["policies"]:
        for arm in data["arms"]:
            metrics, pair = w["metrics"][policy][arm], w["paired"][policy].get(arm)
            cells = " | ".join(cell(metrics, pair) for _, cell in columns)
            lines.append(f"| {policy} | {arm} | {cells} | {metrics['saturated_runs']} / {len(w['seeds'])} |")
    return lines


def render_affinity(name: str, data: dict[str, Any]) -> str:
    """A gateway study with several instances of a model (`sim/replicas.py`): each policy with its requests
    routed to the least loaded instance (`none`) and to the one holding the session's KV (`affinity`)."""
    replicas = ", ".join(f"{n} instances of `{m}`" for m, n in data["replicas"].items())
    lines = [
        f"## {name}",
        "",
        (
            f"Scenario `{data['scenario']}` with {replicas}, each a whole copy that every policy places, wakes and "
            f"evicts as any model (`sim/replicas.py`). {PRECISION[data['precision']]} The same policy replayed on "
            "the same traces with the gateway sending each request of the model to the instance with the fewest "
            "requests waiting or running (`none`, a load balancer without session state) and to the instance "
            "holding the session's KV, else the same (`affinity`). `stay`: the requests that keep their session's "
            "model; the routing columns count the requests of the replicated model, those whose session's KV an "
            "instance held, and those sent there."
        ),
    ]
    columns = [
        ("stay P95 s", _mean("stay_p95_seconds", 2)),
        ("Δ stay P95 s", _paired("stay_p95_diff_seconds", 2)),
        ("hand-off P95 s", _mean("handoff_p95_seconds", 2)),
        ("Δ hand-off P95 s", _paired("handoff_p95_diff_seconds", 2)),
        ("TTFT P95 s", _mean("ttft_p95_seconds", 2)),
        ("done P95 s", _mean("completion_p95_seconds", 1)),
        ("re-prefilled tokens", _mean("reprefill_tokens", 0)),
        ("routed", _mean("routed", 1)),
        ("with a KV holder", _mean("routed_with_kv_holder", 1)),
        ("sent to it", _mean("routed_to_kv_holder", 1)),
        ("GPU memory-time ratio", _paired("gpu_memory_time_ratio", 4, signed=False)),
    ]
    for w in data["workloads"]:
        lines += [*_workload_heading(name, data, w), *_arm_table(data, w, columns)]
    return "\n".join(lines) + "\n"


def render_gateway(name: str, data: dict[str, Any]) -> str:
    """The gateway study (`sim/gateway_study.py`): per workload, each policy with and without warm-ups."""
    if data.get("replicas"):
        return render_affinity(name, data)
    arms = data["arms"]
    lines = [
        f"## {name}",
        "",
        (
            f"Scenario `{data['scenario']}`. {PRECISION[data['precision']]} The same policy replayed on the same "
            "traces with the gateway routing only (`none`; `affinity` replays identically: one engine instance per "
            "model), and with warm-ups by the planner's directive rule (`planner/gateway_directives.py`):"
        ),
        "",
    ]
    for arm, spec in arms.items():
        if spec["gateway"] == "none":
            continue
        which = (
            "those worth more than the HBM price of their KV in the planner's objective, best first"
            if spec["target"] == "priced"
            else f"at least {spec['min_probability']:g} likely"
        )
        lines.append(
            f"- `{arm}`: warm-up target `{spec['target']}`, {which}, at most "
            f"{spec['max_warmups_per_instance']} per instance, "
            + (
                "on any card, never giving way: each takes its cards as a real prefill does (an ablation)."
                if spec["gateway"] == "affinity+eager-warmups"
                else "only on idle cards, cancelled by any real request there."
            )
        )
    columns = [
        ("hand-off P95 s", _mean("handoff_p95_seconds", 2)),
        ("Δ hand-off P95 s", _paired("handoff_p95_diff_seconds", 2)),
        ("done P95 s", _mean("completion_p95_seconds", 1)),
        ("Δ done P95 s", _paired("completion_p95_diff_seconds", 1)),
        ("GPU GiB·h", _mean("gpu_gib_hours", 1)),
        ("GPU memory-time ratio", _paired("gpu_memory_time_ratio", 4, signed=False)),
        ("warm-ups started", _mean("warmups_started", 1)),
        ("used", _mean("warmups_used", 1)),
        ("cancelled", _mean("warmups_cancelled", 1)),
    ]
    for w in data["workloads"]:
        lines += [*_workload_heading(name, data, w), *_arm_table(data, w, columns)]
        lines += [
            "",
            (
                "Where the hand-off latency goes (mean seconds per part over the hand-offs at or above each seed's "
                "P95, means over the seeds):"
            ),
            "",
            "| policy | arm | " + " | ".join(p.replace("_", " ") for p in SWITCH_PARTS) + " | sum |",
            "|" + "---|" * (len(SWITCH_PARTS) + 3),
        ]
        for policy in data["policies"]:
            for arm in arms:
                parts = w["handoff_parts"][policy][arm]
                row = [parts.get(f"tail_{p}", 0.0) for p in SWITCH_PARTS]
                lines.append(f"| {policy} | {arm} | " + " | ".join(f"{v:.2f}" for v in row) + f" | {sum(row):.2f} |")
    return "\n".join(lines) + "\n"


def render_section(name: str, data: dict[str, Any]) -> str:
    if data.get("kind") == "decomposition":
        return decompose.markdown(name, data)
    if data.get("kind") == "gateway":
        return render_gateway(name, data)
    if "levels" not in data:
        return render_level(f"## {name}", data)
    levels = data["levels"]
    lines = [f"## {name}", "", f"Scenario `{data['scenario']}`. {PRECISION[data['precision']]}"]
    if len(levels) > 1:
        lines += ["", "Hand-off P95 s by load level (mean ± 95 % half width; sat: runs saturated):", ""]
        lines += _load_table(levels)
    sections = [render_level(f"### {name}: {_level_name(level['trace'])}", level) for level in levels]
    return "\n".join([*lines, "", *sections])


def _handoffs(trace: dict[str, Any]) -> str:
    rate = trace.get("handoff_rate")
    share = f"{rate:.0%} of later turns hand off" if rate is not None else "the scenario's hand-off chain"
    fresh = trace.get("context", "shared") == "fresh"
    return share + (" to sub-agents with a fresh context" if fresh else " (the model sees the whole history)")


def _what_ran(data: dict[str, Any]) -> str:
    trace = data["trace"]
    if "source" in trace:
        train = ", ".join(map(str, data["train_seeds"])) or "none"
        return (
            f"The real trace `{trace['source']}` replayed as it is, cut into windows of {trace['hours']:g} h by "
            f"each session's first request; reported windows {', '.join(map(str, data['seeds']))} "
            f"({trace['sessions']:,} sessions), training windows {train}; {data['interval']}."
        )
    fit = trace.get("fit")
    fitted = (
        f" (gaps and tokens fitted to `{fit['source']}`: gap median {fit['gap_seconds']['median']:.1f} s, sigma "
        f"{fit['gap_seconds']['sigma']:.2f})"
        if fit
        else ""
    )
    return (
        f"Synthetic traces{fitted} of {trace['sessions']} sessions × {trace['hours']:g} h on the scenario, every "
        f"gap between turns × {trace.get('gap_scale', 1.0):g}, {_handoffs(trace)}, reported seeds "
        f"{', '.join(map(str, data['seeds']))}; {data['interval']}."
    )


def render_level(heading: str, data: dict[str, Any]) -> str:
    lines = [
        heading,
        "",
        _what_ran(data),
    ]
    search = data.get("static_tuned_search")
    if search:
        lines.append(
            f"static-tuned: trained on {'windows' if 'source' in data['trace'] else 'seeds'} "
            f"{', '.join(map(str, data['train_seeds']))}; a space of "
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


def _load(results: Sequence[Path]) -> list[tuple[str, dict[str, Any]]]:
    if not results:
        raise ValueError("results: no stored results to render")
    loaded = []
    for path in sorted(results):
        try:
            loaded.append((path.stem, json.loads(path.read_text())))
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"results: {path}: {error}") from None
    return loaded


def render(results: Sequence[Path], preamble: str = "") -> str:
    """The evidence page: the preamble, then a section per stored result (named by its file)."""
    sections = [render_section(name, data) for name, data in _load(results)]
    return "\n".join([preamble.rstrip(), "", *sections]).lstrip() + "\n"


# the README's headline: every load level of these stored results, in this order (the CI-sized
# `demo-quick` and the decomposition are left to docs/evidence.md)
HEADLINE = (
    "exceeds-hbm",
    "demo",
    "catalog-fits",
    "handoffs-shared",
    "handoffs-fresh",
    "real-azure",
    "real-mooncake",
    "real-alibaba",
)
HEADLINE_POLICIES = ("statebudget", "statebudget-groups", *BASELINES)


def headline(results: Sequence[Path]) -> str:
    """The README's headline: per stored load level, each policy's hand-off P95 with its interval, `statebudget`'s
    GPU memory-time against the best baseline's (by hand-off P95) and the saturated runs; then each policy's
    completion P95."""
    stored = dict(_load(results))
    levels = [
        (f"{name}: {_level_name(level['trace'])}", level)
        for name in HEADLINE
        if name in stored and stored[name].get("kind") != "decomposition"
        for level in stored[name].get("levels", [stored[name]])
    ]
    policies = " | ".join(HEADLINE_POLICIES)
    handoff = [
        f"| hand-off P95 s | {policies} | `statebudget`'s GPU memory-time | saturated runs |",
        "|" + "---|" * (len(HEADLINE_POLICIES) + 3),
    ]
    done = [f"| done P95 s | {policies} |", "|" + "---|" * (len(HEADLINE_POLICIES) + 1)]
    for case, level in levels:
        metrics, over, runs = level["metrics"], level["saturated_runs"], len(level["seeds"])
        baselines = [b for b in BASELINES if b in metrics]
        memory = "—"
        if "statebudget" in metrics and baselines:
            best = min(baselines, key=lambda b: metrics[b]["handoff_p95_seconds"]["mean"])
            memory = f"{metrics['statebudget']['gpu_gib_mean']['mean'] / metrics[best]['gpu_gib_mean']['mean']:.2f} × `{best}`"
        saturated = ", ".join(f"{p} {over[p]}/{runs}" for p in HEADLINE_POLICIES if over.get(p)) or "none"
        cells = [_cell(metrics[p]["handoff_p95_seconds"], 1) if p in metrics else "—" for p in HEADLINE_POLICIES]
        handoff.append(f"| {case} | " + " | ".join(cells) + f" | {memory} | {saturated} |")
        cells = [_cell(metrics[p]["completion_p95_seconds"], 0) if p in metrics else "—" for p in HEADLINE_POLICIES]
        done.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join([*handoff, "", *done]) + "\n"


README_BEGIN = "<!-- evidence-headline: generated by `make evidence` from docs/evidence/*.json -->"
README_END = "<!-- evidence-headline: end -->"


def with_headline(readme: str, table: str) -> str:
    """`readme` with the text between the headline markers replaced by `table`."""
    start, end = readme.find(README_BEGIN), readme.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"--readme: no {README_BEGIN!r} ... {README_END!r} block to fill")
    return readme[: start + len(README_BEGIN)] + "\n" + table + readme[end:]
