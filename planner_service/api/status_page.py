"""What the status page at `/` shows, computed from the service's read views (the API's own answers).

The page is a picture of one moment: each GPU, host DRAM and NVMe as a bar of the bytes every model's
weights, KV and experts hold there (now, and in the plan's target), the queues per node, what the
plan predicts, the last operations that finished, and what each session is waiting for. Nothing
here reads the live state directly: `build_page` takes the views as the API sends them, typed by
the wire models, so the page never shows anything `GET /v1/...` would not.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from planner_service.wire.cluster import ClusterOut, ModelOut
from planner_service.wire.engines import EngineOut
from planner_service.wire.enums import Action, Kind, OperationState, Tier
from planner_service.wire.operations import OperationRecord
from planner_service.wire.plan import CurrentPlanOut
from planner_service.wire.sessions import SessionOut
from planner_service.wire.state import PlacementEntry, SrvOut

# one hue per model, in catalog order (Tableau 10: distinct for the usual forms of colour blindness)
PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#e15759",
    "#76b7b2",
    "#59a14f",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
)
STATE_ORDER = (Kind.WEIGHTS, Kind.EXPERTS, Kind.KV)  # left to right inside one model's part of a bar
RECENT_OPERATIONS = 12  # finished operations the page lists, newest first
NEXT_UP = 3  # queued operations named per node


@dataclass(frozen=True)
class Segment:
    """Bytes of one model's state of one kind in one bar; `x` and `width` in percent of the bar."""

    model: str
    state: Kind
    bytes: int
    x: float
    width: float
    color: int  # index into PALETTE

    @property
    def fill(self) -> str:
        """A model's weights in its colour, its KV lighter, its experts hatched (a pattern of the page)."""
        if self.state is Kind.EXPERTS:
            return f"url(#hatch-{self.color % len(PALETTE)})"
        return PALETTE[self.color % len(PALETTE)]

    @property
    def opacity(self) -> float:
        return 0.45 if self.state is Kind.KV else 1.0


@dataclass(frozen=True)
class Bar:
    """One location's bytes: segments by model and kind, then what is reserved, out of `total_bytes`."""

    label: str
    total_bytes: int
    segments: list[Segment]
    reserved_bytes: int = 0

    @property
    def used_bytes(self) -> int:
        return sum(s.bytes for s in self.segments)

    @property
    def reserved_x(self) -> float:
        return _scale(self.total_bytes - self.reserved_bytes, self.total_bytes)

    @property
    def reserved_width(self) -> float:
        return _scale(self.reserved_bytes, self.total_bytes)


@dataclass(frozen=True)
class GpuRow:
    id: str
    type: str | None
    capacity_bytes: int
    now: Bar
    plan: Bar | None


@dataclass(frozen=True)
class NodeCard:
    id: str
    agent: str  # "registered 08:01:02, heartbeat 08:03:10" or "no agent registered"
    gpus: list[GpuRow]
    host: Bar
    nvme: Bar
    queued: int
    leased: int
    held_back: int
    queued_bytes: int
    next_up: list[str]  # labels of the first queued operations, in the order the node will lease them
    engines: list[EngineRow]


@dataclass(frozen=True)
class EngineRow:
    """One engine instance of an engine node: what it serves, its state now and what the plan makes of it."""

    model: str
    kind: str
    state: str
    planned: str  # "→ running (wake)", or "" where the plan leaves it as it is
    gpus: str


@dataclass(frozen=True)
class LegendEntry:
    model: str
    color: int
    serving: bool


@dataclass(frozen=True)
class OperationRow:
    id: str
    finished_at: str
    node: str
    action: Action
    what: str
    path: str
    bytes: int
    state: OperationState
    estimated_seconds: float
    measured_seconds: float | None
    note: str  # the conflict of a done report that was not applied, or a failure's error


@dataclass(frozen=True)
class SessionRow:
    id: str
    user: str
    slo: str
    model: str
    doing: str  # "request", "tool call", "idle"
    context_tokens: int
    kv: str  # where the session's KV of its current model is: "gpu 6.3 GiB"
    waits_for: str
    waiting: bool  # a request of it waits for something


@dataclass(frozen=True)
class Prediction:
    solver: str
    status: str
    epoch: int
    planned_at: str | None
    solve_seconds: float
    p50_seconds: float
    p95_seconds: float
    mean_seconds: float
    slo_violation_rate: float
    gpu_bytes: int
    unserved: list[str]  # "s07: <constraint>"
    operations: int
    held_back: int


@dataclass(frozen=True)
class StatusPage:
    srv_version: int
    plan: Prediction | None
    legend: list[LegendEntry]
    nodes: list[NodeCard]
    recent: list[OperationRow]
    sessions: list[SessionRow]
    ended_sessions: int
    quarantined: int
    palette: Sequence[str] = field(default=PALETTE)


