"""Operation queues and leases: plans installed as epochs of operations, leased to nodes, renewed, reported.

A lease holds its operations until `lease_seconds` after it was granted or
last renewed (a Kubernetes lease's renew time, an SQS visibility timeout): an
agent still running them renews it, and a lease left to run out gives its
operations back (re-queued, or superseded when a newer plan epoch exists).
A renewal that comes too late is refused and says why: the operations were
handed on, so the agent must not report them as its own any more.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import uuid
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable
from typing import Any

from planner_service.domain.state import Kind, Location, StateObject
from planner_service.planner.operations import PRIORITY_RANK, Action, Operation
from planner_service.planner.plan import Plan
from planner_service.service.confirmed import Confirmed
from planner_service.service.errors import (
    Conflict,
    Forbidden,
    NotFound,
    ServiceError,
)
from planner_service.service.inputs import (
    ReportIn,
)
from planner_service.service.live import (
    PRUNE_EVERY_SECONDS,
    Live,
    iso,
)
from planner_service.service.published import InstalledPlan
from planner_service.service.records import OpRecord, OpState
from planner_service.service.state_lock import Urgency
from planner_service.service.store import Batch

log = logging.getLogger(__name__)

ENDED_LEASES_KEPT = 10_000  # leases whose end is remembered, newest first, to tell a late renewal why


@dataclasses.dataclass(frozen=True, slots=True)
class EndedLease:
    """How a lease that ran out ended, for the renewal that arrives after it."""

    node: str
    why: str  # completes "lease <id> no longer holds any operation: ..."


def _ids(records: Iterable[OpRecord]) -> str:
    return ", ".join(r.id for r in records)


MoveKey = tuple[Action, StateObject, Location | None, Location | None, int, bool, str, str | None]


def same_move(op: Operation) -> MoveKey:
    """What makes two operations the same move to a node agent: ids, dependencies, priority and reason aside.
    On an engine node the engine call is part of it: a start with another expert share or KV pool is another
    call, and a record kept with the old one would have the agent make the call the new plan no longer makes."""
    engine = None if op.engine is None else op.engine.model_dump_json()
    return (op.action, op.object, op.source, op.dest, op.bytes, op.keep_source, op.node, engine)


def in_order(operations: list[Operation]) -> bool:
    """Every operation comes after those it depends on (the planner's topological order)."""
    seen: set[str] = set()
    for op in operations:
        if not seen.issuperset(op.depends_on):
            return False
        seen.add(op.id)
    return True


def must_wait(op: Operation, r: OpRecord, capped: Collection[str] = ()) -> bool:
    """A new operation must not race `r`, still in flight: it would fill what `r` frees, read what `r`
    writes, free the source `r` reads, fill where `r` was planned as landing only what fits (`capped`,
    `landing.py`: the plan counted that room as full), or put a session's KV on an engine `r` brings up
    there (the engine computes it: `operations.py`'s order within a plan)."""
    frees_dest = op.dest is not None and (r.op.frees() == op.dest or (r.id in capped and r.op.dest == op.dest))
    reads_its_output = op.source is not None and r.op.dest == op.source and r.op.object == op.object
    drops_its_source = (
        op.frees() is not None and r.op.keep_source and r.op.source == op.frees() and r.op.object == op.object
    )
    return frees_dest or reads_its_output or drops_its_source or _kv_on_its_engine(op, r.op)


def _kv_on_its_engine(op: Operation, up: Operation) -> bool:
    """Whether `op` puts a session's KV where `up` brings its model's engine up."""
    return (
        op.object.kind is Kind.KV
        and op.dest is not None
        and _brings_up(up)
        and up.dest == op.dest
        and up.object.model == op.object.model
    )


def _brings_up(op: Operation) -> bool:
    """Whether `op` moves weights onto a GPU with an engine step (a start, wake or restart)."""
    return (
        op.engine is not None and op.object.kind is Kind.WEIGHTS and op.dest is not None and op.action is Action.PROMOTE
    )


class Races:
    """The operations in flight, indexed by what a new operation could race them on (`must_wait`): finding
    those one operation must wait for is a few look-ups instead of a scan of everything in flight, which an
    install of several hundred operations over a hundred in flight would make tens of thousands of times."""

    def __init__(self, inflight: list[OpRecord], capped: Collection[str] = ()) -> None:
        self._order = {r.id: i for i, r in enumerate(inflight)}
        self._freeing: dict[Location, list[OpRecord]] = defaultdict(list)  # what each frees, or fills capped
        self._writing: dict[tuple[StateObject, Location], list[OpRecord]] = defaultdict(list)  # (object, dest)
        self._reading_kept: dict[tuple[StateObject, Location], list[OpRecord]] = defaultdict(list)  # (object, source)
        self._bringing_up: dict[tuple[str, Location], list[OpRecord]] = defaultdict(list)  # (model, GPU)
        for r in inflight:
            if (freed := r.op.frees()) is not None:
                self._freeing[freed].append(r)
            if r.op.dest is not None:
                if r.id in capped:
                    self._freeing[r.op.dest].append(r)
                self._writing[(r.op.object, r.op.dest)].append(r)
            if r.op.keep_source and r.op.source is not None:
                self._reading_kept[(r.op.object, r.op.source)].append(r)
            if _brings_up(r.op):
                assert r.op.dest is not None  # (`_brings_up`)
                self._bringing_up[(r.op.object.model, r.op.dest)].append(r)

    def of(self, op: Operation) -> set[str]:
        """The ids of the operations in flight `op` must wait for: those `must_wait(op, r, capped)` holds for."""
        found: set[str] = set()
        if op.dest is not None:
            found.update(r.id for r in self._freeing.get(op.dest, ()))
        if op.source is not None:
            found.update(r.id for r in self._writing.get((op.object, op.source), ()))
        if (freed := op.frees()) is not None:
            found.update(r.id for r in self._reading_kept.get((op.object, freed), ()))
        if op.object.kind is Kind.KV and op.dest is not None:
            found.update(r.id for r in self._bringing_up.get((op.object.model, op.dest), ()))
        return found

    def ordered(self, ids: Iterable[str]) -> list[str]:
        """`ids` in the order of the operations in flight (their plans' order)."""
        return sorted(ids, key=self._order.__getitem__)


def _step_key(op: Operation) -> tuple[str, str, str] | None:
    """The engine step `op` is one move of (node, instance, transition), or None."""
    return None if op.engine is None else (op.node, op.engine.instance.id, op.engine.transition.value)


def _with_step_siblings(queued: list[OpRecord], done: Callable[[str], bool], max_operations: int) -> list[OpRecord]:
    """The first `max_operations` of the `queued` operations whose dependencies are `done` (in order), and every
    other queued move of an engine step one of them is a move of, once each of its dependencies is done or in
    the lease (the agent runs a lease's moves in their order: a move waits there on those it depends on).

    A step is one engine call, made on the first of its moves the agent runs (a start with the instance's
    expert share, say, loads the experts its expert moves name); a move of it left queued could be superseded
    by the next plan while the call it shares has been made, and the confirmed state would never learn what the
    engine holds. Leased together, the moves are reported together. The lease may hold more than
    `max_operations` then."""
    chosen = [r for r in queued if all(done(d) for d in r.op.depends_on)][:max_operations]
    steps = {key for r in chosen if (key := _step_key(r.op)) is not None}
    if not steps:
        return chosen
    held = {r.id for r in chosen}
    siblings = [r for r in queued if r.id not in held and _step_key(r.op) in steps]
    added = True
    while added:  # a move may wait on another move of its step: take them in dependency order
        added = False
        for r in siblings:
            if r.id not in held and all(d in held or done(d) for d in r.op.depends_on):
                held.add(r.id)
                chosen.append(r)
                added = True
    return chosen


def _step_waits(ops: list[Operation], races: Races) -> dict[tuple[str, str, str] | None, set[str]]:
    """Per engine step, the operations in flight any of its moves must wait on: the step is one call for the
    whole instance, made on the first of its moves an agent runs, so every move waits on them (as every move
    of a step waits on what any of them waits on within the plan, planner/operations.py)."""
    waits: dict[tuple[str, str, str] | None, set[str]] = defaultdict(set)
    for op in ops:
        key = _step_key(op)
        if key is not None:
            waits[key].update(races.of(op))
    return waits


def plan_document(plan: Plan) -> dict[str, Any]:
    """The plan as the store and `GET /v1/plan` keep it, less its operations (the install names them)."""
    return dataclasses.replace(plan, operations=[]).to_json()


class Queues:
    """Operation queues and leases: plans installed as epochs of operations, leased to nodes, renewed,
    reported."""

    def __init__(self, live: Live, confirmed: Confirmed) -> None:
        self.live = live
        self.confirmed = confirmed
        # only to explain a refused renewal: whether a lease holds anything is read from the operations alone
        self.ended: dict[str, EndedLease] = {}

    def install(
        self, plan: Plan, inflight: list[OpRecord], capped: Collection[str] = (), document: dict[str, Any] | None = None
    ) -> frozenset[str]:
        """Install `plan` as the next epoch, incrementally; the nodes whose queues it changed. Its operations
        wait for those in `inflight` they would race (`must_wait`; `capped`: those planned as landing less).
        `document`: `plan_document(plan)`, when the caller made it before taking the state lock.

        An operation of the plan that is the same move as one still queued (`same_move`: action, object,
        source, destination, bytes and node) with the same dependencies once they are named as installed
        keeps that queued record: the new epoch adopts it (its epoch, position and, when the requests it
        serves changed, its priority and reason change in place).
        Only the rest of the old queue is superseded and only the new operations are inserted; one batch writes
        it all, the adopted and superseded rows as updates of those fields alone."""
        now = self.live.clock()
        epoch = self.live.epoch + 1
        held = self.live.failed_moves.hold_back(plan.operations, now)
        queued: dict[MoveKey, list[OpRecord]] = defaultdict(list)
        for oid in sorted(self.live.open_ops):
            r = self.live.ops[oid]
            if r.state is OpState.QUEUED:
                queued[same_move(r.op)].append(r)
        if not in_order(plan.operations):  # a record may be adopted only once its dependencies are named
            queued.clear()
        name = {op.id: f"{epoch}.{op.id}" for op in plan.operations}  # plan id -> installed id
        races = Races(inflight, capped)
        step_waits = _step_waits(plan.operations, races)
        adopted: set[str] = set()
        records: list[OpRecord] = []
        batch = Batch()
        for seq, op in enumerate(plan.operations):
            if op.id in held:
                continue
            waits = races.ordered(step_waits.get(_step_key(op), set()) | races.of(op))
            deps = [name[d] for d in op.depends_on] + waits
            waits_on = self._waits_on(deps)
            same = next((r for r in queued.get(same_move(op), ()) if self._waits_on(r.op.depends_on) == waits_on), None)
            if same is not None:
                queued[same_move(op)].remove(same)
                name[op.id] = same.id
                same.epoch, same.seq = epoch, seq
                adopted.add(same.id)
                batch.operation_updates[same.id] = {"epoch": epoch, "seq": seq}
                if same.op.priority is not op.priority:  # the request it serves came or went: what it buys too
                    same.op.priority, same.op.why = op.priority, op.reason
                    batch.operation_updates[same.id] |= {"priority": op.priority.value, "reason": op.reason}
                records.append(same)
                continue
            new = OpRecord(
                dataclasses.replace(op, id=name[op.id], depends_on=deps), epoch, seq, OpState.QUEUED, now, now
            )
            self.live.ops[new.id] = new
            self.live.open_ops.add(new.id)
            batch.operations[new.id] = new.to_json()
            records.append(new)
        superseded = 0
        touched = {r.node for r in records if r.id not in adopted}
        for oid in sorted(self.live.open_ops):  # what is still queued from earlier epochs and was not adopted
            r = self.live.ops[oid]
            if r.state is OpState.QUEUED and r.epoch < epoch:
                touched.add(r.node)
                r.state, r.superseded_by, r.updated_at = OpState.SUPERSEDED, epoch, now
                self.live.open_ops.discard(oid)
                batch.operation_updates[oid] = {"state": r.state.value, "superseded_by": epoch, "updated_at": now}
                superseded += 1
        doc = dict(document) if document is not None else plan_document(plan)
        doc["operations"] = [r.op.to_json() for r in records]
        doc["held_back"] = [
            {
                "operation": dataclasses.replace(
                    op, id=name[op.id], depends_on=[name[d] for d in op.depends_on]
                ).to_json(),
                "until": iso(held[op.id].until),
                "failures": held[op.id].count,
                "error": held[op.id].error,
            }
            for op in plan.operations
            if op.id in held
        ]
        self.live.held_until = min((f.until for f in held.values()), default=None)
        doc["epoch"] = epoch
        doc["planned_at"] = iso(now)
        doc["based_on_srv_version"] = self.live.srv_version
        installed = InstalledPlan.model_validate(doc)
        batch.meta.update({"epoch": epoch, "plan": installed.to_json()})
        self.live.write(batch)
        self.live.epoch, self.live.plan, self.live.plan_placement = epoch, installed, dict(plan.placement)
        log.info(
            "plan epoch %d: %s, %d operations (%d kept from the queue, %d new, %d superseded), %d unserved",
            epoch,
            installed.status.value,
            len(records),
            len(adopted),
            len(records) - len(adopted),
            superseded,
            len(plan.unserved),
        )
        return frozenset(touched)

    def _waits_on(self, deps: list[str]) -> frozenset[str]:
        """The dependencies that still hold an operation back (a dependency done, or not recorded, does not)."""
        return frozenset(d for d in deps if d in self.live.ops and self.live.ops[d].state is not OpState.DONE)

    def expire(self, batch: Batch) -> frozenset[str]:
        """Give back the operations of every lease past its deadline; the nodes whose queues that changed.

        Leases are looked at only once the earliest deadline granted has passed (`Live.next_lease_expiry`), so the
        leases and reports between deadlines do not scan the open operations."""
        now = self.live.clock()
        if now < self.live.next_lease_expiry:
            return frozenset()
        expired: dict[str, list[OpRecord]] = {}  # lease id -> its operations that it gave back
        next_expiry = math.inf
        for oid in list(self.live.open_ops):
            r = self.live.ops[oid]
            if r.state is not OpState.LEASED or r.lease_expires_at is None:
                continue
            if r.lease_expires_at > now:
                next_expiry = min(next_expiry, r.lease_expires_at)
                continue
            expired.setdefault(r.lease_id or "", []).append(r)
            if r.epoch < self.live.epoch:
                r.state, r.superseded_by = OpState.SUPERSEDED, self.live.epoch
                self.live.open_ops.discard(oid)
                self.live.wake(force=True)
            else:
                r.state = OpState.QUEUED
            r.updated_at = now
        self.live.next_lease_expiry = next_expiry
        for lease_id, ops in expired.items():
            self._remember_end(lease_id, ops)
            for r in ops:
                r.lease_id, r.lease_expires_at = None, None
                batch.operations[r.id] = r.to_json()
            self.live.metrics.lease_expiries.labels(ops[0].node).inc()
        if expired:
            log.info("%d lease(s) expired; their operations were re-queued", len(expired))
        return frozenset(ops[0].node for ops in expired.values())

    def _remember_end(self, lease_id: str, ops: list[OpRecord]) -> None:
        at = iso(ops[0].lease_expires_at)
        superseded = [r for r in ops if r.state is OpState.SUPERSEDED]
        requeued = [r for r in ops if r.state is OpState.QUEUED]
        parts = []
        if requeued:
            parts.append(f"{_ids(requeued)} re-queued")
        if superseded:
            parts.append(f"{_ids(superseded)} superseded by plan epoch {self.live.epoch}")
        self.ended.pop(lease_id, None)
        self.ended[lease_id] = EndedLease(ops[0].node, f"it expired at {at} ({'; '.join(parts)})")
        while len(self.ended) > ENDED_LEASES_KEPT:
            del self.ended[next(iter(self.ended))]

    def expire_and_write(self) -> frozenset[str]:
        batch = Batch()
        expired = self.expire(batch)
        self.live.write(batch)
        return expired

    def tick(self) -> None:
        """Expire leases, and hourly forget what left its window (the planning loop calls this about every
        second)."""
        if not self.live.ready or self.live.broken is not None:
            return
        with self.live.change():
            expired = self.expire_and_write()
            now = self.live.clock()
            if now - self.live.pruned_at >= PRUNE_EVERY_SECONDS:
                self.live.prune(now)
        if expired:
            self.live.notify(expired)

    def _deps_done(self, r: OpRecord) -> bool:
        return all(d not in self.live.ops or self.live.ops[d].state is OpState.DONE for d in r.op.depends_on)

    def _dep_done(self, dep: str) -> bool:
        """A dependency no longer holds an operation back: done, or not recorded (`_deps_done`)."""
        return dep not in self.live.ops or self.live.ops[dep].state is OpState.DONE

    def lease(self, node_id: str, max_operations: int) -> dict[str, Any]:
        """Lease up to `max_operations` of the node's queued operations whose dependencies are done, an engine
        step's moves together (`_with_step_siblings`: the lease may hold more than `max_operations` then)."""
        self.live.require_ready()
        with self.live.change(Urgency.URGENT):
            self.live.require_node(node_id)
            now = self.live.clock()
            batch = Batch()
            expired = self.expire(batch)
            queued = sorted(
                (
                    self.live.ops[i]
                    for i in self.live.open_ops.of_node(node_id)
                    if self.live.ops[i].state is OpState.QUEUED
                ),
                key=lambda r: (PRIORITY_RANK[r.op.priority], r.epoch, r.seq),
            )
            eligible = _with_step_siblings(queued, self._dep_done, max_operations)
            lease_id = expires = None
            if eligible:
                lease_id, expires = uuid.uuid4().hex, now + self.live.settings.lease_seconds
                for r in eligible:
                    r.state, r.lease_id, r.lease_expires_at, r.updated_at = OpState.LEASED, lease_id, expires, now
                    r.leases += 1
                    batch.operations[r.id] = r.to_json()
                self.live.next_lease_expiry = min(self.live.next_lease_expiry, expires)
            self.live.write(batch)
        if expired:
            self.live.notify(expired)
        return {
            "lease_id": lease_id,
            "expires_at": iso(expires),
            "expires_in_seconds": self.live.settings.lease_seconds if lease_id else None,
            "operations": [{**r.op.to_json(), "epoch": r.epoch} for r in eligible],
        }

    def renew(self, node_id: str, lease_id: str, *, node_scope: str | None = None) -> dict[str, Any]:
        """Extend the lease to now + `lease_seconds` for every operation it still holds (leased, not reported).

        Expiries due are applied first, as for a lease or a report, so a renewal after the deadline finds
        the lease ended: it is refused (`Conflict`) with how it ended (expired and re-queued, superseded by a
        newer epoch, every operation reported, or unknown), because its operations may be another lease's
        now. A lease of a node the caller's token does not reach is `Forbidden`; one of another node than
        `node_id`, `NotFound`. One batch commits the renewal with the expiries it applied, refused or not.
        """
        self.live.require_ready()
        with self.live.change(Urgency.URGENT):
            self.live.require_node(node_id)
            now = self.live.clock()
            batch = Batch()
            expired = self.expire(batch)
            held = sorted(
                (
                    self.live.ops[i]
                    for i in self.live.open_ops
                    if self.live.ops[i].state is OpState.LEASED and self.live.ops[i].lease_id == lease_id
                ),
                key=lambda r: (r.epoch, r.seq),
            )
            owner = held[0].node if held else self._owner(lease_id)
            refusal: ServiceError | None = None
            out: dict[str, Any] = {}
            if owner is not None and node_scope is not None and owner != node_scope:
                refusal = Forbidden(f"lease {lease_id} belongs to node {owner!r}, not to {node_scope!r}")
            elif owner is not None and owner != node_id:
                refusal = NotFound(f"node {node_id!r} holds no lease {lease_id} (it is a lease of node {owner!r})")
            elif not held:
                refusal = Conflict(
                    f"lease {lease_id} no longer holds any operation: {self._why_ended(lease_id)}; "
                    "report none of its operations, lease the node's queue again"
                )
            else:
                expires = now + self.live.settings.lease_seconds
                for r in held:
                    r.lease_expires_at, r.updated_at = expires, now
                    batch.operations[r.id] = r.to_json()
                out = {
                    "lease_id": lease_id,
                    "node": owner,
                    "expires_at": iso(expires),
                    "expires_in_seconds": self.live.settings.lease_seconds,
                    "operations": [r.id for r in held],
                }
            self.live.write(batch)
        if expired:
            self.live.notify(expired)
        if refusal is not None:
            raise refusal
        return out

    def _reported(self, lease_id: str) -> list[OpRecord]:
        """The operations reported under the lease (kept as long as finished operations are)."""
        return sorted(
            (r for r in self.live.ops.values() if r.lease_id == lease_id and r.state in (OpState.DONE, OpState.FAILED)),
            key=lambda r: (r.epoch, r.seq),
        )

    def _owner(self, lease_id: str) -> str | None:
        """The node of a lease that holds nothing any more, where the service still knows it."""
        ended = self.ended.get(lease_id)
        if ended is not None:
            return ended.node
        reported = self._reported(lease_id)
        return reported[0].node if reported else None

    def _why_ended(self, lease_id: str) -> str:
        reported = self._reported(lease_id)
        done = f"{_ids(reported)} reported" if reported else ""
        ended = self.ended.get(lease_id)
        if ended is not None:
            return f"{ended.why}{'; ' + done if done else ''}"
        if reported:
            return f"every operation it held was reported ({done})"
        return "the service does not know it (never granted, or it ended long ago or before the service restarted)"

    def report(self, op_id: str, body: ReportIn, *, node_scope: str | None = None) -> dict[str, Any]:
        """A node's outcome for a leased operation. Idempotent: the same report again answers the same."""
        self.live.require_ready()
        with self.live.change():
            expired = self.expire_and_write()
            r = self.live.ops.get(op_id)
            if r is None:
                raise NotFound(f"unknown operation {op_id!r}")
            if node_scope is not None and r.node != node_scope:
                raise Forbidden(f"operation {op_id} belongs to node {r.node!r}, not to {node_scope!r}")
            if r.state in (OpState.DONE, OpState.FAILED):
                if r.lease_id == body.lease_id and r.state.value == body.status:
                    return {"operation": r.to_json(), "srv_version": self.live.srv_version, "duplicate": True}
                raise Conflict(f"operation {op_id} is already {r.state.value} under another report")
            if r.state is OpState.SUPERSEDED:
                raise Conflict(
                    f"operation {op_id} was superseded by plan epoch {r.superseded_by}; lease the node's queue again"
                )
            if r.state is OpState.QUEUED:
                raise Conflict(
                    f"operation {op_id} is not leased (its lease expired and it was re-queued); lease it again"
                )
            if r.lease_id != body.lease_id:
                raise Conflict(f"operation {op_id} is held by another lease, not {body.lease_id!r}")
            now = self.live.clock()
            r.state = OpState.DONE if body.status == "done" else OpState.FAILED
            r.measured_seconds, r.measured_bytes, r.error, r.updated_at = (
                body.measured_seconds,
                body.measured_bytes,
                body.error,
                now,
            )
            self.live.open_ops.discard(op_id)
            batch = Batch()
            if r.state is OpState.DONE:
                self.live.failed_moves.succeeded(r.op)
                self.confirmed.confirm(r, now, batch)  # may record a conflict on the record
            else:
                failures = self.live.failed_moves.failed(r.op, now, body.error)
                self.live.wake(force=True)  # the next plan holds the move back until then
                log.warning(
                    "operation %s failed on %s (%d time(s); held back until %s): %s",
                    op_id,
                    r.node,
                    failures.count,
                    iso(failures.until),
                    body.error,
                )
            batch.operations[op_id] = r.to_json()  # as the answer shows it: with its conflict, if any
            self.live.write(batch)
            if body.measured_seconds is not None:
                self.live.metrics.operation_duration.labels(r.op.action.value, r.state.value).observe(
                    body.measured_seconds
                )
            out = {"operation": r.to_json(), "srv_version": self.live.srv_version, "duplicate": False}
        # what the report unblocks waits on the same node: a move, and so what depends on it, never leaves it
        self.live.notify(expired | {r.node})
        return out
