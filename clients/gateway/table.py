"""The route table the gateway follows, and the choice of an instance for a request (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from planner_service.wire.routes import Directives, RouteInstance, RoutesOut, RouteState


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

    def choose(self, model: str, session: str, *, exclude: frozenset[str] = frozenset()) -> Choice | None:
        """The session's KV holder where it runs the model, else the running instance the session hashes to
        (so a session without a holder yet keeps landing on one instance); None: none runs."""
        running = self._running.get(model, [])
        candidates = [i for i in running if i.id not in exclude] if exclude else running
        if not candidates:
            return None
        holder = self._kv_holder.get(session)
        for instance in candidates:
            if instance.id == holder:
                return Choice(instance, kv_holder=True)
        return Choice(candidates[_stable_index(session, len(candidates))], kv_holder=False)


def _stable_index(key: str, n: int) -> int:
    """A deterministic spread of sessions over n instances (Python's str hash is salted per process)."""
    h = 2166136261
    for byte in key.encode():  # FNV-1a, 32 bits
        h = ((h ^ byte) * 16777619) & 0xFFFFFFFF
    return h % n
