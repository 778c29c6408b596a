"""Synthetic agent traces for a small engineering team.

The generative model, in the order it runs:

1. **Users.** `users` engineers; each arrives at a uniform time in the first
   `arrival_spread_seconds` and leaves at a uniform time in the last
   `departure_spread_seconds` of the trace.
2. **Sessions.** `sessions` slots keep about that many sessions alive at a time. Each slot opens at
   a uniform time in the first `arrival_spread_seconds` (the team ramps up as people arrive) and
   stops opening sessions at a uniform time in the last `departure_spread_seconds` (people leave).
   When a slot's session ends, a replacement opens after a lognormal pause (median
   `restart_gap_median_seconds`). A new session belongs to a present engineer with the fewest live
   sessions (random among ties; the nearest in time when nobody is present). Its SLO class is drawn
   once, with `slo_weights` over blocking / interactive / background.
3. **Turns.** A session makes a geometric number of turns (mean `mean_turns_per_session`) and ends
   early when its history would pass `max_context_tokens` (the agent compacts and starts afresh).
   After the last turn an `end` record follows one more gap later.
4. **Gaps** between the arrivals of a session's turns are a mixture of two lognormals: an agent
   loop waiting for a tool (median `tool_gap_median_seconds`, sigma `tool_gap_sigma`) and, with
   probability `human_turn_probability`, an engineer reading and typing (median
   `human_gap_median_seconds`, sigma `human_gap_sigma`). The tool-loop shape is fitted to the 17
   round-to-round gaps of the public TraceLab sample of Claude Code / Codex sessions
   (../shared/traces/tracelab_sample: p50 7.8 s, p90 39 s; log-mean 2.16, log-sd 1.11). Those
   gaps run from round start to round start, so they include the model's own generation time.
   The mixture's mean is about 30 s, the demo scenario's `predictor.turn_gap_seconds`.
   `gap_scale` multiplies every gap: the offered load's dimension besides the number of sessions
   (a scale of 4 is a team whose agents send a quarter of the fitted turn rate). A closed-loop
   replay keeps each start-to-start gap from the previous turn's arrival (`engine.py`).
5. **Tokens.** `input_tokens` is what a turn appends to the history (trace.py): the first turn
   brings the system prompt, tool schemas and task (lognormal, median `first_input_median_tokens`),
   later turns a tool result or user message (median `turn_input_median_tokens`); each turn
   generates `output_tokens` (median `output_median_tokens`). TraceLab's sample: first-round
   prompts of 9.3k (Codex) and 32k (Claude Code) tokens, appended tokens per round p50 1,359 /
   p90 5,316, output p50 273 / p90 1,452. So contexts grow by about 3k tokens a turn.
6. **Models.** A session's first model is drawn from the hour's preference vector `pref_h`; each
   later turn moves along a hand-off Markov chain whose matrix drifts hour by hour:

       P_h[i, :] = (1 - drift_weight) * H[i, :] + drift_weight * pref_h
       pref_h    = (1 - focus_strength) * uniform + focus_strength * ((1 - f_h) * morning + f_h * afternoon)
       f_h       = (h + 0.5) / hours_in_trace          (h = the hour of the turn, 0-based)

   `H` is the scenario's `predictor.handoff` prior (rows normalised); a model without a row stays
   with `predictor.stay_probability` and otherwise moves uniformly. `morning` and `afternoon` are
   uniform over `morning_models` / `afternoon_models` (default: coder in the morning, reasoner in
   the afternoon); ids the scenario lacks are ignored, and if none is left the first (morning) or
   last (afternoon) scenario model stands in.

   With `handoff_rate` set, the chain no longer decides *whether* a turn hands off, only *where to*:
   each later turn hands off with probability `handoff_rate`, to a model drawn from `P_h`'s row
   without the current model (renormalised; uniform over the others where that row has no other
   mass), and otherwise stays. Left unset, the demo's chain hands off on about half the turns
   (54.1 % of the turns after a session's first: 10 sessions, 8 h, seed 7, `handoff_share`), while
   the Alibaba GenAI trace's sessions change model on 24.9 % of theirs (`sim/fit.py`), so the rate is
   a dimension to sweep. `sim/fit.py` also fits the gaps and tokens to a real trace instead of TraceLab's.
7. **Context.** `context` says what a hand-off's model sees. `shared`: the whole history of the
   session (one trace session; the new model must have KV for all of it or prefill it again).
   `fresh`: a sub-agent with a context of its own. A hand-off away from the session's first model
   (its root agent) opens a sub-agent session `<session>.kN` whose first request names the session
   that handed off to it (`parent`) and brings a fresh system prompt, tools and task (the first-turn
   token distribution); its later turns on that model grow its own history only. A hand-off from one
   sub-agent to another model ends the first sub-agent and opens a new one; a hand-off back to the
   root model ends the sub-agent, and the root's turn appends the sub-agent's result (a later turn's
   tokens) to the root's history. The simulator counts a hand-off across a sub-agent and the session
   that handed off to it (`engine.py`), so both semantics count the same turns as hand-offs.

All randomness comes from one `numpy.random.Generator`, so a seed fixes the trace.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner_service.domain.scenario import Scenario, Slo
from planner_service.sim.trace import TraceEnd, TraceRecord, TraceRequest, by_workflow

HOUR_SECONDS = 3600.0

CONTEXTS = ("shared", "fresh")  # what a hand-off's model sees (module docstring, 7)

USER_NAMES = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy")


@dataclass(frozen=True)
class SynthParams:
    """Parameters of a synthetic trace; the defaults describe a 10-engineer team's working day."""

    sessions: int = 10  # sessions alive at a time
    hours: float = 8.0  # trace length
    users: int = 10  # engineers
    arrival_spread_seconds: float = 1800.0  # engineers and session slots start within the first 30 min
    departure_spread_seconds: float = 1800.0  # ... and stop within the last 30 min
    restart_gap_median_seconds: float = 30.0  # pause before a slot opens its next session
    restart_gap_sigma: float = 1.0
    mean_turns_per_session: float = 84.0  # TraceLab full dataset: 357,161 rounds / 4,265 sessions
    max_context_tokens: int = 131_072  # a session ends (compacts) before its history passes this
    tool_gap_median_seconds: float = 8.7  # exp(2.16), TraceLab round-to-round gaps
    tool_gap_sigma: float = 1.11  # log-sd of the same gaps
    human_turn_probability: float = 0.15  # share of turns that wait for the engineer
    human_gap_median_seconds: float = 60.0
    human_gap_sigma: float = 1.2
    min_gap_seconds: float = 0.05
    gap_scale: float = 1.0  # every gap between turns times this: a session offers 1 / gap_scale of the fitted turn rate
    first_input_median_tokens: float = 12_000.0  # system prompt + tools + task
    first_input_sigma: float = 0.6
    turn_input_median_tokens: float = 1_400.0  # tool result or user message
    turn_input_sigma: float = 1.0
    output_median_tokens: float = 280.0
    output_sigma: float = 1.2
    max_output_tokens: int = 8_192
    slo_weights: tuple[float, float, float] = (0.2, 0.6, 0.2)  # blocking, interactive, background (as the demo)
    drift_weight: float = 0.5  # weight of the hour's preference in every transition row
    focus_strength: float = 0.8  # how far the preference leans towards the hour's focus models
    morning_models: tuple[str, ...] = ("coder",)
    afternoon_models: tuple[str, ...] = ("reasoner",)
    handoff_rate: float | None = None  # share of later turns that hand off; None: the hour's chain decides
    context: str = "shared"  # shared: a hand-off sees the session's whole history; fresh: a sub-agent's own

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.users < 1:
            raise ValueError("sessions and users must be at least 1")
        if self.hours <= 0:
            raise ValueError("hours must be positive")
        if not 0 <= self.drift_weight <= 1 or not 0 <= self.focus_strength <= 1:
            raise ValueError("drift_weight and focus_strength must lie in [0, 1]")
        if not self.gap_scale > 0:
            raise ValueError("gap_scale must be positive")
        if not 0 <= self.human_turn_probability <= 1:
            raise ValueError("human_turn_probability must lie in [0, 1]")
        if len(self.slo_weights) != 3 or min(self.slo_weights) < 0 or sum(self.slo_weights) <= 0:
            raise ValueError("slo_weights needs three non-negative weights (blocking, interactive, background)")
        if self.mean_turns_per_session < 1:
            raise ValueError("mean_turns_per_session must be at least 1")
        if self.handoff_rate is not None and not 0 <= self.handoff_rate <= 1:
            raise ValueError("handoff_rate must lie in [0, 1]")
        if self.context not in CONTEXTS:
            raise ValueError(f"context must be one of: {', '.join(CONTEXTS)}")

    @property
    def duration_seconds(self) -> float:
        return self.hours * HOUR_SECONDS


