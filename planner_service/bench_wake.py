"""The control-path benchmark behind `statebudget bench wake` (figures, not a test).

What StateBudget adds to an engine's own wake when a request arrives for a model that runs nowhere: the
gateway's event reaches the planner, the planner replans (after its debounce), installs the plan, the node
agent's long-poll hands it the operation, the agent reports it done, and the gateway's long-poll on the route
table sees the model running. The engine's own time (the wake or cold start itself) is left out by
construction: the agent here reports each operation done as soon as it has it, so everything measured is
the control path. The budget (issue: the gateway) is p95 <= 300 ms.

Set-up: `statebudget serve --scenario` as a real subprocess on a fresh database (`bench_load.serve`), on a
scenario made here: one node with one RTX 3090 and two 7-8B models on vLLM engines with sleep mode, so the
card holds one model at a time and a request for the other makes the planner put one to sleep and wake (or,
the first time, start) the other. One node agent (an asyncio task on the SDK's async client, as
`clients/agent` leases: a long-poll on its queue) and the gateway's own route follower
(`clients/gateway/follower.py`, long-polling `GET /v1/routes` in process) run beside it.

A trial ends the last session's turn and posts a `request` event of a new session for the other model, then
times, from just before that POST:

- `event`: the planner acknowledged the event;
- `lease`: the agent's long-poll handed it the operation that runs the requested model;
- `report`: the agent's `done` report of it was acknowledged (the agent runs the operations of one lease and
  reports them in order, so this is the last one's, the sleep of the other model included);
- `routed`: the route table the gateway follows shows the model running: what the gateway waits for before
  it sends the held request. This is the control path.

The gateway batches its events for up to `event_flush_seconds` (50 ms by default,
`clients/gateway/settings.py`) before the POST; that wait is configured, not measured, and is added to the
control path's figures as `routed_with_flush`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

from prometheus_client import CollectorRegistry

from clients.gateway.follower import RouteFollower
from clients.gateway.metrics import GatewayMetrics
from clients.gateway.settings import GatewaySettings
from clients.sdk import AsyncStateBudgetClient, StateBudgetError
from clients.sdk import events as sdk_events
from planner_service.bench_load import LoadConfig, percentiles_ms, serve
from planner_service.domain.problem import resolve_model
from planner_service.domain.scenario import ModelIn
from planner_service.domain.units import GIB
from planner_service.wire.enums import ReportStatus, Slo, Transition
from planner_service.wire.operations import LeasedOperation

NODE = "n1"
GPU = "n1-g0"
# two models of which the card holds one at a time (weights ~15-16 GB each on a 24 GB RTX 3090)
MODELS = {"a": "llama-3.1-8b-instruct", "b": "qwen2.5-7b-instruct"}
ENGINE_FEATURES = ["sleep_mode", "dev_mode"]
PHASES = ("event", "lease", "report", "routed")
RUNS = (Transition.START, Transition.WAKE, Transition.RESTART)  # the transitions that make a model run


@dataclass(frozen=True)
class WakeConfig:
    trials: int = 40
    trial_timeout_seconds: float = 30.0  # a trial whose model does not run by then is counted as timed out
    pause_seconds: float = 0.5  # between trials: the last plan's operations settle
    lease_wait_seconds: float = 20.0  # the agent's long-poll (clients/agent's default)
    routes_wait_seconds: float = GatewaySettings.model_fields["routes_wait_seconds"].default
    replan_debounce_seconds: float | None = None  # the server's `replan_debounce_seconds`; None: its default
    server_log_level: str = "warning"


@dataclass
class Trial:
    model: str
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds from the event's POST
    timed_out: bool = False


def pingpong_scenario() -> dict[str, Any]:
    """One node, one RTX 3090, two 7-8B models on vLLM with sleep mode, their checkpoints on the node's NVMe."""
    residency = []
    for i, (model_id, preset) in enumerate(MODELS.items()):
        spec = resolve_model(ModelIn.model_validate(_model(model_id, preset)), f"models[{i}]")
        for precision in spec.precisions:
            residency.append(
                {
                    "object": {"kind": "weights", "model": model_id, "precision": precision},
                    "location": {"tier": "nvme", "node": NODE},
                    "bytes": spec.weights_bytes[precision],
                }
            )
    node = {
        "id": NODE,
        "host_dram_bytes": 256 * GIB,
        "nvme_bytes": 4000 * GIB,
        "gpus": [{"id": GPU, "type": "rtx-3090", "reserved_bytes": 2 * GIB}],
        "engines": [{"model": m, "kind": "vllm", "features": ENGINE_FEATURES} for m in MODELS],
    }
    return {
        "cluster": {"nodes": [node]},
        "models": [_model(m, p) for m, p in MODELS.items()],
        "sessions": [],
        "residency": residency,
    }


def _model(model_id: str, preset: str) -> dict[str, Any]:
    return {"id": model_id, "preset": preset, "precisions": ["bf16"]}  # one precision: no room for both at int4


