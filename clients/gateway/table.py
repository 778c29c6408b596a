"""The route table the gateway follows, and the choice of an instance for a request (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from planner_service.wire.routes import (
    Directives,
    PinDirective,
    RouteInstance,
    RoutesOut,
    RouteState,
    WarmupDirective,
)


@dataclass(frozen=True, slots=True)
class Choice:
    instance: RouteInstance
    kv_holder: bool  # the instance holds the session's KV (the planner's table says so)


class RouteTable:
    """One fetched `RoutesOut`, indexed for the request path."""

    def __init__(self, routes: RoutesOut) -> None:
        self.routes = routes
        self.epoch = routes.epoch
        self.revision = routes.revision
        self._instances = {m.model: list(m.instances) for m in routes.models}
        self._running = {
            model: [i for i in instances if i.state is RouteState.RUNNING and i.url]
            for model, instances in self._instances.items()
        }
        self._kv_holder = {s.session: s.instance for s in routes.sessions if s.instance is not None}
        self._pinned = {p.session: p.instance for p in routes.directives.pins}
        self._by_id = {i.id: (model, i) for model, instances in self._instances.items() for i in instances}
        self.warmups: list[WarmupDirective] = list(routes.directives.warmups)
        self.pins: list[PinDirective] = list(routes.directives.pins)

    @classmethod
    def empty(cls) -> RouteTable:
        return cls(RoutesOut(epoch=-1, revision="", models=[], sessions=[], directives=Directives()))

    @property
    def models(self) -> list[str]:
        return sorted(self._instances)

    def known(self, model: str) -> bool:
        return model in self._instances

    def running(self, model: str) -> list[RouteInstance]:
        return list(self._running.get(model, []))

    def find(self, instance_id: str) -> tuple[str, RouteInstance] | None:
        """The model an instance serves and the instance, by id; None: not in the table."""
        return self._by_id.get(instance_id)

    def routable(self, model: str, instance_id: str) -> RouteInstance | None:
        """The instance of `model` by id where it runs and has a URL, else None."""
        found = self._by_id.get(instance_id)
        if found is None or found[0] != model:
            return None
        instance = found[1]
        return instance if instance.state is RouteState.RUNNING and instance.url else None

    def choose(self, model: str, session: str, *, exclude: frozenset[str] = frozenset()) -> Choice | None:
        """The session's KV holder where it runs the model, else the instance the plan pins the session to,
        else the running instance the session hashes to (so a session without a holder yet keeps landing on one
        instance); None: none runs."""
        running = self._running.get(model, [])
        candidates = [i for i in running if i.id not in exclude] if exclude else running
        if not candidates:
            return None
        holder = self._kv_holder.get(session)
        pinned = self._pinned.get(session)
        for instance in candidates:
            if instance.id == holder:
                return Choice(instance, kv_holder=True)
        for instance in candidates:
            if instance.id == pinned:
                return Choice(instance, kv_holder=False)
        return Choice(candidates[_stable_index(session, len(candidates))], kv_holder=False)


def _stable_index(key: str, n: int) -> int:
    """A deterministic spread of sessions over n instances (Python's str hash is salted per process)."""
    h = 2166136261
    for byte in key.encode():  # FNV-1a, 32 bits
        h = ((h ^ byte) * 16777619) & 0xFFFFFFFF
    return h % n