SLO_ORDER = (Slo.BLOCKING, Slo.INTERACTIVE, Slo.BACKGROUND)


def user_names(count: int) -> list[str]:
    return [USER_NAMES[i] if i < len(USER_NAMES) else f"user{i + 1:02d}" for i in range(count)]


def handoff_prior(scenario: Scenario) -> np.ndarray:
    """The scenario's hand-off prior as a row-stochastic matrix over `scenario.models` (in order)."""
    models = [m.id for m in scenario.models]
    index = {m: i for i, m in enumerate(models)}
    n = len(models)
    stay = scenario.predictor.stay_probability
    matrix = np.zeros((n, n))
    for i, model in enumerate(models):
        row = scenario.predictor.handoff.get(model, {})
        for target, weight in row.items():
            matrix[i, index[target]] = weight
        if matrix[i].sum() > 0:
            matrix[i] /= matrix[i].sum()
        elif n == 1:
            matrix[i, i] = 1.0
        else:
            matrix[i, :] = (1 - stay) / (n - 1)  # move uniformly ...
            matrix[i, i] = stay  # ... or stay
    return matrix


def _focus(models: list[str], wanted: tuple[str, ...], fallback: int) -> np.ndarray:
    vector = np.array([1.0 if m in wanted else 0.0 for m in models])
    if vector.sum() == 0:
        vector[fallback] = 1.0
    return vector / vector.sum()


