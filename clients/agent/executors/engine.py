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

log = logging.getLogger("statebudget.agent.engines")

_ASLEEP = (EngineState.ASLEEP_HOST, EngineState.ASLEEP_DISCARDED)


@dataclass(frozen=True, slots=True)
class Observation:
    """An engine's state as read from it now."""

    state: EngineState
    in_flight: int = 0  # requests running or waiting
    note: str = ""  # what the reading could not tell, or what is wrong


@dataclass
class EngineHandle:
    """One engine instance of this node: its configuration and what this agent learnt of it since it started."""

    model: str
    kind: EngineKind
    config: EngineConfig
    gpus: list[str]  # cluster GPU ids, the tensor-parallel group
    devices: list[int]
    process: EngineProcess | None = None
    level: int | None = None  # the level of the sleep this agent sent; None: not known (e.g. after a restart)
    last: EngineState | None = None  # the state last observed
    last_note: str = ""  # what the last reading could not tell or found wrong

    @property
    def name(self) -> str:
        return f"{self.kind.value}-{self.model}"

    @property
    def url(self) -> str:
        return self.config.url

    def has(self, feature: EngineFeature) -> bool:
        return feature in self.config.features

    def instance(self, kv_pool_bytes_per_gpu: int = 0) -> EngineInstance:
        return EngineInstance(
            kind=self.kind,
            model=self.model,
            precision=self.config.precision,
            gpus=tuple(self.gpus) or (f"{self.model}-gpu",),
            weights_bytes=self.config.weights_bytes,
            launch=LaunchSettings(kv_pool_bytes_per_gpu, features=frozenset(self.config.features)),
            management=self.config.management,
        )


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
    clock: Callable[[], float] = time.perf_counter
    drift: list[str] = field(default_factory=list)
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict, repr=False)

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
        handles = {}
        for model, engine in config.engines.items():
            gpus = list(config.engine_gpus.get(model, []))
            handle = EngineHandle(model, driver.kind, engine, gpus, [devices[g] for g in gpus if g in devices])
            if engine.launch is not None:
                values = {
                    "model": model,
                    "model_path": engine.model_path or model,
                    "kv_pool_bytes_per_gpu": 0,
                    "max_context_tokens": "",
                }
                handle.process = EngineProcess(handle.name, engine.launch, handle.devices, values)
            problems = driver.check(handle)
            if problems:
                raise ValueError(f"engines.{model}: " + "; ".join(problems))
            handles[model] = handle
        http = EngineHttp(timeout_seconds=config.engine_timeout_seconds, http_client=http_client)
        return cls(driver, handles, http, probe or default_probe(devices))

    # -- reading the engines -----------------------------------------------------

    async def observe(self, engine: EngineHandle) -> Observation:
        crash = engine.process.crashed() if engine.process is not None else None
        if crash:
            engine.process.popen = None  # type: ignore[union-attr]  # checked above: it has a process
            engine.level = None
            observation = Observation(EngineState.STOPPED, note=f"crashed: {crash}")
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
        self.drift = []
        for engine in self.engines_by_model.values():
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
        if _already(transition, observed.state):
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
        before = self._gpu_used(engine)
        calls = await self._carry_out(engine, transition, op)
        after = self._gpu_used(engine)
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
        overrides: dict[str, object] = {}
        if op.engine is not None:
            overrides["kv_pool_bytes_per_gpu"] = op.engine.instance.kv_pool_bytes_per_gpu
            overrides["max_context_tokens"] = op.engine.instance.max_context_tokens or ""
        calls = []
        if transition is Transition.RESTART:
            code = await process.stop()
            calls.append(f"stop (exit code {code})")
        seconds = await process.start(self.http.client, engine.url, **overrides)
        engine.level = 0
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

    def _gpu_used(self, engine: EngineHandle) -> int | None:
        readings = [self.probe.read(g) for g in engine.gpus]
        if not readings or any(r is None for r in readings):
            return None
        return sum(r.used_bytes for r in readings if r is not None)

    # -- reporting ---------------------------------------------------------------

    def telemetry(self) -> Telemetry:
        gpus = []
        for gpu in sorted({g for e in self.engines_by_model.values() for g in e.gpus}):
            reading = self.probe.read(gpu)
            if reading is not None:
                gpus.append(GpuUsage(gpu, reading.used_bytes, reading.free_bytes))
        engines: dict[str, ReportedEngineState] = {
            e.name: (e.last if e.last is not None else EngineStatus.UNKNOWN) for e in self.engines_by_model.values()
        }
        return Telemetry(gpus=gpus, engines=engines)

    def engines(self) -> list[dict[str, Any]]:
        return [
            {"name": e.name, "kind": self.driver.kind, "models": [e.model], "url": e.url}
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


__all__ = ["EngineExecutor", "EngineHandle", "Management", "Observation"]