def _scale(nbytes: int, total_bytes: int) -> float:
    return 100.0 * nbytes / total_bytes if total_bytes > 0 else 0.0


def hhmmss(unix_seconds: float) -> str:
    return datetime.fromtimestamp(unix_seconds, UTC).strftime("%H:%M:%S")


def bar(
    label: str, entries: Iterable[PlacementEntry], total_bytes: int, colors: dict[str, int], reserved: int = 0
) -> Bar:
    """The entries' bytes by (model, kind), models in catalog order, kinds in `STATE_ORDER`."""
    held: dict[tuple[str, Kind], int] = defaultdict(int)
    for e in entries:
        held[(e.object.model, e.object.kind)] += e.bytes
    order = sorted(held, key=lambda k: (colors.get(k[0], len(colors)), k[0], STATE_ORDER.index(k[1])))
    segments: list[Segment] = []
    x = 0.0
    for model, kind in order:
        nbytes = held[(model, kind)]
        if nbytes <= 0:
            continue
        width = _scale(nbytes, total_bytes)
        segments.append(Segment(model, kind, nbytes, x, width, colors.get(model, len(colors))))
        x += width
    return Bar(label, total_bytes, segments, reserved)


def _by_location(entries: Iterable[PlacementEntry]) -> dict[tuple[Tier, str], list[PlacementEntry]]:
    at: dict[tuple[Tier, str], list[PlacementEntry]] = defaultdict(list)
    for e in entries:
        at[(e.location.tier, e.location.id)].append(e)
    return at


def _path(op: OperationRecord) -> str:
    src = op.source.label() if op.source else "prefill"
    return f"{src} → {_dest(op)}"


def _dest(op: OperationRecord) -> str:
    return op.dest.label() if op.dest else "dropped"


def _agent(registered_at: str | None, last_heartbeat: str | None) -> str:
    if registered_at is None:
        return "no agent registered"
    seen = f", last heartbeat {last_heartbeat[11:19]} UTC" if last_heartbeat else ", no heartbeat yet"
    return f"agent registered {registered_at[11:19]} UTC{seen}"


def waits_for(
    session: SessionOut,
    unserved: dict[str, str],
    open_ops: Sequence[OperationRecord],
    on_gpu: dict[str, list[str]],
) -> tuple[str, bool]:
    """What a session waits for, in words, and whether a request of it is waiting.

    A session in a tool call waits for its tool, an idle one for its next turn. A session with a request
    in flight waits for the plan to make room (when the plan could not serve it), else for the open
    promotions of its model's weights and experts and of its own KV, else for nothing: its model's
    weights are on GPU.
    """
    if session.id in unserved:
        return f"room: {unserved[session.id]}", True
    if session.in_tool_call:
        return "its tool call to return", False
    if not session.active:
        return "its next turn", False
    moves = [
        op
        for op in open_ops
        if op.action is Action.PROMOTE
        and op.object.model == session.model
        and (op.object.kind is not Kind.KV or op.object.session == session.id)
    ]
    if moves:
        first = moves[0]
        more = f" (+{len(moves) - 1} more)" if len(moves) > 1 else ""
        return f"{first.state.value} {first.object.label()} → {_dest(first)}{more}", True
    if session.model in on_gpu:
        return f"nothing: {session.model} is on {', '.join(on_gpu[session.model])}", False
    return f"{session.model} to reach a GPU (no move planned yet)", True


def _engine_row(e: EngineOut) -> EngineRow:
    changes = e.planned_state is not None and (e.planned_state is not e.state or e.planned_step is not None)
    calls = " then ".join(t.value for t in e.planned_steps) or (e.planned_step.value if e.planned_step else "")
    step = f" ({calls})" if calls else ""
    planned = f"→ {e.planned_state.value}{step}" if changes and e.planned_state is not None else ""
    return EngineRow(e.model, e.kind.value, e.state.value, planned, ", ".join(e.gpus) or "no GPUs")


def _kv_where(session: SessionOut) -> str:
    tiers = session.kv_bytes.get(session.model, {})
    parts = [f"{tier.value} {n / 2**30:.1f} GiB" for tier, n in sorted(tiers.items(), key=lambda t: t[0].value) if n]
    return ", ".join(parts) or "none"