def hourly_preferences(models: list[str], params: SynthParams) -> np.ndarray:
    """pref_h for every hour h of the trace: shape (hours, models), rows sum to 1."""
    hours = max(1, int(np.ceil(params.hours)))
    uniform = np.full(len(models), 1.0 / len(models))
    morning = _focus(models, params.morning_models, 0)
    afternoon = _focus(models, params.afternoon_models, len(models) - 1)
    rows = []
    for h in range(hours):
        f = (h + 0.5) / hours  # 0 at the start of the day, 1 at its end
        focus = (1 - f) * morning + f * afternoon
        rows.append((1 - params.focus_strength) * uniform + params.focus_strength * focus)
    return np.array(rows)


def hourly_transitions(scenario: Scenario, params: SynthParams) -> np.ndarray:
    """P_h for every hour: shape (hours, models, models), rows sum to 1."""
    models = [m.id for m in scenario.models]
    prior = handoff_prior(scenario)
    prefs = hourly_preferences(models, params)
    w = params.drift_weight
    return np.array([(1 - w) * prior + w * pref[np.newaxis, :] for pref in prefs])


@dataclass(frozen=True)
class _User:
    name: str
    arrives_seconds: float
    leaves_seconds: float


class _Generator:
    """One synthetic trace; holds the random stream and the per-user bookkeeping while it runs."""

    def __init__(self, scenario: Scenario, params: SynthParams, rng: np.random.Generator) -> None:
        self.params = params
        self.rng = rng
        self.models = [m.id for m in scenario.models]
        self.prefs = hourly_preferences(self.models, params)
        self.transitions = hourly_transitions(scenario, params)
        self.duration = params.duration_seconds
        self.users = self._draw_users()
        self.live_until: dict[str, list[float]] = {u.name: [] for u in self.users}  # session end times per user
        self.records: list[TraceRecord] = []
        self.session_count = 0

    def _spread(self, spread: float) -> float:
        return float(self.rng.uniform(0, min(spread, self.duration / 2)))

    def _draw_users(self) -> list[_User]:
        users = []
        for name in user_names(self.params.users):
            arrives = self._spread(self.params.arrival_spread_seconds)
            leaves = self.duration - self._spread(self.params.departure_spread_seconds)
            users.append(_User(name, arrives, leaves))
        return users

    def _hour(self, t: float) -> int:
        return min(int(t // HOUR_SECONDS), len(self.prefs) - 1)

    def _lognormal(self, median: float, sigma: float) -> float:
        return float(self.rng.lognormal(np.log(median), sigma))

    def _gap(self) -> float:
        p = self.params
        if self.rng.random() < p.human_turn_probability:
            gap = self._lognormal(p.human_gap_median_seconds, p.human_gap_sigma)
        else:
            gap = self._lognormal(p.tool_gap_median_seconds, p.tool_gap_sigma)
        return max(gap * p.gap_scale, p.min_gap_seconds)

    def _tokens(self, median: float, sigma: float, cap: int | None = None) -> int:
        value = max(1, round(self._lognormal(median, sigma)))
        return min(value, cap) if cap else value

    def _owner(self, t: float) -> str:
        present = [u for u in self.users if u.arrives_seconds <= t < u.leaves_seconds]
        if not present:
            present = [min(self.users, key=lambda u: min(abs(u.arrives_seconds - t), abs(u.leaves_seconds - t)))]
        load = {u.name: sum(1 for end in self.live_until[u.name] if end > t) for u in present}
        fewest = min(load.values())
        candidates = [name for name, n in load.items() if n == fewest]
        return candidates[int(self.rng.integers(len(candidates)))]

    def _next_model(self, model: int, t: float) -> int:
        """The model of a later turn: along the hour's chain, or with `handoff_rate` a hand-off that often."""
        row = self.transitions[self._hour(t)][model]
        rate = self.params.handoff_rate
        if rate is None:
            return int(self.rng.choice(len(self.models), p=row))
        if len(self.models) == 1 or self.rng.random() >= rate:
            return model
        others = row.copy()
        others[model] = 0.0
        if others.sum() <= 0:
            others = np.ones(len(self.models))
            others[model] = 0.0
        return int(self.rng.choice(len(self.models), p=others / others.sum()))

    def session(self, start: float) -> float:
        """Generate one session starting at `start` (with its sub-agents' sessions when `context` is fresh);
        returns the time of its end record."""
        p = self.params
        self.session_count += 1
        sid = f"s{self.session_count:04d}"
        user = self._owner(start)
        slo = SLO_ORDER[int(self.rng.choice(3, p=np.array(p.slo_weights) / sum(p.slo_weights)))]
        turns = int(self.rng.geometric(1.0 / p.mean_turns_per_session))
        model = int(self.rng.choice(len(self.models), p=self.prefs[self._hour(start)]))
        root_model = model
        fresh = p.context == "fresh"
        # the context the turn runs in: (session id, its history tokens); the root's history is kept apart
        context, history, root_history = sid, 0, 0
        subagents = 0
        t = start
        for turn in range(turns):
            parent = None
            first_of_context = turn == 0
            if turn:
                previous, model = model, self._next_model(model, t)
                if fresh and model != previous:
                    if context != sid:  # the sub-agent that handed off is done
                        self.records.append(TraceEnd(t=round(t, 3), session=context, event="end"))
                    else:
                        root_history = history
                    if model == root_model:
                        context, history = sid, root_history  # back to the root, which reads the result
                    else:
                        subagents += 1
                        parent = context
                        context, history, first_of_context = f"{sid}.k{subagents}", 0, True
            if first_of_context:
                new_input = self._tokens(p.first_input_median_tokens, p.first_input_sigma)
            else:
                new_input = self._tokens(p.turn_input_median_tokens, p.turn_input_sigma)
            output = self._tokens(p.output_median_tokens, p.output_sigma, p.max_output_tokens)
            if turn and history + new_input + output > p.max_context_tokens:
                break  # the agent compacts its context into a fresh session
            self.records.append(
                TraceRequest(
                    t=round(t, 3),
                    session=context,
                    model=self.models[model],
                    input_tokens=new_input,
                    output_tokens=output,
                    slo=slo,
                    user=user,
                    parent=parent,
                )
            )
            history += new_input + output
            t += self._gap()
            if t >= self.duration:
                break
        end = round(min(t, self.duration), 3)
        if context != sid:
            self.records.append(TraceEnd(t=end, session=context, event="end"))
        self.records.append(TraceEnd(t=end, session=sid, event="end"))
        self.live_until[user].append(end)
        return end

    def run(self) -> list[TraceRecord]:
        p = self.params
        slots = []  # (next session start, slot, slot stops opening sessions at)
        for slot in range(p.sessions):
            opens = self._spread(p.arrival_spread_seconds)
            stops = self.duration - self._spread(p.departure_spread_seconds)
            slots.append((opens, slot, stops))
        heapq.heapify(slots)
        while slots:
            start, slot, stops = heapq.heappop(slots)
            end = self.session(start)
            following = end + self._lognormal(p.restart_gap_median_seconds, p.restart_gap_sigma)
            if following < stops:
                heapq.heappush(slots, (following, slot, stops))
        self.records.sort(key=lambda r: (r.t, isinstance(r, TraceEnd)))
        return self.records


def handoff_share(records: Sequence[TraceRecord]) -> float:
    """The share of a trace's later turns that change model, within each workflow (a session and the
    sub-agents it handed off to, by `parent`), as the simulator counts hand-offs."""
    last: dict[str, str] = {}
    turns = handoffs = 0
    for workflow, r in by_workflow(records):
        if workflow in last:
            turns += 1
            handoffs += last[workflow] != r.model
        last[workflow] = r.model
    return handoffs / turns if turns else 0.0


def synth_trace(scenario: Scenario, params: SynthParams, rng: np.random.Generator) -> list[TraceRecord]:
    """A time-sorted synthetic agent trace over the scenario's models (see the module docstring)."""
    return _Generator(scenario, params, rng).run()
