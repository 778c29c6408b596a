"""The executor of vLLM and SGLang nodes: one engine instance per model, each operation one engine
transition of the whole instance (never one call per shard), carried out by the kind's driver.

Before each operation the executor reads the engine's real state (`reconcile`): what the engine says, not
what this agent remembers, decides; what differs from the operation's expected state is reported as drift.
A transition whose end state the engine is in already is done without a call, so an operation applied
twice (a re-lease after the agent's restart) changes nothing. The preconditions are the engine model's
(`planner_service.domain.engines.may`): a missing one is a permanent refusal that says what is missing.

Bytes are measured on the device (NVML) over the instance's GPUs before and after: what the transition
really freed or took, not what it promised.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from clients.agent import readahead
from clients.agent.config import AgentConfig, EngineConfig
from clients.agent.errors import PermanentError, TemporaryError
from clients.agent.executors.base import GpuUsage, Telemetry
from clients.agent.executors.engine_http import EngineHttp
from clients.agent.executors.engine_steps import step_for
from clients.agent.lifecycle import EngineProcess
from clients.agent.operations import Capability, Operation, Outcome
from clients.agent.probes import GpuProbe, default_probe
from planner_service.domain.engines import (
    AFTER,
    EngineFeature,
    EngineInstance,
    EngineKind,
    EngineState,
    LaunchSettings,
    Management,
    Transition,
    may,
)
from planner_service.wire.enums import EngineStatus, ReportedEngineState
from planner_service.wire.operations import EngineInstanceRef

log = logging.getLogger("statebudget.agent.engines")

_ASLEEP = (EngineState.ASLEEP_HOST, EngineState.ASLEEP_DISCARDED)
FAILED_STARTS_KEPT = 64  # failed starts remembered (one per step), so that a long-running agent's memory is bounded


@dataclass(frozen=True, slots=True)
class Observation:
    """An engine's state as read from it now."""

    state: EngineState
    in_flight: int = 0  # requests running or waiting
    note: str = ""  # what the reading could not tell, or what is wrong


# LMCache reads its configuration from `LMCACHE_<FIELD>` environment variables (lmcache/v1/config.py,
# `_from_env`: the prefix and the field's name upper-cased); `lmcache_instance_id` names the instance.
LMCACHE_INSTANCE_ENV = "LMCACHE_LMCACHE_INSTANCE_ID"


@dataclass
class EngineHandle:
    """One engine instance of this node: its configuration and what this agent learnt of it since it started."""

    model: str
    kind: EngineKind
    config: EngineConfig
    gpus: list[str]  # cluster GPU ids of the tensor-parallel group: configured, or the one it was launched on
    devices: list[int]
    node: str = ""
    process: EngineProcess | None = None
    level: int | None = None  # the level of the sleep this agent sent; None: not known (e.g. after a restart)
    last: EngineState | None = None  # the state last observed
    last_note: str = ""  # what the last reading could not tell or found wrong
    launched: dict[str, Any] = field(default_factory=dict)  # the launch settings it runs with, where known

    @property
    def name(self) -> str:
        return f"{self.kind.value}-{self.model}"

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def lmcache_instance_id(self) -> str | None:
        """One LMCache instance per engine: the configured id, else `<node>-<model>`."""
        if not self.has(EngineFeature.LMCACHE):
            return None
        return self.config.lmcache_instance_id or f"{self.node}-{self.model}"

    def has(self, feature: EngineFeature) -> bool:
        return feature in self.config.features

    @property
    def precision(self) -> str:
        return str(self.launched.get("precision") or self.config.precision)

    def instance(self, kv_pool_bytes_per_gpu: int = 0) -> EngineInstance:
        return EngineInstance(
            kind=self.kind,
            model=self.model,
            precision=self.precision,
            gpus=tuple(self.gpus) or (f"{self.model}-gpu",),
            weights_bytes=self.config.weights_bytes,
            launch=LaunchSettings(kv_pool_bytes_per_gpu, features=frozenset(self.config.features)),
            management=self.config.management,
        )

    def instance_ref(self) -> dict[str, Any] | None:
        """The instance as a heartbeat's `instances[].instance` names it (planner_service.wire
        EngineInstanceRef); None while no group is known (configured, or launched by this agent)."""
        if not self.gpus:
            return None
        ref: dict[str, Any] = {
            "id": EngineInstanceRef.instance_id(self.model, self.precision, self.gpus),
            "node": self.node,
            "kind": self.kind.value,
            "model": self.model,
            "precision": self.precision,
            "gpus": list(self.gpus),
            "kv_pool_bytes_per_gpu": int(self.launched.get("kv_pool_bytes_per_gpu") or 0),
            "gpu_expert_fraction": float(self.launched.get("gpu_expert_fraction", 1.0)),
            "features": sorted(f.value for f in self.config.features),
            "management": self.config.management.value,
        }
        if self.launched.get("max_context_tokens"):
            ref["max_context_tokens"] = int(self.launched["max_context_tokens"])
        return ref


