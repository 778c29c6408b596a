"""Planning online: what a replan sees beyond its instant, which engines it leaves in place, and whether
its moves are worth making.

The service's planning loop and the simulator's `statebudget` policy both plan this way, so the trace
replay measures the rules the service runs. Each rule answers a way a plan for one instant goes wrong:

* **When to plan.** At once when a request waits for a model served nowhere or the plan broke (at most
  one such plan per short debounce: one within it waits for its end), otherwise every `REPLAN_SECONDS`. A turn on a warm model does not call for a plan: its
  engine serves it, and a plan per request reshuffles the cluster after every turn.
* **Stand-in sessions** (`RecentLoad`). An instant holds few requests in flight; a plan for them alone
  gives away the room the next ones need. `seats` stand-in active sessions (a team's engineers) are
  spread over the models by their share of the last `window_seconds`' requests (largest remainder),
  each with the mean context its model's requests arrived with; a model's sessions in flight take its
  seats first. Where the window holds fewer than `min_requests` (a quiet hour), it reaches back until
  it holds that many, at most a day (`MAX_DEMAND_WINDOW_SECONDS`): shares drawn from a handful of
  requests swing from one plan to the next, and each swing moves engines. Stand-ins only shape the
  placement: their KV is never planned for real (`without_stand_ins`).
* **Pins** (`pins`). A model that served within the window keeps its node and precision (the plan still
  chooses its GPUs on that node, its KV and its experts), unless its requests have waited longer than
  the unpin delay: then it is free to move where it fits.
* **Benefit over cost** (`worth_adopting`). A plan is adopted only when the objective it saves over
  staying put exceeds the seconds its promotes take, the engine transitions that bring weights onto
  GPUs included (`objective.promote_seconds`: a cold start's 30 s, a restart's 32 s, a wake's 0.1 s;
  the objective charges only `move_weight` of those, here the whole), or when it brings a model that
  requests wait for; a plan with no operations,
  when the current plan's are not all started (staying put then means cancelling them). Leaving fewer
  requests unserved is not reason enough on its own: under overload it adopts swaps of engines that the
  objective prices far worse than staying put. A plan's engine moves also pay their tail (`move_price`):
  the requests that arrive while a moved engine starts, the history a move across nodes strands in the old
  node's DRAM, and a margin of one cold start on a move across nodes. A replan forced because the plan broke
  adopts its plan whatever that buys, unless staying put scores better by the objective itself
  (`staying_beats`: then the plan is `staying_put`): a greedy plan can be worse than where it starts, and one
  forced again by its own restart (the engine seen stopped for a moment) would otherwise move it back.

What each rule bought in the replays: docs/studies/ablations.md.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from planner_service.domain.problem import STAND_IN, Problem, Session, is_stand_in
from planner_service.domain.scenario import Slo
from planner_service.domain.state import Kind, Location, StateObject, Tier
from planner_service.planner import costs, engine_costs
from planner_service.planner.objective import Demand, Objective, evaluate
from planner_service.planner.plan import Plan, PlanStatus, make_plan
from planner_service.planner.residency import ResidencyIndex

REPLAN_SECONDS = 30.0  # the periodic replan
# The hysteresis on a move across nodes, in cold starts of the move: a move that proves wrong costs the start
# that undoes it, so it must save that start beyond its own (derived; tuned on no seed).
ACROSS_MARGIN_STARTS = 1.0
DEBOUNCE_SECONDS = 0.2  # how long a plan for a waiting request waits for the rest of its burst
MAX_DEMAND_WINDOW_SECONDS = 86400.0  # how far back the stand-ins' window reaches in a quiet spell


def apportion(counts: Mapping[str, int], seats: int) -> dict[str, int]:
    """`seats` spread over the keys in proportion to their counts (largest remainder; ties by key)."""
    total = sum(counts.values())
    quota = {m: seats * n / total for m, n in counts.items()}
    share = {m: int(q) for m, q in quota.items()}
    for m in sorted(quota, key=lambda m: (-(quota[m] - share[m]), m))[: seats - sum(share.values())]:
        share[m] += 1
    return share


class RecentLoad:
    """The requests of the last `window_seconds`, or as far back as the last `min_requests` go (at most
    `MAX_DEMAND_WINDOW_SECONDS`): arrival, model, context tokens; and the stand-in sessions they call for."""

    def __init__(self, window_seconds: float = 3600.0, seats: int = 10, min_requests: int = 1000) -> None:
        self.window_seconds = window_seconds
        self.seats = seats
        self.min_requests = min_requests
        self.max_window_seconds = max(window_seconds, MAX_DEMAND_WINDOW_SECONDS)
        self._requests: deque[tuple[float, str, int]] = deque()

    def add(self, t: float, model: str, context_tokens: int) -> None:
        """A request arrived at `t` (in time order) for `model`, with the session's context after its turn."""
        self._requests.append((t, model, context_tokens))

    def stand_ins(self, now: float, in_flight: Mapping[str, int]) -> list[Session]:
        """Stand-in active sessions for the window's load beyond the requests in flight (per model)."""
        requests = self._requests
        while (
            requests
            and requests[0][0] < now - self.window_seconds
            and (len(requests) > self.min_requests or requests[0][0] < now - self.max_window_seconds)
        ):
            requests.popleft()
        if not requests:
            return []
        counts: dict[str, int] = {}
        context: dict[str, int] = {}
        for _, model, tokens in requests:
            counts[model] = counts.get(model, 0) + 1
            context[model] = context.get(model, 0) + tokens
        seats = apportion(counts, self.seats)
        return [
            Session(f"{STAND_IN}{m}-{k}", f"{STAND_IN}{m}-{k}", Slo.INTERACTIVE, m, True, context[m] // counts[m])
            for m in sorted(seats)
            for k in range(in_flight.get(m, 0), seats[m])
        ]

    def rates(self, now: float) -> dict[str, float]:
        """Each model's arrival rate [requests/s]: its requests in the window `stand_ins` last kept, over the
        window's span (at least `REPLAN_SECONDS`, so that a burst just begun does not read as a flood)."""
        if not self._requests:
            return {}
        span = max(now - self._requests[0][0], REPLAN_SECONDS)
        counts: dict[str, int] = {}
        for _, model, _ in self._requests:
            counts[model] = counts.get(model, 0) + 1
        return {m: n / span for m, n in counts.items()}


@dataclass(frozen=True)
class Engine:
    """Where a model serves now, and when it last served a request."""

    node: str
    precision: str
    last_used: float


def engines_in(problem: Problem, last_used: Mapping[str, float]) -> dict[str, Engine]:
    """The engines of the confirmed placement: each model whose weights are complete on the GPUs of
    exactly one node (a model complete on two has no one place to keep), with when it last served."""
    complete: dict[str, list[tuple[str, str]]] = {}
    for (obj, node), nbytes in ResidencyIndex.build(problem, problem.residency).gpu_bytes.items():
        if obj.kind is Kind.WEIGHTS and obj.precision is not None and nbytes >= problem.size_of(obj):
            complete.setdefault(obj.model, []).append((node, obj.precision))
    return {
        model: Engine(*places[0], last_used.get(model, float("-inf")))
        for model, places in complete.items()
        if len(places) == 1
    }


def pins(
    engines: Mapping[str, Engine], stuck: Collection[str], now: float, window_seconds: float
) -> tuple[dict[str, str], dict[str, str]]:
    """Node and precision (the greedy's `nodes`, `precisions`) of every model that served within the
    window, unless it is in `stuck` (its requests waited past the unpin delay)."""
    nodes: dict[str, str] = {}
    precisions: dict[str, str] = {}
    for model_id, engine in engines.items():
        if model_id not in stuck and now - engine.last_used < window_seconds:
            nodes[model_id] = engine.node
            precisions[model_id] = engine.precision
    return nodes, precisions


def brings(plan: Plan, models: Collection[str]) -> bool:
    """Whether the plan promotes the weights of one of `models` to a GPU."""
    return any(
        op.object.kind is Kind.WEIGHTS and op.object.model in models and op.dest is not None
        and op.dest.tier is Tier.GPU for op in plan.operations
    )  # fmt: skip


@dataclass(frozen=True)
class MovePrice:
    """What a plan's engine moves cost the requests of the models they move, beyond the promotes' seconds
    (`move_price`), in seconds of switch latency."""

    outage: float = 0.0  # requests that arrive while a moved engine starts, each waiting out the start
    stranded: float = 0.0  # history re-prefilled because a move across nodes left the session's KV behind
    margin: float = 0.0  # the hysteresis on moves across nodes

    @property
    def total(self) -> float:
        return self.outage + self.stranded + self.margin


def move_price(
    problem: Problem,
    plan: Plan,
    rates: Mapping[str, float],
    *,
    now: ResidencyIndex | None = None,
    across_margin: float = 0.0,
) -> MovePrice:
    """The tail a plan's moves put on the models it moves: for each model served now that the plan serves
    from another group, node or precision (its engine stops and starts there):

        start    = engine_costs.bring_up_seconds(new group, from the new node's fastest complete copy)   [s]
        outage   = rate * start * start / 2     requests arriving in the start (rate [1/s] * start), each
                                                waiting on average half of it (arrivals uniform over it)
        stranded = sum over the model's real sessions with KV on the old node (any tier), when the new
                   group is on another node: their KV's tokens * prefill s/token on the new group
                   (`costs.prefill_seconds_per_token`): the write-through copy lives in the old node's
                   DRAM, so the next turn there re-prefills the history
        margin   = across_margin * start        for a move across nodes: what it must beat staying put by

    A model the plan drops from GPU is left out: the objective prices its next request's cold load."""
    now = now or ResidencyIndex.build(problem, problem.residency)
    after = ResidencyIndex.serving_in(problem, plan.placement)
    outage = stranded = margin = 0.0
    for model_id, before in now.serving.items():
        moved = after.get(model_id)
        if moved is None or (moved.node, moved.precision, moved.gpus) == (before.node, before.precision, before.gpus):
            continue
        model = problem.models[model_id]
        node = problem.nodes[moved.node]
        source = now.complete_source(StateObject.weights(model_id, moved.precision), moved.node) or Tier.NVME
        start = engine_costs.bring_up_seconds(problem, now, model, moved.precision, moved.gpus, source, node)
        outage += rates.get(model_id, 0.0) * start * start / 2
        if moved.node == before.node:
            continue
        margin += across_margin * start
        if model.kv_bytes_per_token <= 0:
            continue
        left: dict[str, int] = {}  # session -> KV bytes of the model on the old node (its largest copy)
        for (obj, loc), nbytes in problem.residency.items():
            if (
                obj.kind is Kind.KV
                and obj.model == model_id
                and obj.session is not None
                and not is_stand_in(obj.session)
                and problem.node_of(loc) == before.node
            ):
                left[obj.session] = max(left.get(obj.session, 0), nbytes)
        per_token = costs.prefill_seconds_per_token(model, moved.gpus, problem.constants)
        stranded += sum(nbytes // model.kv_bytes_per_token for nbytes in left.values()) * per_token
    return MovePrice(outage, stranded, margin)


def worth_adopting(
    problem: Problem,
    plan: Plan,
    waiting_models: Collection[str] = (),
    *,
    pending: bool = False,
    now: ResidencyIndex | None = None,
    demand: Demand | None = None,
    price: MovePrice | None = None,
    stand_ins_expected: bool = True,
) -> bool:
    """Whether to adopt `plan` rather than stay put: it brings a model that requests wait for (the
    `waiting_models` not loaded), or it saves more objective than the seconds its promotes take plus the
    `price` of its moves (`move_price`; the objective prices requests left unserved too). Both placements
    are priced with the stand-in sessions inactive (`stand_ins_expected`): they place room for the load to
    come, and as active sessions every stand-in of a model off GPU would count as a request left unserved
    (the penalty U, 1200 s), which outweighed every move's price. A plan with no operations is adopted only where the
    current plan has operations still `pending` (not started): the planner now finds the placement as it
    is best, so they should not run. (`now` and `demand` as for `evaluate`, when the solver has them.)"""
    if not plan.operations:
        return pending
    if brings(plan, waiting_models):
        return True
    stay, planned = _stay_and_plan(problem, plan, now, demand, stand_ins_expected)
    move_weight = problem.constants.move_weight
    promote_seconds = planned.moves / move_weight if move_weight > 0 else 0.0
    return stay.total - planned.total > promote_seconds + (price.total if price is not None else 0.0)


def staying_beats(problem: Problem, plan: Plan, now: ResidencyIndex | None = None) -> bool:
    """Whether staying put scores better than `plan` by the objective alone (no promote seconds or move
    price on top, stand-ins priced as in `worth_adopting`). A forced replan (the plan broke) adopts its plan
    unless this holds: a heuristic plan can be worse than the placement it starts from, and a replan forced
    again by what the last one did (an engine restarted, seen stopped for a moment) must not move it back."""
    if not plan.operations:
        return False
    # the stand-ins' KV left out of the plan's placement, as the plan is installed (`for_real`): the room it
    # holds for them is priced by their predicted requests on both sides, not as KV the plan has and staying
    # put lacks
    real = dataclasses.replace(plan, placement=without_stand_ins(plan.placement))
    stay, planned = _stay_and_plan(problem, real, now, None, True)
    return stay.total < planned.total


def _stay_and_plan(
    problem: Problem, plan: Plan, now: ResidencyIndex | None, demand: Demand | None, stand_ins_expected: bool
) -> tuple[Objective, Objective]:
    now = now or ResidencyIndex.build(problem, problem.residency)
    planned = plan.objective
    if stand_ins_expected:
        # stand-ins are expected load, not requests waiting: priced as predicted requests (the cold load of a
        # model off GPU), not as active ones left unserved, or a plan for any stand-in's model saves U each
        problem = dataclasses.replace(
            problem,
            sessions=MappingProxyType(
                {
                    sid: dataclasses.replace(s, active=False) if is_stand_in(sid) else s
                    for sid, s in problem.sessions.items()
                }
            ),
        )
        demand = None
        planned, _ = evaluate(problem, plan.placement, now)
    stay, _ = evaluate(problem, problem.residency, now, now, demand)
    return stay, planned


def staying_put(problem: Problem, plan: Plan) -> Plan:
    """The plan that keeps the confirmed placement, in place of `plan` (same solver): its operations are
    those the engines need to keep it (engine_targets.engine_target), usually none; the active sessions it does
    not serve (their model off GPU, or their KV not whole on its GPUs) stay unserved."""
    index = ResidencyIndex.build(problem, problem.residency)
    unserved = {}
    for sid, s in problem.sessions.items():
        serving = index.serving.get(s.model)
        kv = StateObject.kv(s.model, sid)
        if s.active and (
            serving is None
            or sum(problem.residency.get((kv, Location.gpu(g.id)), 0) for g in serving.gpus) < problem.size_of(kv)
        ):
            unserved[sid] = "staying put scores better than the plan that would serve it"
    return make_plan(problem, plan.solver, problem.residency, unserved, status=plan.status)


def without_stand_ins(
    placement: Mapping[tuple[StateObject, Location], int],
) -> dict[tuple[StateObject, Location], int]:
    """The placement less the KV of stand-in sessions (the room they held is left free)."""
    return {key: nbytes for key, nbytes in placement.items() if not is_stand_in(key[0].session)}


def for_real(problem: Problem, plan: Plan) -> Plan:
    """The plan, made on `problem` with stand-ins, for the real sessions alone: the stand-ins' KV and its
    operations out (nothing depends on them: they only fill room), objective and predicted metrics
    evaluated again without the stand-ins."""
    real = dataclasses.replace(
        problem,
        sessions=MappingProxyType({sid: s for sid, s in problem.sessions.items() if not is_stand_in(sid)}),
        next_model=MappingProxyType({sid: row for sid, row in problem.next_model.items() if not is_stand_in(sid)}),
    )
    placement = without_stand_ins(plan.placement)
    dropped = {op.id for op in plan.operations if is_stand_in(op.object.session)}
    operations = [
        dataclasses.replace(op, depends_on=[d for d in op.depends_on if d not in dropped])
        for op in plan.operations
        if op.id not in dropped
    ]
    objective, predicted = evaluate(real, placement)
    unserved = {sid: why for sid, why in plan.unserved.items() if not is_stand_in(sid)}
    status = plan.status
    if status in (PlanStatus.OK, PlanStatus.PARTIAL):
        status = PlanStatus.PARTIAL if unserved else PlanStatus.OK
    return dataclasses.replace(
        plan,
        status=status,
        objective=objective,
        predicted=predicted,
        placement=placement,
        operations=operations,
        unserved=unserved,
    )
