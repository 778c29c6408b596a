"""Confirmed placement: done operations checked and applied, bandwidths learned from them, a stored
placement repaired at start."""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict

from planner_service.domain.state import (
    Kind,
    Location,
    StateObject,
    Tier,
)
from planner_service.planner.operations import Operation, apply_operation
from planner_service.planner.srv import kv_beyond_pools
from planner_service.service import calibration, reconcile
from planner_service.service.inputs import HeartbeatIn
from planner_service.service.live import (
    Live,
    iso,
)
from planner_service.service.nodes import Correction, Pending, ReconcileStatus
from planner_service.service.records import OpRecord, OpState, Quarantined
from planner_service.service.store import Batch
from planner_service.wire.enums import Transition

log = logging.getLogger(__name__)

RECONCILE_HISTORY = 20
"""Corrections a node's reconcile status keeps (the log and the metric keep them all)."""


class Confirmed:
    """Confirmed placement: done operations checked and applied, bandwidths learned from them, a stored"""

    def __init__(self, live: Live) -> None:
        self.live = live

    def confirm(self, r: OpRecord, now: float, batch: Batch) -> None:
        """Apply a done operation to the confirmed placement and learn from its measured duration."""
        op = r.op
        self.live.refresh_sizes()  # sizes must know the sessions that events created since
        if (gone := self._gone(op)) is not None:
            r.conflict = f"not applied: {gone}"
            log.warning("operation %s reported done, placement unchanged: %s", r.id, gone)
        elif (conflict := self._landing_conflict(op)) is not None:
            # the node says it did what the confirmed state says cannot be: trust neither, plan again from what
            # is known, and let the node's next report of its memory settle who was right
            r.conflict = conflict
            self.live.metrics.report_conflicts.labels(r.node).inc()
            self.live.wake(force=True)
            log.error("operation %s reported done but not applied: %s", r.id, conflict)
        else:
            apply_operation(self.live.placement, op)
        self.live.purge_ended_sessions(batch)
        batch.placement.update(self.live.publish_srv((op.object, loc) for loc in (op.source, op.dest) if loc))
        batch.meta["srv"] = self.live.stored_srv()
        self._calibrate_from(r, batch)
        for s in self.live.sessions.values():
            if s.waiting_since is not None and s.model in self.live.serving:
                self.live.observe_switch(s, now - s.waiting_since)
                s.waiting_since = None
                batch.sessions[s.id] = s.to_json()

    def _gone(self, op: Operation) -> str | None:
        """What a done operation refers to that the cluster no longer has, if anything. A session that ended
        while its KV was being made is still known: the node holds those bytes, so the confirmed placement
        takes them (and the next plans drop them as any ended session's KV)."""
        p = self.live.sizes
        assert p is not None
        obj = op.object
        if obj.model not in p.models:
            return f"model {obj.model!r} is no longer in the catalog"
        if obj.kind is Kind.KV and obj.session not in self.live.sessions:
            return f"session {obj.session!r} is no longer known"
        for loc in (op.source, op.dest):
            if loc is not None and not (loc.id in p.gpus if loc.tier is Tier.GPU else loc.id in p.nodes):
                return f"{loc.label()} is no longer in the cluster"
        return None

    def _landing_conflict(self, op: Operation) -> str | None:
        """Why applying `op` to the confirmed placement would break a physical invariant, if it would: the
        source must hold what it gives, the destination must have room, and no location may hold more of
        weights or experts than their full size."""
        p = self.live.sizes
        assert p is not None
        if op.source is not None and (held := self.live.placement.get((op.object, op.source), 0)) < op.bytes:
            return f"{op.source.label()} holds {held} bytes of {op.object.label()}, not the {op.bytes} it gives"
        if op.dest is None:
            return None
        after = self.live.placement.get((op.object, op.dest), 0) + op.bytes
        if op.object.kind is not Kind.KV and after > p.size_of(op.object):
            return f"{op.dest.label()} would hold {after} bytes of {op.object.label()}, more than its {p.size_of(op.object)}"
        used = sum(n for (_, loc), n in self.live.placement.items() if loc == op.dest) + op.bytes
        if used > p.capacity_of(op.dest):
            return f"{op.dest.label()} would hold {used} bytes, more than its capacity {p.capacity_of(op.dest)}"
        return None

    def reconcile(self, node_id: str, body: HeartbeatIn, now: float, batch: Batch) -> ReconcileStatus:
        """Hold the confirmed placement to what the node's heartbeat measured (`service/reconcile.py`): the
        objects its engines' reported states leave no room for are taken out, a GPU that still holds less than
        recorded is recorded as lost state (metric, the node's `reconcile` status), and either replans. A finding counts when the
        previous heartbeat showed it too. Answers the node's reconcile status after this heartbeat."""
        p = self.live.sizes
        assert p is not None
        before = self.live.node_record(node_id).reconcile
        pending = before.pending if before is not None else Pending()
        node_ops = (self.live.ops[i] for i in self.live.open_ops.of_node(node_id))
        inflight = [r.op for r in node_ops if r.state is OpState.LEASED]
        moving = {(op.object, loc) for op in inflight for loc in (op.source, op.dest) if loc is not None}
        leaving: dict[str, int] = defaultdict(int)
        # a restart in flight stops the engine before it starts again: everything of its model on the GPUs of
        # its instances leaves them for a while, what the plan keeps there as much as what it moves
        relaunching = {
            (op.object.model, g)
            for op in inflight
            if op.engine is not None and op.engine.transition is Transition.RESTART
            for g in (*op.engine.instance.gpus, *(op.engine.previous.gpus if op.engine.previous else ()))
        }
        for (obj, loc), nbytes in self.live.placement.items():
            if loc.tier is Tier.GPU and (obj.model, loc.id) in relaunching:
                moving.add((obj, loc))
                leaving[loc.id] += nbytes
        for op in inflight:
            if op.source is not None and op.source.tier is Tier.GPU and not op.keep_source:
                if (op.object.model, op.source.id) not in relaunching:
                    leaving[op.source.id] += op.bytes
        gone = reconcile.gone(self.live.placement, p.nodes[node_id].gpus, body.instances, moving)
        corrected = [g for g in gone if g.key() in pending.gone]
        for g in corrected:
            del self.live.placement[(g.object, g.location)]
            self.live.metrics.reconciled_objects.labels(node_id).inc()
            log.warning("%s: %s taken out of the confirmed state (%s)", node_id, g.key(), g.why)
        # measured against the corrected placement: what the engines explained is not missing
        capacity = {g: p.capacity_of(Location.gpu(g)) for g in p.nodes[node_id].gpus}
        short = reconcile.shortfalls(
            self.live.placement, body.gpus, capacity, leaving, self._beyond_pools(node_id, body)
        )
        lost = [s for s in short if s.gpu in pending.gpus]
        known_lost = {s.gpu for s in before.lost} if before is not None else set()
        newly_lost = [s for s in lost if s.gpu not in known_lost]
        for s in newly_lost:
            self.live.metrics.state_lost.labels(node_id, s.gpu).inc()
            log.error(
                "%s lost state on %s: it measured %d bytes in use, the confirmed state holds %d there",
                node_id,
                s.gpu,
                s.used_bytes,
                s.confirmed_bytes,
            )
        checked_at = iso(now)
        assert checked_at is not None
        history = [
            *(before.corrected if before is not None else ()),
            *(Correction.of(g, checked_at) for g in corrected),
        ]
        status = ReconcileStatus(
            checked_at,
            tuple(lost),
            tuple(history[-RECONCILE_HISTORY:]),
            Pending(tuple(s.gpu for s in short), tuple(g.key() for g in gone if g not in corrected)),
        )
        if corrected:
            self.live.purge_ended_sessions(batch)
            batch.placement.update(self.live.publish_srv((g.object, g.location) for g in corrected))
            batch.meta["srv"] = self.live.stored_srv()
        if corrected or newly_lost:
            self.live.wake(force=True)
        return status

    def _beyond_pools(self, node_id: str, body: HeartbeatIn) -> dict[str, int]:
        """GPU -> the KV bytes the confirmed placement holds on it beyond the pools the heartbeat's running
        engines report: the engine's LRU evicted them, no state the node lost (planner/srv.py counts them out
        of the SRV alike)."""
        pools = self.live.reported_pools(node_id, body.instances)
        if not pools:
            return {}
        p = self.live.sizes
        assert p is not None
        others = {key: pool for key, pool in self.live.engine_pools().items() if key[0] != node_id}
        beyond: dict[str, int] = defaultdict(int)
        problem = dataclasses.replace(p, engine_pools={**others, **pools})
        for (_, gpu_id), nbytes in kv_beyond_pools(problem, self.live.placement).items():
            if gpu_id in p.nodes[node_id].gpus:
                beyond[gpu_id] += nbytes
        return beyond

    def repair_placement(self) -> None:
        """Bring a stored placement that breaks a physical invariant back within them, so that a start never
        fails on a database this service wrote: an object over its full size at a location keeps its full size,
        and a location over its capacity sheds what it can best lose (KV first, then what has a complete copy
        elsewhere on its node, the largest first). What was taken out is kept under `quarantine` and logged;
        the nodes' next reports and the plans after them rebuild it."""
        p = self.live.sizes
        assert p is not None
        removed: list[Quarantined] = []

        def quarantine(obj: StateObject, loc: Location, nbytes: int, why: str) -> None:
            removed.append(Quarantined(obj, loc, nbytes, why))

        placement = dict(self.live.placement)
        live = self.live.valid_placement(placement)
        for (obj, loc), n in live.items():
            if obj.kind is not Kind.KV and n > p.size_of(obj):
                quarantine(obj, loc, n - p.size_of(obj), f"more than the full size {p.size_of(obj)}")
                placement[(obj, loc)] = p.size_of(obj)
        used: dict[Location, int] = defaultdict(int)
        for (_, loc), n in self.live.valid_placement(placement).items():
            used[loc] += n

        def complete_elsewhere(obj: StateObject, loc: Location) -> bool:
            node = p.node_of(loc)
            return any(
                o == obj
                and other != loc
                and p.node_of(other) == node
                and other.tier is not Tier.GPU
                and n >= p.size_of(o)
                for (o, other), n in placement.items()
            )

        for loc, total in sorted(used.items()):
            over = total - p.capacity_of(loc)
            if over <= 0:
                continue
            here = [(obj, n) for (obj, l), n in self.live.valid_placement(placement).items() if l == loc]
            here.sort(key=lambda e: (e[0].kind is not Kind.KV, not complete_elsewhere(e[0], loc), -e[1]))
            for obj, n in here:
                if over <= 0:
                    break
                quarantine(
                    obj, loc, n, f"{loc.label()} held {total} bytes, more than its capacity {p.capacity_of(loc)}"
                )
                del placement[(obj, loc)]
                over -= n
        if not removed:
            return
        for entry in removed:
            log.error("the stored placement broke an invariant; quarantined: %s", entry.to_json())
        self.live.placement = placement
        changed = self.live.publish_srv()
        quarantined = (*self.live.quarantine, *removed)
        stored = [q.to_json() for q in quarantined]
        self.live.write(Batch(meta={"srv": self.live.stored_srv(), "quarantine": stored}, placement=changed))
        self.live.quarantine = quarantined
        self.live.force_replan = True

    def _calibrate_from(self, r: OpRecord, batch: Batch) -> None:
        """A measured copy is a sample of the bandwidth of the link it crossed."""
        op, seconds = r.op, r.measured_seconds
        if not seconds or seconds <= 0 or op.source is None or op.dest is None:
            return
        link = calibration.link_of(op.source, op.dest)
        nbytes = r.measured_bytes if r.measured_bytes else op.bytes
        if link is not None:
            self.calibrate(link, nbytes / seconds, calibration.Copy(op.bytes, nbytes), batch, r.id)

    def node_scale(self, node_id: str) -> float:
        """The scale the node's agent registered (1 where none did: real copies)."""
        return self.live.node_record(node_id).scale

    def calibrate(
        self, link: calibration.Link, rate: float, copied: calibration.Copy | None, batch: Batch, source: str
    ) -> None:
        """Fold one bandwidth sample into the link's estimate, unless `calibration.refusal` says no."""
        assert self.live.sizes is not None
        specs = self.live.sizes.nodes if link.scope == "nodes" else self.live.sizes.gpus
        if link.key not in specs:
            return
        node = link.key if link.scope == "nodes" else self.live.sizes.gpus[link.key].node
        if (scale := self.node_scale(node)) < 1:  # a scaled test run times its own overheads, not the link
            self.live.metrics.calibration_samples.labels("refused").inc()
            log.debug("calibration of %s %s: %s runs at scale %g; not a sample", link.key, link.field, node, scale)
            return
        entry = self.live.calibration.get(link)
        estimate = float(getattr(specs[link.key], link.field))  # the calibrated value where an entry exists
        catalog = entry.catalog if entry is not None and entry.catalog is not None else estimate
        folded, why = calibration.fold(entry, catalog, estimate, rate, copied)
        self.live.metrics.calibration_samples.labels("refused" if why else "accepted").inc()
        if why is not None:
            log.warning("calibration of %s %s: the sample from %s is refused: %s", link.key, link.field, source, why)
        if folded is not None and folded is not entry:
            self.live.calibration.put(link, dataclasses.replace(folded, catalog=catalog))
        batch.meta["calibration"] = self.live.calibration.to_json()
