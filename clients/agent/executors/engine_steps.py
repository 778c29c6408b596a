"""Which engine transition an operation means on a vLLM or SGLang node (pure: no I/O).

An operation that names its step (`Operation.engine`) is that step. One that does not is a promote / demote /
drop of the SRV's vocabulary, read as the transition it means on an engine (DESIGN.md §5, where §5 wins):

    weights or experts  GPU -> host            sleep level 1   (the experts move with the weights)
                        GPU -> NVMe, GPU drop  sleep level 2   (the NVMe copy stays)
                        host -> GPU            wake
                        NVMe -> GPU            wake, or start when the engine is stopped
                        NVMe -> host           read-ahead into the page cache
                        host drop, host->NVMe  nothing once the engine woke (the wake freed its backup); a stop
                                               while it sleeps at level 1 (no call frees that backup alone: the
                                               plan wants the model off the node, and the stop ends the process
                                               that holds it; an adopted engine refuses it)
                        GPU -> host, keeping   refused: an engine keeps a host copy only while it sleeps
    kv                  made by prefill        nothing: the engine computes it on the session's next request
                        GPU drop               nothing: the engine's pool is LRU inside a fixed size
                        with LMCache           nothing: LMCache writes KV through to host and disk as it is
                                               computed, loads it on a prefix hit and evicts by LRU; per-session
                                               pins and warm-ups need the session's token ids (the gateway's)
                        any other move         refused (`RUNTIME_REFUSALS`)
"""

from __future__ import annotations

from dataclasses import dataclass

from clients.agent.errors import PermanentError
from clients.agent.operations import Kind, Operation, Tier
from planner_service.domain.engines import RUNTIME_REFUSALS, EngineState, RuntimeMove, Transition


@dataclass(frozen=True, slots=True)
class Step:
    """A transition to carry out, or none (`transition` None) and why nothing needs doing."""

    transition: Transition | None
    why: str = ""


def step_for(op: Operation, state: EngineState, *, lmcache: bool) -> Step:
    """The step `op` means for an engine observed in `state`; PermanentError when no engine can do it."""
    if op.engine is not None:
        return Step(op.engine.transition)
    if op.object.kind is Kind.KV:
        return _kv_step(op, lmcache=lmcache)
    src = op.source.tier if op.source else None
    dst = op.dest.tier if op.dest else None
    if src is Tier.GPU and dst is Tier.HOST:
        if op.keep_source:
            raise PermanentError(
                f"{op.label()}: an engine keeps its weights in host RAM only while it sleeps, never beside a GPU copy"
            )
        return Step(Transition.SLEEP_LEVEL_1)
    if src is Tier.GPU and dst in (Tier.NVME, None):
        return Step(Transition.SLEEP_LEVEL_2)
    if dst is Tier.GPU and src is Tier.HOST:
        return Step(Transition.WAKE)
    if dst is Tier.GPU and src is Tier.NVME:
        return Step(Transition.START if state is EngineState.STOPPED else Transition.WAKE)
    if src is Tier.NVME and dst is Tier.HOST:
        return Step(Transition.READAHEAD)
    if src is Tier.HOST and dst in (Tier.NVME, None):
        if state is EngineState.ASLEEP_HOST:  # the plan took it for stopped (it planned before the sleep's heartbeat)
            return Step(
                Transition.STOP,
                "the engine sleeps at level 1 and frees its host backup only by waking or ending "
                "(vllm/device_allocator/cumem.py): stopped",
            )
        return Step(None, "the host copy is gone already: the engine's wake freed its backup")
    raise PermanentError(f"{op.label()}: no engine transition moves {op.object.kind.value} this way")


def _kv_step(op: Operation, *, lmcache: bool) -> Step:
    if op.source is None:
        return Step(None, "KV made by prefill: the engine computes it on the session's next request")
    if op.dest is None and op.source.tier is Tier.GPU:
        return Step(None, "the engine's KV pool is LRU inside a fixed size: nothing to free")
    if lmcache:
        return Step(
            None,
            "LMCache tiers KV by itself (written through as computed, loaded on a prefix hit, LRU); a session's "
            "pins and warm-ups go through its token ids (the gateway)",
        )
    raise PermanentError(f"{op.label()}: {RUNTIME_REFUSALS[RuntimeMove.SESSION_KV]}")