def build_page(
    *,
    cluster: ClusterOut,
    srv: SrvOut,
    plan: CurrentPlanOut | None,
    open_ops: Sequence[OperationRecord],
    finished_ops: Sequence[OperationRecord],
    sessions: Sequence[SessionOut],
    models: Sequence[ModelOut],
    engines: Sequence[EngineOut] = (),
) -> StatusPage:
    """The page from the views: `open_ops` queued or leased, `finished_ops` done or failed (any order)."""
    colors = {m.id: i for i, m in enumerate(models)}
    now_at = _by_location(srv.placement)
    plan_at = _by_location(plan.placement) if plan is not None else {}
    held_back: dict[str, int] = defaultdict(int)
    for h in plan.held_back if plan is not None else []:
        held_back[h.operation.node] += 1
    open_sorted = sorted(open_ops, key=lambda r: (r.epoch, r.seq))
    on_gpu: dict[str, list[str]] = defaultdict(list)
    for e in srv.placement:
        if e.location.tier is Tier.GPU and e.object.kind is Kind.WEIGHTS and e.bytes > 0:
            if e.location.id not in on_gpu[e.object.model]:
                on_gpu[e.object.model].append(e.location.id)

    nodes: list[NodeCard] = []
    for n in cluster.nodes:
        gpus = []
        for g in n.gpus:
            total = g.capacity_bytes + g.reserved_bytes
            key = (Tier.GPU, g.id)
            gpus.append(
                GpuRow(
                    id=g.id,
                    type=g.type,
                    capacity_bytes=g.capacity_bytes,
                    now=bar("now", now_at.get(key, []), total, colors, g.reserved_bytes),
                    plan=bar("plan", plan_at.get(key, []), total, colors, g.reserved_bytes) if plan else None,
                )
            )
        mine = [r for r in open_sorted if r.node == n.id]
        queued = [r for r in mine if r.state is OperationState.QUEUED]
        nodes.append(
            NodeCard(
                id=n.id,
                agent=_agent(n.registered_at, n.last_heartbeat),
                gpus=gpus,
                host=bar("host DRAM", now_at.get((Tier.HOST, n.id), []), n.host_dram_bytes, colors),
                nvme=bar("NVMe", now_at.get((Tier.NVME, n.id), []), n.nvme_bytes, colors),
                queued=len(queued),
                leased=sum(r.state is OperationState.LEASED for r in mine),
                held_back=held_back[n.id],
                queued_bytes=sum(r.bytes for r in queued),
                next_up=[f"{r.action.value} {r.object.label()} → {_dest(r)}" for r in queued[:NEXT_UP]],
                engines=[_engine_row(e) for e in engines if e.node == n.id],
            )
        )

    recent = [
        OperationRow(
            id=r.id,
            finished_at=hhmmss(r.updated_at),
            node=r.node,
            action=r.action,
            what=r.object.label(),
            path=_path(r),
            bytes=r.bytes,
            state=r.state,
            estimated_seconds=r.estimated_seconds,
            measured_seconds=r.measured_seconds,
            note=r.conflict or r.error or "",
        )
        for r in sorted(finished_ops, key=lambda r: (r.updated_at, r.epoch, r.seq), reverse=True)[:RECENT_OPERATIONS]
    ]

    unserved = {u.session: u.constraint for u in plan.unserved} if plan is not None else {}
    rows = []
    for s in sessions:
        if s.ended:
            continue
        why, waiting = waits_for(s, unserved, open_sorted, on_gpu)
        doing = "tool call" if s.in_tool_call else "request" if s.active else "idle"
        rows.append(SessionRow(s.id, s.user, s.slo.value, s.model, doing, s.context_tokens, _kv_where(s), why, waiting))

    prediction = None
    if plan is not None:
        p = plan.predicted
        prediction = Prediction(
            solver=plan.solver.value,
            status=plan.status.value,
            epoch=plan.epoch,
            planned_at=plan.planned_at,
            solve_seconds=plan.solve_seconds,
            p50_seconds=p.switch_latency_p50_seconds,
            p95_seconds=p.switch_latency_p95_seconds,
            mean_seconds=p.switch_latency_mean_seconds,
            slo_violation_rate=p.slo_violation_rate,
            gpu_bytes=p.gpu_bytes,
            unserved=[f"{u.session}: {u.constraint}" for u in plan.unserved],
            operations=len(plan.operations),
            held_back=len(plan.held_back),
        )
    return StatusPage(
        srv_version=srv.version,
        plan=prediction,
        legend=[LegendEntry(m.id, colors[m.id], m.serving) for m in models],
        nodes=nodes,
        recent=recent,
        sessions=rows,
        ended_sessions=sum(s.ended for s in sessions),
        quarantined=len(cluster.quarantine),
    )


def size(nbytes: float) -> str:
    """Bytes for a person: MiB below one GiB, TiB from 1024 GiB up."""
    gib = nbytes / 2**30
    if gib >= 1024:
        return f"{gib / 1024:.1f} TiB"
    if gib >= 1:
        return f"{gib:.1f} GiB"
    return f"{nbytes / 2**20:.0f} MiB"


def seconds(value: float | None) -> str:
    if value is None:
        return "–"
    if value >= 100:
        return f"{value:.0f} s"
    if value >= 1:
        return f"{value:.1f} s"
    return f"{value * 1000:.0f} ms"
