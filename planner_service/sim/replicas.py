"""Several engine instances of one model in a replay, and how the gateway picks one for a request.

A team that runs its busiest model on two engines (each a whole copy on a group of its own) routes each
request to one of them. The replay gives every instance after the first a model id of its own (`coder:2`;
the first keeps the model's id) with the model's preset, limits and precisions, its engine declaration on
every node that declares the model, its checkpoint where the model's lies on NVMe, and the model's row of
the hand-off prior. Every policy then places, wakes and evicts it as it does any model, and a session's KV
on one instance is not on the other, as on real engines (vLLM's and SGLang's prefix caches are per engine).

Which instance a request goes to is the gateway's choice (`route`):

* **without affinity** (`GatewayMode.NONE`), a load balancer that keeps no session state: the instance with
  the fewest requests waiting or running, ties drawn at random (seeded);
* **with affinity** (every other mode), the instance that holds the session's KV on its GPUs, or that its
  last request of the model went to while that request still waits or runs, where that instance is up or
  coming up; else the same least-loaded choice. (The product's gateway hashes a session without a holder
  onto a running instance, `clients/gateway/table.py`; the replay gives both arms one fallback so that
  they differ by the affinity alone.)

A trace names models as the team knows them: the choice is made as each request arrives, and a hand-off is
still a change of the model the trace names, not of the instance.

The instances of a model on one node share LMCache's host tier, as they do where the node runs LMCache as
one server its engines connect to (its multi-process mode, which vLLM's examples/disaggregated/lmcache
README recommends "for sharing KV cache across instances"; in-process LMCache keeps a tier per engine): a
request sent away from its KV on the same node restores what the other instance wrote through, where that
is cheaper than prefilling it (`Simulator._host_covered`). What the replay leaves out: the page cache, which
two instances on one node share and the replay keeps per instance (each reads its checkpoint from NVMe).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from planner_service.domain.scenario import Scenario, parse_scenario
from planner_service.domain.state import StateObject

if TYPE_CHECKING:
    from planner_service.sim.state import SessionState, SimState

SEPARATOR = ":"


def instance_ids(model: str, copies: int) -> tuple[str, ...]:
    """The model ids of a model's `copies` instances in the replay: the model's own, then `model:2`, ..."""
    return (model, *(f"{model}{SEPARATOR}{k}" for k in range(2, copies + 1)))


def replicate(scenario: Scenario, copies: Mapping[str, int]) -> Scenario:
    """The scenario with `copies[m]` instances of each model m (module doc); the others as they are."""
    models = {m.id for m in scenario.models}
    for model, n in copies.items():
        if model not in models:
            raise ValueError(f"replicas: {model!r} is not a model of the scenario ({', '.join(sorted(models))})")
        if n < 1:
            raise ValueError(f"replicas: {model}: at least 1 instance, got {n}")
    extra = {m: instance_ids(m, n)[1:] for m, n in copies.items() if n > 1}
    if not extra:
        return scenario
    clash = sorted({x for ids in extra.values() for x in ids} & models)
    if clash:
        raise ValueError(f"replicas: the scenario already has a model named {', '.join(clash)}")
    data = scenario.model_dump(mode="json")
    data["models"] += [{**m, "id": x} for m in data["models"] for x in extra.get(m["id"], ())]
    for node in data["cluster"]["nodes"]:
        if node.get("engines") is not None:
            node["engines"] += [{**e, "model": x} for e in node["engines"] for x in extra.get(e["model"], ())]
    data["residency"] += [
        {**r, "object": {**r["object"], "model": x}}
        for r in data["residency"]
        if r["object"]["kind"] != "kv" and r["location"]["tier"] == "nvme"
        for x in extra.get(r["object"]["model"], ())
    ]
    handoff = data["predictor"]["handoff"]
    handoff.update({x: dict(handoff[m]) for m, ids in extra.items() if m in handoff for x in ids})
    return parse_scenario(data)


class Router:
    """The gateway's choice of an instance for each request (module doc)."""

    def __init__(self, sim: SimState, copies: Mapping[str, int], affinity: bool, seed: int) -> None:
        self.sim = sim
        self.affinity = affinity
        self.instances = {m: instance_ids(m, n) for m, n in copies.items() if n > 1}
        self.model_of = {x: m for m, ids in self.instances.items() for x in ids}
        self.rng = np.random.default_rng(seed)
        self.routed = 0  # requests of a model with several instances
        self.with_holder = 0  # of them, those whose session's KV an instance up held (module doc)
        self.to_holder = 0  # of those, sent to that instance

    def siblings(self, instance: str) -> tuple[str, ...]:
        """Every instance of the instance's model, itself first."""
        ids = self.instances.get(self.model(instance))
        return (instance,) if ids is None else (instance, *(x for x in ids if x != instance))

    def model(self, instance: str) -> str:
        """The model an instance serves (the model itself where it has one instance)."""
        return self.model_of.get(instance, instance)

    def route(self, session: SessionState, model: str) -> str:
        """The instance a request of `session` for `model` goes to."""
        ids = self.instances.get(model)
        if ids is None:
            return model
        self.routed += 1
        holder = self._holder(session.id, ids)
        if holder is not None and self.affinity:
            chosen = holder
        else:
            load = [self.sim.demand[x] for x in ids]
            least = [x for x, n in zip(ids, load, strict=True) if n == min(load)]
            chosen = least[int(self.rng.integers(len(least)))] if len(least) > 1 else least[0]
        self.with_holder += holder is not None
        self.to_holder += holder is not None and chosen == holder
        return chosen

    def _holder(self, session_id: str, ids: tuple[str, ...]) -> str | None:
        """The instance up or coming up that holds the session's KV on its GPUs (the most of it), else the one
        its last request of the model went to while that request waits or runs."""
        sim = self.sim
        up = [x for x in ids if x in sim.models]
        tokens = {x: sim.gpu_tokens.get(StateObject.kv(x, session_id), 0) for x in up}
        best = max(up, key=lambda x: tokens[x], default=None)
        if best is not None and tokens[best] > 0:
            return best
        request = sim.sessions[session_id].request
        if request is not None and request.model in up:
            return request.model
        return None

    def to_json(self) -> dict[str, int]:
        return {"routed": self.routed, "routed_with_kv_holder": self.with_holder, "routed_to_kv_holder": self.to_holder}