class EngineDriver(Protocol):
    """The calls of one engine kind."""

    kind: EngineKind

    async def observe(self, http: EngineHttp, engine: EngineHandle) -> Observation: ...

    async def sleep(self, http: EngineHttp, engine: EngineHandle, level: int) -> list[str]: ...

    async def wake(self, http: EngineHttp, engine: EngineHandle, *, reload: bool) -> list[str]: ...

    async def drain(self, http: EngineHttp, engine: EngineHandle) -> list[str]: ...

    def check(self, engine: EngineHandle) -> list[str]: ...


@dataclass
class EngineExecutor:
    driver: EngineDriver
    engines_by_model: dict[str, EngineHandle]
    http: EngineHttp
    probe: GpuProbe
    capabilities: frozenset[Capability] = frozenset()  # none of the planner's partial moves
    node: str = ""
    devices: dict[str, int] = field(default_factory=dict)  # cluster GPU id -> device index, every GPU of the node
    clock: Callable[[], float] = time.perf_counter
    drift: list[str] = field(default_factory=list)
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict, repr=False)
    # the starts and restarts that failed permanently, by step (`_step_id`): the operation and why. The other
    # moves of the step (one per GPU of the group) fail with it instead of starting the engine again.
    _failed_starts: dict[str, tuple[str, str]] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls,
        driver: EngineDriver,
        config: AgentConfig,
        *,
        http_client: httpx.AsyncClient | None = None,
        probe: GpuProbe | None = None,
    ) -> EngineExecutor:
        devices = config.gpu_devices()
        by_device = {d: g for g, d in devices.items()}
        handles = {}
        for model, engine in config.engines.items():
            gpus = list(config.engine_gpus.get(model, []))
            handle = EngineHandle(
                model, driver.kind, engine, gpus, [devices[g] for g in gpus if g in devices], node=config.node_id
            )
            if engine.launch is not None:
                values = {
                    "model": model,
                    "model_path": engine.model_path or model,
                    "precision": engine.precision,
                    "tp": max(len(gpus), 1),
                    "kv_pool_bytes_per_gpu": 0,
                    "kv_pool_tokens": 0,
                    "gpu_expert_fraction": 1.0,
                    "max_context_tokens": "",
                    "lmcache_instance_id": handle.lmcache_instance_id or "",
                }
                env = {LMCACHE_INSTANCE_ENV: handle.lmcache_instance_id} if handle.lmcache_instance_id else {}
                handle.process = EngineProcess(
                    handle.name, engine.launch, handle.devices, values, env=env, state_dir=config.engine_state_dir
                )
                # an engine an earlier run of the agent started: running, or (crashed) the group it was on,
                # so that the heartbeat reports it stopped there and the service corrects its state
                launched = handle.process.recover() or handle.process.last_launch()
                if launched is not None:
                    handle.launched = dict(launched.values)
                    if not gpus:
                        handle.devices = list(launched.devices)
                        handle.gpus = [by_device[d] for d in launched.devices if d in by_device]
            problems = driver.check(handle)
            if problems:
                raise ValueError(f"engines.{model}: " + "; ".join(problems))
            handles[model] = handle
        http = EngineHttp(timeout_seconds=config.engine_timeout_seconds, http_client=http_client)
        return cls(driver, handles, http, probe or default_probe(devices), node=config.node_id, devices=devices)

    # -- reading the engines -----------------------------------------------------

    async def observe(self, engine: EngineHandle) -> Observation:
        crash = engine.process.crashed() if engine.process is not None else None
        if crash:
            engine.process.forget()  # type: ignore[union-attr]  # checked above: it has a process
            engine.level = None
            observation = Observation(EngineState.STOPPED, note=f"crashed: {crash}")
        elif engine.process is not None and not engine.process.running:
            observation = Observation(EngineState.STOPPED)  # managed and not started: nothing to ask
        else:
            try:
                observation = await self.driver.observe(self.http, engine)
            except TemporaryError as error:
                observation = Observation(EngineState.STOPPED, note=f"unreachable: {error.reason}")
        if engine.last is not None and observation.state is not engine.last:
            self._drifted(engine, f"was {engine.last.value}, is {observation.state.value}", observation)
        elif observation.note and observation.note != engine.last_note:  # said once, not at every heartbeat
            self._drifted(engine, observation.note, observation)
        engine.last, engine.last_note = observation.state, observation.note
        return observation

    def _drifted(self, engine: EngineHandle, what: str, observation: Observation) -> None:
        line = f"{engine.name}: {what}" + (
            f" ({observation.note})" if observation.note and observation.note not in what else ""
        )
        self.drift.append(line)
        log.warning("engine drift: %s", line)

    async def reconcile(self) -> list[str]:
        """Read every engine no operation is changing now (one that is, mid-start or mid-sleep, would read as
        what it is leaving; the operation reads it before and sets what it left it in)."""
        self.drift = []
        for engine in self.engines_by_model.values():
            lock = self._locks.setdefault(engine.name, asyncio.Lock())
            if lock.locked():
                continue
            async with lock:
                await self.observe(engine)
        return list(self.drift)

    # -- one operation -----------------------------------------------------------

    def _engine_for(self, op: Operation) -> EngineHandle:
        model = op.engine.instance.model if op.engine is not None else op.object.model
        engine = self.engines_by_model.get(model)
        if engine is None:
            raise PermanentError(
                f"no {self.driver.kind.value} engine configured for model {model!r}; engines: {sorted(self.engines_by_model)}"
            )
        return engine

    async def execute(self, op: Operation) -> Outcome:
        """Carry out `op` on its engine. Operations of one engine run one at a time: the plan gives each
        GPU shard of an instance its own operation carrying the same step, and the first one makes the one
        call for the whole instance while the others, once it is done, find the engine there already."""
        engine = self._engine_for(op)
        async with self._locks.setdefault(engine.name, asyncio.Lock()):
            return await self._execute(engine, op)

    async def _execute(self, engine: EngineHandle, op: Operation) -> Outcome:
        started = self.clock()
        observed = await self.observe(engine)
        details: dict[str, Any] = {"engine": engine.name, "observed": observed.state.value}
        if op.engine is not None and op.engine.from_state is not observed.state:
            details["drift"] = f"expected {op.engine.from_state.value}, found {observed.state.value}"
        step = step_for(op, observed.state, lmcache=engine.has(EngineFeature.LMCACHE))
        transition = step.transition
        if transition is Transition.WAKE and observed.state is EngineState.STOPPED and engine.process is not None:
            transition = Transition.START  # crashed or stopped meanwhile: a cold start brings the weights back
        elif transition is Transition.RESTART and observed.state is EngineState.STOPPED and engine.process is not None:
            transition = Transition.START  # stopped already (crashed, or the stop was done): the start is left
        elif transition is Transition.START and observed.state in _ASLEEP:
            transition = Transition.WAKE  # asleep, not stopped (e.g. a sleep the plan did not see): waking is enough
        elif (
            transition is Transition.START
            and observed.state is EngineState.RUNNING
            and op.engine is not None
            and engine.launched
            and not _runs_as(engine, op)
        ):  # running, but launched otherwise (GPUs, precision, pool, expert share): the step's instance is a relaunch
            transition = Transition.RESTART
        if (
            op.engine is None
            and self.driver.kind is EngineKind.SGLANG
            and transition in (Transition.SLEEP_LEVEL_1, Transition.SLEEP_LEVEL_2)
        ):  # SGLang's one release: the launch flag decides whether the weights stay in host RAM
            transition = Transition.SLEEP_LEVEL_1 if engine.has(EngineFeature.CPU_BACKUP) else Transition.SLEEP_LEVEL_2
        if transition is None:
            return Outcome(max(self.clock() - started, 0.0), None, {**details, "nothing_to_do": step.why})
        if transition is Transition.READAHEAD:
            return await self._readahead(engine, started, details)
        if observed.note.startswith("unreachable") and transition is not Transition.START:
            raise TemporaryError(f"{engine.name} {observed.note}")
        if _already(transition, observed.state) or (
            transition is Transition.RESTART and observed.state is EngineState.RUNNING and _runs_as(engine, op)
        ):
            details["nothing_to_do"] = f"{engine.name} is {observed.state.value} already"
            return Outcome(max(self.clock() - started, 0.0), None, details)
        kv_pool = op.engine.instance.kv_pool_bytes_per_gpu if op.engine is not None else 0
        in_flight = observed.in_flight
        if transition in (Transition.STOP, Transition.RESTART) or (
            self.driver.kind is EngineKind.SGLANG and transition in (Transition.SLEEP_LEVEL_1, Transition.SLEEP_LEVEL_2)
        ):
            details["calls"] = await self.driver.drain(self.http, engine)
            in_flight = 0
        verdict = may(engine.instance(kv_pool), observed.state, transition, in_flight_requests=in_flight)
        if not verdict.allowed:
            raise PermanentError(f"{engine.name}: {transition.value} refused: {verdict.why}")
        measured_gpus = sorted({*engine.gpus, *(op.engine.instance.gpus if op.engine is not None else ())})
        start = _step_id(op, transition)
        failed = self._failed_starts.get(start) if start is not None else None
        if failed is not None:  # a cold start costs minutes on a GPU: one that failed is not tried once per GPU
            raise PermanentError(
                f"{engine.name}: {transition.value} failed for {failed[0]} of the same step: {failed[1]}"
            )
        before = self._gpu_used(measured_gpus)
        try:
            calls = await self._carry_out(engine, transition, op)
        except PermanentError as error:
            if start is not None:
                self._failed_starts[start] = (op.id, error.reason)
                if len(self._failed_starts) > FAILED_STARTS_KEPT:  # the oldest plans' are done with
                    del self._failed_starts[next(iter(self._failed_starts))]
            raise
        after = self._gpu_used(measured_gpus)
        engine.last = AFTER.get(transition, observed.state)
        details["calls"] = details.get("calls", []) + calls
        details["state"] = engine.last.value
        measured = None
        if before is not None and after is not None:
            measured = abs(before - after)
            details.update({"gpu_used_bytes_before": before, "gpu_used_bytes_after": after})
            frees = transition in (Transition.SLEEP_LEVEL_1, Transition.SLEEP_LEVEL_2, Transition.STOP)
            details["freed_bytes" if frees else "taken_bytes"] = measured
            if frees and measured < op.bytes:
                details["shortfall_bytes"] = op.bytes - measured
        return Outcome(max(self.clock() - started, 0.0), measured, details)

    async def _carry_out(self, engine: EngineHandle, transition: Transition, op: Operation) -> list[str]:
        if transition is Transition.SLEEP_LEVEL_1:
            return await self.driver.sleep(self.http, engine, 1)
        if transition is Transition.SLEEP_LEVEL_2:
            return await self.driver.sleep(self.http, engine, 2)
        if transition is Transition.WAKE:
            reload = engine.level != 1  # after a level-2 sleep, or a sleep this agent did not see
            calls = await self.driver.wake(self.http, engine, reload=reload)
            engine.level = 0
            return calls
        process = engine.process
        if process is None:
            raise PermanentError(f"{engine.name}: {transition.value} needs `launch` in the engine's configuration")
        if transition is Transition.STOP:
            code = await process.stop()
            engine.level = None
            return [f"stop (exit code {code})"]
        overrides = _launch_values(op)
        group = list(op.engine.instance.gpus) if op.engine is not None else engine.gpus
        devices = [self.devices[g] for g in group if g in self.devices] if group != engine.gpus else engine.devices
        calls = []
        if transition is Transition.RESTART:
            code = await process.stop()
            calls.append(f"stop (exit code {code})")
        seconds = await process.start(self.http.client, engine.url, devices=devices, **overrides)
        engine.gpus, engine.devices, engine.level = group, devices, 0
        engine.launched = dict(process.launched.values) if process.launched is not None else dict(overrides)
        calls.append(f"start ({seconds:.1f} s to ready)")
        return calls

    async def _readahead(self, engine: EngineHandle, started: float, details: dict[str, Any]) -> Outcome:
        path = engine.config.model_path
        if path is None:
            raise PermanentError(f"{engine.name}: read-ahead needs the checkpoint's `model_path`")
        try:
            advised = readahead.advise_willneed(Path(path))
            resident = readahead.residency(Path(path))
        except OSError as error:
            raise PermanentError(f"{engine.name}: read-ahead of {path} failed: {error}") from error
        details.update(
            {
                "advised_bytes": advised,
                "page_cache_bytes": resident.resident_bytes,
                "page_cache_fraction": round(resident.fraction, 4),
            }
        )
        return Outcome(max(self.clock() - started, 0.0), resident.resident_bytes, details)

    def _gpu_used(self, gpus: list[str]) -> int | None:
        readings = [self.probe.read(g) for g in gpus]
        if not readings or any(r is None for r in readings):
            return None
        return sum(r.used_bytes for r in readings if r is not None)

    # -- reporting ---------------------------------------------------------------

    def telemetry(self) -> Telemetry:
        # a managed engine runs in its own session: its workers' process group is the engine's pid
        groups = {
            e.process.launched.pid: e.name
            for e in self.engines_by_model.values()
            if e.process is not None and e.process.launched is not None
        }
        gpus = []
        for gpu in sorted(self.devices or {g for e in self.engines_by_model.values() for g in e.gpus}):
            reading = self.probe.read(gpu)
            if reading is not None:
                processes = tuple(
                    (pid, n, groups.get(_process_group(pid))) for pid, n in sorted(reading.processes.items())
                )
                gpus.append(GpuUsage(gpu, reading.used_bytes, reading.free_bytes, reading.total_bytes, processes))
        engines: dict[str, ReportedEngineState] = {
            e.name: (e.last if e.last is not None else EngineStatus.UNKNOWN) for e in self.engines_by_model.values()
        }
        instances = []
        for e in self.engines_by_model.values():
            ref = e.instance_ref()
            if ref is not None and e.last is not None:
                instances.append({"instance": ref, "state": e.last.value})
        return Telemetry(gpus=gpus, engines=engines, instances=instances)

    def engines(self) -> list[dict[str, Any]]:
        return [
            {
                "name": e.name,
                "kind": self.driver.kind,
                "models": [e.model],
                "url": e.url,
                "features": sorted(f.value for f in e.config.features),
                "management": e.config.management.value,
            }
            for _, e in sorted(self.engines_by_model.items())
        ]

    async def aclose(self) -> None:
        await self.http.aclose()


