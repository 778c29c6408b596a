"""The node agent's loop: register, heartbeat, long-poll leases, run operations, report.

Operations run in parallel (at most `max_parallel`), each as soon as its
`depends_on` are done. The service leases only operations whose dependencies it
has confirmed, so a dependency this agent does not hold is done already; one it
holds (leased together, or still running) is awaited, and if it fails the
dependent operation is reported `failed` without running.

While any operation of a lease runs, the agent renews the lease every third
of `lease_seconds` (the registration answer says how long a lease lasts), so a
move that takes longer than a lease keeps it. A renewal the service refuses
(409: the lease ran out and its operations were re-queued or superseded) means
they were handed on: the agent logs it once, starts none of them that has not
started, and reports none of them under that lease; one already running runs
to its end (a move cut short is worse than one done twice).

A request the SDK refuses before sending it (pydantic's `ValidationError`: a body the API's models do not
admit) is a permanent failure of that call, logged with its fields and never retried: a bad registration or
lease ends the agent (each would be the same again), a bad heartbeat is skipped (the next one is built from
new telemetry), a bad report is not delivered (its lease expires and the service re-queues the operation).

Executors raise `TemporaryError` (retried with backoff while the lease lasts)
or `PermanentError` (reported `failed` at once). Stopping (`stop` set, e.g. by
SIGTERM) ends leasing, lets running operations finish and report within
`shutdown_grace_seconds`, and abandons the rest: their leases expire and the
service re-queues them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import stamina
from pydantic import ValidationError

from clients.agent.config import AgentConfig, ExecutorName
from clients.agent.errors import ExecutionError, PermanentError, TemporaryError, invalid_fields
from clients.agent.executors.base import Executor, Reconciling, Seedable
from clients.agent.operations import LeasedOperation, Operation, Outcome, Tier
from clients.sdk import (
    APIError,
    AsyncStateBudgetClient,
    AuthenticationError,
    ConflictError,
    PermissionDeniedError,
    ServerError,
)
from clients.sdk import ConnectionError as SdkConnectionError
from planner_service.wire.enums import ReportStatus
from planner_service.wire.nodes import GpuTelemetryIn
from planner_service.wire.operations import LeaseOut

log = logging.getLogger("statebudget.agent")

AGENT_VERSION = "0.1.0"
CALIBRATION_ALPHA = 0.3  # weight of the newest measurement in the moving average
RENEW_FRACTION = 1 / 3  # renew a running lease every third of its length: two renewals may fail before it ends
DEFAULT_LEASE_SECONDS = 30.0  # the service's default, for an answer that does not say


@dataclass(eq=False)
class HeldLease:
    """A lease this agent runs operations under, renewed while any of them runs."""

    id: str
    deadline: float  # monotonic seconds at which the service lets it run out, as last told
    running: set[str]  # its operations not finished here yet
    handed_on: bool = False  # a renewal was refused: its operations are another lease's now
    renewer: asyncio.Task[None] | None = None

    def finished(self, op_id: str) -> None:
        """One operation is over; with the last one, renewing stops."""
        self.running.discard(op_id)
        if not self.running and self.renewer is not None:
            self.renewer.cancel()


@dataclass
class BandwidthMeter:
    """Measured rates per link (exponential moving averages) for the heartbeat.

    A rate is sent once per new measurement: the service also calibrates from each
    report's measured seconds and bytes, and a rate repeated in every heartbeat would
    pull its calibration again and again with the same sample.
    """

    gpu: dict[str, dict[str, float]] = field(default_factory=dict)  # gpu -> {h2d_bytes_per_s, d2h_bytes_per_s}
    node: dict[str, float] = field(default_factory=dict)  # nvme_read_bytes_per_s, nvme_write_bytes_per_s
    _fresh: set[tuple[str | None, str]] = field(default_factory=set)  # (gpu or None for the node, field)

    def _mix(self, gpu: str | None, key: str, rate: float) -> None:
        table = self.node if gpu is None else self.gpu.setdefault(gpu, {})
        old = table.get(key)
        table[key] = rate if old is None else (1 - CALIBRATION_ALPHA) * old + CALIBRATION_ALPHA * rate
        self._fresh.add((gpu, key))

    def observe(self, op: Operation, outcome: Outcome) -> None:
        src, dst = op.source, op.dest
        if src is None or dst is None or not outcome.measured_bytes or outcome.measured_seconds <= 0:
            return
        rate = outcome.measured_bytes / outcome.measured_seconds
        if src.tier is Tier.NVME:
            self._mix(None, "nvme_read_bytes_per_s", rate)
        elif src.tier is Tier.HOST and dst.tier is Tier.GPU:
            self._mix(dst.id, "h2d_bytes_per_s", rate)
        elif dst.tier is Tier.NVME:
            self._mix(None, "nvme_write_bytes_per_s", rate)
        elif src.tier is Tier.GPU and dst.tier is Tier.HOST:
            self._mix(src.id, "d2h_bytes_per_s", rate)

    def take_fresh(self) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
        """The rates measured since the last call: (per GPU, per node)."""
        gpus: dict[str, dict[str, float]] = {}
        node: dict[str, float] = {}
        for gpu, key in self._fresh:
            if gpu is None:
                node[key] = self.node[key]
            else:
                gpus.setdefault(gpu, {})[key] = self.gpu[gpu][key]
        self._fresh.clear()
        return gpus, node


class Agent:
    def __init__(
        self,
        config: AgentConfig,
        client: AsyncStateBudgetClient,
        executor: Executor,
        *,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config, self.client, self.executor = config, client, executor
        self._sleep, self._monotonic = sleep, monotonic
        self.gpu_ids: set[str] = {g.id for g in config.gpus}
        self.lease_seconds: float | None = None  # how long a lease lasts, from the registration answer
        self.meter = BandwidthMeter()
        self.stats: Counter[str] = Counter()
        self.reports: list[dict[str, Any]] = []  # what this agent reported, newest last
        self._results: dict[str, asyncio.Future[bool]] = {}  # op id -> done?, for ops this agent holds
        self._failed: set[str] = set()  # ops this agent reported failed (or could not run)
        self._inflight: set[asyncio.Task[bool]] = set()
        self._renewers: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(config.max_parallel)

    # -- lifecycle ---------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        node = self.config.node_id
        if not await self._register(stop):
            return
        await self._seed()
        await self._reconcile()
        heartbeats = asyncio.create_task(self._heartbeats(stop), name=f"heartbeat-{node}")
        try:
            while not stop.is_set():
                free = self.config.max_parallel - len(self._inflight)
                if free <= 0:
                    await self._wait_any(stop)
                    continue
                lease = await self._lease(stop, free)
                if lease:
                    self._start(lease)
        finally:
            await self._drain()
            heartbeats.cancel()
            renewers = set(self._renewers)  # none is left once every operation ended; this is for safety
            for renewer in renewers:
                renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeats
            if renewers:
                await asyncio.wait(renewers)
            log.info("agent %s stopped: %s", node, dict(self.stats))

    async def _wait_any(self, stop: asyncio.Event) -> None:
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({*self._inflight, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()

    async def _drain(self) -> None:
        if not self._inflight:
            return
        log.info(
            "waiting up to %.0f s for %d running operation(s)", self.config.shutdown_grace_seconds, len(self._inflight)
        )
        _, pending = await asyncio.wait(set(self._inflight), timeout=self.config.shutdown_grace_seconds)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
            log.warning("%d operation(s) abandoned; their leases expire and the service re-queues them", len(pending))

    async def _backoff(self, stop: asyncio.Event, attempt: int) -> None:
        delay = min(self.config.retry_delay_seconds * 2 ** min(attempt, 6), 30.0)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=delay)

    # -- registration and telemetry ----------------------------------------------

    @property
    def scale(self) -> float:
        """Bytes materialized per planned byte: the local executor's `scale`; the engine executors move real
        bytes (1). Registered, so that the service does not calibrate from a scaled test run."""
        return self.config.scale if self.config.executor is ExecutorName.LOCAL else 1.0

    async def _register(self, stop: asyncio.Event) -> bool:
        cfg = self.config
        capabilities = list(cfg.capabilities if cfg.capabilities is not None else self.executor.capabilities)
        gpus = [g.model_dump(exclude={"device"}, exclude_none=True) for g in cfg.gpus]
        engines = [_with_gpus(engine, cfg.engine_gpus) for engine in self.executor.engines()]
        attempt = 0
        while not stop.is_set():
            try:
                out = await self.client.register_node(
                    cfg.node_id,
                    capabilities=sorted(capabilities),
                    gpus=gpus or None,
                    host_dram_bytes=cfg.host_dram_bytes,
                    nvme_bytes=cfg.nvme_bytes,
                    engines=engines,
                    agent_version=AGENT_VERSION,
                    scale=self.scale,
                )
            except ValidationError as error:
                log.error("register: the registration is invalid, not sent: %s", invalid_fields(error))
                raise
            except (SdkConnectionError, ServerError) as error:
                log.warning("register failed (%s); retrying", error)
                await self._backoff(stop, attempt)
                attempt += 1
                continue
            self.gpu_ids |= set(out.gpus)
            self.lease_seconds = out.lease_seconds
            for warning in out.warnings:
                log.warning("register: %s", warning)
            granted = [c.value for c in out.capabilities]
            log.info("registered node %s: capabilities %s, GPUs %s", cfg.node_id, granted, out.gpus)
            return True
        return False

    async def _seed(self) -> None:
        if not self.config.seed_from_srv or not isinstance(self.executor, Seedable):
            return
        try:
            srv = await self.client.get_srv()
        except (PermissionDeniedError, AuthenticationError):
            log.info("this token cannot read /v1/srv: existing state is materialized when first used")
            return
        count = await asyncio.to_thread(self.executor.seed, srv.placement, self.config.node_id, set(self.gpu_ids))
        log.info("materialized %d state object(s) of the confirmed placement (srv version %s)", count, srv.version)

    async def _reconcile(self) -> None:
        """Read the engines' real state (an executor that has engines); what changed is logged as drift."""
        if isinstance(self.executor, Reconciling):
            try:
                drift = await self.executor.reconcile()
            except ExecutionError as error:  # an engine that answers oddly must not stop the agent's loop
                log.warning("reading the engines failed: %s", error.reason)
                return
            self.stats["drift"] += len(drift)

    def heartbeat_body(self) -> dict[str, Any]:
        telemetry = self.executor.telemetry()
        gpus: dict[str, dict[str, Any]] = {}
        for usage in telemetry.gpus:
            if usage.id in self.gpu_ids:
                gpus[usage.id] = {"id": usage.id, "used_bytes": usage.used_bytes, "free_bytes": usage.free_bytes}
                if usage.total_bytes is not None:
                    gpus[usage.id]["total_bytes"] = usage.total_bytes
                if usage.processes:
                    gpus[usage.id]["processes"] = [
                        {"pid": pid, "used_bytes": nbytes, "engine": engine} for pid, nbytes, engine in usage.processes
                    ]
        gpu_rates, node_rates = self.meter.take_fresh()
        for gpu_id, rates in gpu_rates.items():
            if gpu_id in self.gpu_ids:
                gpus.setdefault(gpu_id, {"id": gpu_id}).update(rates)
        instances = [i for i in telemetry.instances if set(i["instance"]["gpus"]) <= self.gpu_ids]
        body = {"gpus": [g for g in gpus.values() if self._valid_gpu(g)], "engines": telemetry.engines, **node_rates}
        return {**body, "instances": instances} if instances else body

    @staticmethod
    def _valid_gpu(entry: dict[str, Any]) -> bool:
        """Whether the service would take this GPU's telemetry: one GPU's bad reading (a driver's count caught
        mid-change, a rate measured over too few bytes) leaves that GPU out, not the whole heartbeat."""
        try:
            GpuTelemetryIn.model_validate(entry)
        except ValidationError as error:
            log.warning("heartbeat leaves out gpu %s: %s", entry["id"], invalid_fields(error, whole="gpu"))
            return False
        return True

    async def _heartbeats(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self._reconcile()
            try:
                await self.client.heartbeat(self.config.node_id, **self.heartbeat_body())
                self.stats["heartbeats"] += 1
            except ValidationError as error:
                log.error("heartbeat invalid, not sent: %s", invalid_fields(error))
                self.stats["heartbeats_invalid"] += 1
            except APIError as error:
                log.warning("heartbeat refused: %s", error)
            except SdkConnectionError as error:
                log.warning("heartbeat failed: %s", error)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.config.heartbeat_seconds)

    # -- leases ------------------------------------------------------------------

    async def _lease(self, stop: asyncio.Event, max_operations: int) -> LeaseOut | None:
        """One long-poll, abandoned if `stop` is set first (operations it leased then expire and re-queue)."""
        cfg = self.config
        try:
            request = self.client.lease(
                cfg.node_id, max_operations=min(max_operations, cfg.max_operations), wait_seconds=cfg.lease_wait_seconds
            )
        except ValidationError as error:
            log.error("lease: the request is invalid, not sent: %s", invalid_fields(error))
            raise
        poll = asyncio.create_task(request)
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({poll, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if not poll.done():
            poll.cancel()
            with contextlib.suppress(asyncio.CancelledError, APIError, SdkConnectionError):
                await poll
            return None
        try:
            lease: LeaseOut = poll.result()
        except (SdkConnectionError, ServerError) as error:
            log.warning("lease failed (%s); retrying", error)
            self.stats["lease_errors"] += 1
            await self._backoff(stop, min(self.stats["lease_errors"], 5))
            return None
        self.stats["lease_errors"] = 0
        return lease if lease.operations else None

    def _start(self, lease: LeaseOut) -> None:
        lease_id = lease.lease_id
        assert lease_id is not None  # a lease with operations has an id
        ops: list[LeasedOperation] = lease.operations
        lasts = lease.expires_in_seconds or self.lease_seconds or DEFAULT_LEASE_SECONDS
        held = HeldLease(lease_id, self._monotonic() + lasts, {op.id for op in ops})
        loop = asyncio.get_running_loop()
        for op in ops:  # every op of the lease is known before any starts, so order within the lease holds
            self._results[op.id] = loop.create_future()
        for op in ops:
            task = asyncio.create_task(self._run(op, held), name=f"op-{op.id}")
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
        every = (self.lease_seconds or lasts) * RENEW_FRACTION
        held.renewer = asyncio.create_task(self._renew(held, every), name=f"renew-{lease_id}")
        self._renewers.add(held.renewer)
        held.renewer.add_done_callback(self._renewers.discard)

    async def _renew(self, held: HeldLease, every_seconds: float) -> None:
        """Renew `held` every `every_seconds` while its operations run; a refusal ends it (handed on)."""
        node = self.config.node_id
        while held.running:
            await self._sleep(every_seconds)
            if not held.running:
                return
            try:
                out = await self.client.renew_lease(node, held.id)
            except ConflictError as conflict:
                if not held.running:  # its last operation was reported meanwhile
                    return
                held.handed_on = True
                self.stats["leases_handed_on"] += 1
                log.warning(
                    "lease %s of node %s was handed on, the service refused to renew it: %s; "
                    "%d operation(s) still here (%s) will not be reported under it",
                    held.id,
                    node,
                    conflict.detail,
                    len(held.running),
                    ", ".join(sorted(held.running)),
                )
                return
            except (SdkConnectionError, ServerError) as error:
                self.stats["renew_errors"] += 1
                log.warning("renewing lease %s failed (%s); trying again in %.1f s", held.id, error, every_seconds)
                continue
            except APIError as error:  # 401, 403, 404: asking again cannot help; the report will tell
                log.error("renewing lease %s was refused (%s); it is no longer renewed", held.id, error)
                return
            held.deadline = self._monotonic() + out.expires_in_seconds
            self.stats["renewals"] += 1

    # -- one operation -----------------------------------------------------------

    async def _run(self, op: Operation, held: HeldLease) -> bool:
        ok = False
        result = self._results.get(op.id)
        try:
            ok = await self._run_once_ready(op, held)
            return ok
        finally:
            held.finished(op.id)
            if not ok and not held.handed_on:  # a handed-on operation may yet succeed under its new lease
                self._failed.add(op.id)
            if result is not None:
                if self._results.get(op.id) is result:
                    del self._results[op.id]
                if not result.done():
                    result.set_result(ok)

    async def _run_once_ready(self, op: Operation, held: HeldLease) -> bool:
        for dep in op.depends_on:
            pending = self._results.get(dep)
            if dep in self._failed or (pending is not None and not await asyncio.shield(pending)):
                return await self._report(op, held, None, f"dependency {dep} failed on this node")
        async with self._slots:
            if held.handed_on:  # another lease holds it now: it is not started here
                return await self._report(op, held, None, "not started")
            log.info("running %s", op.label())
            for attempt in range(1, self.config.temporary_attempts + 1):
                try:
                    outcome = await self.executor.execute(op)
                except TemporaryError as error:
                    delay = (
                        error.delay_seconds
                        if error.delay_seconds is not None
                        else (self.config.retry_delay_seconds * 2 ** (attempt - 1))
                    )
                    last = attempt == self.config.temporary_attempts or self._monotonic() + delay >= held.deadline
                    log.warning("%s: temporary error (attempt %d): %s", op.id, attempt, error.reason)
                    if last:
                        reason = f"temporary error, gave up after {attempt} attempt(s): {error.reason}"
                        return await self._report(op, held, None, reason)
                    await self._sleep(delay)
                    if held.handed_on:  # another lease holds it now: it is not tried again here
                        return await self._report(op, held, None, f"temporary error: {error.reason}")
                except PermanentError as error:
                    return await self._report(op, held, None, error.reason)
                except Exception as error:
                    log.exception("%s: unexpected error", op.id)
                    return await self._report(op, held, None, f"unexpected error: {type(error).__name__}: {error}")
                else:
                    if outcome.details.get("shortfall_bytes"):
                        log.warning(
                            "%s: the device freed %s bytes fewer than promised",
                            op.id,
                            outcome.details["shortfall_bytes"],
                        )
                    self.meter.observe(op, outcome)
                    return await self._report(op, held, outcome, None)
        return False  # pragma: no cover - the loop always returns

    async def _report(self, op: Operation, held: HeldLease, outcome: Outcome | None, error: str | None) -> bool:
        held.finished(op.id)  # before the report goes: a renewal after it would find nothing left to hold
        if held.handed_on:  # said once, when the renewal was refused
            log.debug("%s: not reported (%s), its lease %s was handed on", op.id, error or "done", held.id)
            self.stats["not_reported"] += 1
            return False
        status = ReportStatus.DONE if outcome is not None else ReportStatus.FAILED
        body: dict[str, Any] = {"lease_id": held.id, "status": status.value, "error": error}
        if outcome is not None:
            body["measured_seconds"] = round(outcome.measured_seconds, 6)
            body["measured_bytes"] = outcome.measured_bytes
        try:
            # the agent's one retry layer for reports (its SDK client makes each call once): a report lost
            # would re-queue a move that was done
            async for attempt in stamina.retry_context(
                on=(SdkConnectionError, ServerError),
                attempts=self.config.temporary_attempts,
                wait_initial=self.config.retry_delay_seconds,
                timeout=self.config.timeout_seconds * self.config.temporary_attempts,
            ):
                with attempt:
                    await self.client.report(op.id, **body)
        except ValidationError as invalid:
            log.error(
                "%s: the report is invalid, not sent: %s; the lease will expire and re-queue it",
                op.id,
                invalid_fields(invalid),
            )
            self.stats["unreported"] += 1
            return False
        except ConflictError as conflict:
            log.warning("%s: the service refused the report: %s", op.id, conflict.detail)
            self.stats["conflicts"] += 1
            return False
        except (APIError, SdkConnectionError) as failure:
            log.error("%s: report not delivered (%s); the lease will expire and re-queue it", op.id, failure)
            self.stats["unreported"] += 1
            return False
        self.stats[status.value] += 1
        self.reports.append({"op": op.id, **body})
        if error:
            log.warning("%s failed: %s", op.label(), error)
        return outcome is not None


def _with_gpus(engine: dict[str, Any], engine_gpus: dict[str, list[str]]) -> dict[str, Any]:
    """An engine as registered, with the GPUs it was launched on where the configuration names them."""
    gpus = sorted({g for model in engine.get("models", []) for g in engine_gpus.get(model, [])})
    return {**engine, "gpus": gpus} if gpus else engine