def run(config: WakeConfig) -> dict[str, Any]:
    """Run the trials against a fresh server: the figures as one JSON-able dict."""
    with tempfile.TemporaryDirectory(prefix="statebudget-wake-") as tmp:
        scenario = Path(tmp) / "pingpong.json"
        scenario.write_text(json.dumps(pingpong_scenario()))
        load = LoadConfig(scenario=scenario, server_log_level=config.server_log_level)
        debounce = config.replan_debounce_seconds
        settings = {} if debounce is None else {"STATEBUDGET_REPLAN_DEBOUNCE_SECONDS": str(debounce)}
        with mock.patch.dict(os.environ, settings), serve(load, Path(tmp), [NODE]) as server:
            trials = asyncio.run(_drive(config, server.base_url, server.operator_token, server.node_tokens[NODE]))
    flush = GatewaySettings.model_fields["event_flush_seconds"].default
    done = [t for t in trials if not t.timed_out]
    figures: dict[str, Any] = {p: percentiles_ms([t.seconds[p] for t in done if p in t.seconds]) for p in PHASES}
    figures["routed_with_flush"] = percentiles_ms([t.seconds["routed"] + flush for t in done])
    return {
        "config": asdict(config),
        "trials": len(trials),
        "timed_out": sum(t.timed_out for t in trials),
        "gateway_event_flush_seconds": flush,
        "phases_ms": figures,
        "budget_ms": {"routed_with_flush_p95": 300.0},
        "per_trial_ms": [
            {"model": t.model, **{p: round(s * 1000, 1) for p, s in t.seconds.items()}, "timed_out": t.timed_out}
            for t in trials
        ],
    }


async def _drive(config: WakeConfig, base_url: str, operator_token: str, node_token: str) -> list[Trial]:
    async with (
        AsyncStateBudgetClient(base_url, token=operator_token) as router,
        AsyncStateBudgetClient(base_url, token=node_token) as node,
    ):
        await node.register_node(
            NODE,
            engines=[
                {"name": f"vllm-{m}", "kind": "vllm", "models": [m], "url": f"http://127.0.0.1:{9000 + i}/v1"}
                for i, m in enumerate(MODELS)
            ],
        )
        follower = RouteFollower(
            router, GatewayMetrics(CollectorRegistry()), wait_seconds=config.routes_wait_seconds, retry_seconds=0.2
        )
        leased: dict[str, float] = {}  # model -> when the agent was handed the operation that runs it
        reported: dict[str, float] = {}
        tasks = [asyncio.create_task(follower.run()), asyncio.create_task(_agent(node, config, leased, reported))]
        try:
            trials = [await _trial(i, router, follower, leased, reported, config) for i in range(config.trials)]
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        return trials


async def _trial(
    i: int,
    router: AsyncStateBudgetClient,
    follower: RouteFollower,
    leased: dict[str, float],
    reported: dict[str, float],
    config: WakeConfig,
) -> Trial:
    model = list(MODELS)[i % len(MODELS)]
    trial = Trial(model)
    if i > 0:  # the last session's answer is back: its model is idle now
        await router.post_events(sdk_events.turn_end(f"t{i - 1}-end", session=f"s{i - 1}", output_tokens=64))
        await asyncio.sleep(config.pause_seconds)
    leased.pop(model, None)
    reported.pop(model, None)
    start = time.perf_counter()
    await router.post_events(
        sdk_events.request(f"t{i}-req", session=f"s{i}", model=model, input_tokens=512, slo=Slo.INTERACTIVE)
    )
    trial.seconds["event"] = time.perf_counter() - start
    deadline = start + config.trial_timeout_seconds
    while not follower.table.running(model):
        left = deadline - time.perf_counter()
        if left <= 0:
            trial.timed_out = True
            return trial
        await follower.wait_for_change(left)
    trial.seconds["routed"] = time.perf_counter() - start
    for phase, seen in (("lease", leased), ("report", reported)):
        if model in seen:
            trial.seconds[phase] = seen[model] - start
    return trial


async def _agent(
    node: AsyncStateBudgetClient, config: WakeConfig, leased: dict[str, float], reported: dict[str, float]
) -> None:
    """Lease with a long-poll and report every operation done at once: an engine call of zero seconds."""
    while True:
        lease = await node.lease(NODE, max_operations=8, wait_seconds=config.lease_wait_seconds)
        if lease.lease_id is None:
            continue  # the long-poll ran out with nothing to do
        now = time.perf_counter()
        runs = [_runs(op) for op in lease.operations]
        for model in filter(None, runs):
            leased.setdefault(model, now)
        for op, runs_model in zip(lease.operations, runs, strict=True):
            with contextlib.suppress(StateBudgetError):
                await node.report(op.id, lease_id=lease.lease_id, status=ReportStatus.DONE, measured_seconds=0.001)
            if runs_model is not None:
                reported.setdefault(runs_model, time.perf_counter())


def _runs(op: LeasedOperation) -> str | None:
    """The model an operation makes run on a GPU (a wake, a start or a restart), else None."""
    step = op.engine
    if step is None or step.transition not in RUNS:
        return None
    return step.instance.model