def _already(transition: Transition, state: EngineState) -> bool:
    """Whether the engine is where the transition would take it (done before, e.g. by an earlier lease)."""
    if transition in (Transition.SLEEP_LEVEL_1, Transition.SLEEP_LEVEL_2):
        return state in _ASLEEP  # the weights are off the GPU already
    if transition in (Transition.WAKE, Transition.START):
        return state is EngineState.RUNNING
    if transition is Transition.STOP:
        return state is EngineState.STOPPED
    return False


def _step_id(op: Operation, transition: Transition) -> str | None:
    """The start or restart `op` is one move of: its plan epoch (the prefix of its id), instance and
    transition; None for any other transition, or a move that names no step."""
    if op.engine is None or transition not in (Transition.START, Transition.RESTART):
        return None
    epoch = op.id.split(".", 1)[0] if "." in op.id else ""
    return f"{epoch}|{op.engine.instance.id}|{transition.value}"


def _process_group(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except OSError:  # gone, or not ours to see
        return -1


def _launch_values(op: Operation) -> dict[str, object]:
    """The launch settings a start or restart fills the command template with: the operation's instance."""
    if op.engine is None:
        return {}
    instance = op.engine.instance
    return {
        "precision": instance.precision,
        "tp": len(instance.gpus),
        "kv_pool_bytes_per_gpu": instance.kv_pool_bytes_per_gpu,
        "kv_pool_tokens": instance.kv_pool_tokens,
        "gpu_expert_fraction": instance.gpu_expert_fraction,
        "max_context_tokens": instance.max_context_tokens or "",
    }


def _runs_as(engine: EngineHandle, op: Operation) -> bool:
    """Whether the engine runs with the launch settings of `op`'s instance already (a restart done before)."""
    wanted = _launch_values(op)
    return (
        bool(wanted)
        and op.engine is not None
        and list(op.engine.instance.gpus) == engine.gpus
        and all(engine.launched.get(k) == v for k, v in wanted.items())
    )


__all__ = ["EngineExecutor", "EngineHandle", "Management", "Observation"]
