"""The API's vocabulary: every string with a fixed set of values that crosses the wire.

The domain, the planner and the clients import these; nothing here imports the
rest of `planner_service`, so the wire package is the bottom layer.
"""

from __future__ import annotations

from enum import StrEnum


class Kind(StrEnum):
    """The three kinds of LLM state."""

    WEIGHTS = "weights"
    KV = "kv"
    EXPERTS = "experts"


class Tier(StrEnum):
    """Where state can live: a GPU's HBM, a node's host DRAM, a node's NVMe."""

    GPU = "gpu"
    HOST = "host"
    NVME = "nvme"


class Slo(StrEnum):
    BLOCKING = "blocking"
    INTERACTIVE = "interactive"
    BACKGROUND = "background"


class Capability(StrEnum):
    """Moves a node's engines can carry out (DESIGN.md §5)."""

    WEIGHTS_OFFLOAD = "weights_offload"  # whole-model weights GPU <-> host (vLLM sleep level 1)
    PARTIAL_EXPERTS = "partial_experts"  # some routed experts on GPU, the rest off GPU
    KV_OFFLOAD = "kv_offload"  # KV GPU <-> host / NVMe (LMCache, HiCache)


class Action(StrEnum):
    """What an operation does to one state object on one node."""

    PROMOTE = "promote"  # copy towards a faster tier (the source stays), or create KV by prefill
    DEMOTE = "demote"  # move towards a slower tier
    DROP = "drop"  # free the bytes


class Priority(StrEnum):
    """How urgent an operation is: the SLO of the request waiting for it, else prefetch or background."""

    BLOCKING = "blocking"
    INTERACTIVE = "interactive"
    BACKGROUND = "background"
    PREFETCH = "prefetch"


class OperationState(StrEnum):
    """Where a queued operation is in its lifecycle: `queued -> leased -> done | failed`, or `superseded`
    when a newer plan epoch replaces it before it is leased.

    `held_back` is never a stored operation's state: it counts (in the plan's `held_back` and in
    `statebudget_queue_operations`) the moves of the current plan kept out of the queue because the same
    move failed on the node recently.
    """

    QUEUED = "queued"
    LEASED = "leased"
    DONE = "done"
    FAILED = "failed"
    SUPERSEDED = "superseded"
    HELD_BACK = "held_back"


class ReportStatus(StrEnum):
    """A node agent's outcome for a leased operation."""

    DONE = "done"
    FAILED = "failed"


class PlanStatus(StrEnum):
    OK = "ok"  # every active request is served
    PARTIAL = "partial"  # some active requests wait for room (named in `unserved`)
    OPTIMAL = "optimal"  # proved optimal by an exact solver
    FEASIBLE = "feasible"  # an exact solver's incumbent, optimality not proved
    TIMEOUT = "timeout"  # the exact solver ran out of time; the best plan known is returned
    INFEASIBLE = "infeasible"


class SolverName(StrEnum):
    """The planners a plan or a what-if can ask for."""

    GREEDY = "greedy"
    SEARCH = "search"  # the greedy plus a local search over the nodes of models in flight
    MILP = "milp"  # the exact oracle (OR-Tools)


class MilpBackend(StrEnum):
    """The OR-Tools solver behind the MILP oracle (planner_service/solver/backends.py)."""

    CBC = "cbc"  # the default: one process per model variant, first proof wins
    SCIP = "scip"
    CPSAT = "cpsat"


class HealthStatus(StrEnum):
    OK = "ok"
    STARTING = "starting"


class EventStatus(StrEnum):
    """What the service did with one session event."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"  # its id was seen before: acknowledged and ignored


class EventType(StrEnum):
    REQUEST = "request"
    TURN_END = "turn_end"
    TOOL_CALL_START = "tool_call_start"
    TOOL_CALL_END = "tool_call_end"
    SESSION_END = "session_end"


class EngineKind(StrEnum):
    """The inference engine (or cache) a node agent drives."""

    VLLM = "vllm"
    SGLANG = "sglang"
    LMCACHE = "lmcache"
    LOCAL = "local"
    OTHER = "other"


# The engine model's vocabulary (planner_service/domain/engines.py holds the rules and costs).


class EngineFeature(StrEnum):
    """Launch features: flags an engine is started with, fixed until it restarts."""

    LMCACHE = "lmcache"  # vLLM's KV connector is LMCache: KV written through to host RAM and disk
    CPU_BACKUP = "cpu_backup"  # SGLang --enable-weights-cpu-backup: released weights kept in host RAM
    SLEEP_MODE = "sleep_mode"  # vLLM --enable-sleep-mode; SGLang --enable-memory-saver
    DEV_MODE = "dev_mode"  # vLLM VLLM_SERVER_DEV_MODE=1: /sleep, /wake_up, /collective_rpc exist only then


class Management(StrEnum):
    """Who starts and stops an engine."""

    MANAGED = "managed"  # the node agent: every transition its kind offers
    ADOPTED = "adopted"  # someone else: only sleep and wake


class EngineState(StrEnum):
    RUNNING = "running"
    ASLEEP_HOST = "asleep_host"  # level 1: weights in host RAM, KV pool freed
    ASLEEP_DISCARDED = "asleep_discarded"  # level 2: weights and KV discarded
    STOPPED = "stopped"


class Transition(StrEnum):
    START = "start"  # stopped -> running: a cold start of the configuration
    STOP = "stop"  # running or asleep -> stopped
    SLEEP_LEVEL_1 = "sleep_level_1"  # running -> asleep_host
    SLEEP_LEVEL_2 = "sleep_level_2"  # running -> asleep_discarded
    WAKE = "wake"  # asleep -> running (from level 2 with a reload of the weights from disk)
    RESTART = "restart"  # running or asleep -> running with other launch settings: stop, then a cold start
    READAHEAD = "readahead"  # the checkpoint read into the page cache (posix_fadvise WILLNEED); no state change


class Precondition(StrEnum):
    """What a transition can need; `Verdict.missing` names the one that does not hold."""

    KNOWN_KIND = "known_kind"  # the engine model describes the kind
    FROM_STATE = "from_state"  # the transition leaves from the instance's state
    MANAGED = "managed"  # the node agent starts and stops the engine
    SLEEP_MODE = "sleep_mode"
    DEV_MODE = "dev_mode"
    CPU_BACKUP = "cpu_backup"
    NO_CPU_BACKUP = "no_cpu_backup"  # SGLang discards released weights only without a CPU backup
    DRAINED = "drained"  # no request in flight


class EngineStatus(StrEnum):
    """An engine's state as a node agent reports it in its heartbeat, and a simulated model's as it loads."""

    CONFIGURED = "configured"  # known to the agent by its URL; not probed
    LOADING = "loading"  # weights on their way to the GPUs
    WARMING = "warming"  # weights in place, the engine warming up (CUDA graphs, caches)
    READY = "ready"  # serves requests
    AWAKE = "awake"
    SLEEPING = "sleeping"  # weights offloaded or discarded (vLLM sleep mode, SGLang release)
    UNKNOWN = "unknown"  # the agent has not read the engine's state yet


# what a heartbeat's `engines` map says of each engine: its engine-model state (vLLM, SGLang instances the agent
# reads) or a status (engines the agent only knows by URL, the local executor)
ReportedEngineState = EngineState | EngineStatus


class CalibrationScope(StrEnum):
    """What a calibrated bandwidth belongs to: a node (its NVMe) or a GPU (its PCIe directions)."""

    NODES = "nodes"
    GPUS = "gpus"
