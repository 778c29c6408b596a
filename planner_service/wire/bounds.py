"""Physical bounds on every number a client sends: telemetry, reports, events, the cluster and scenarios; and on
the length of the names and ids it sends.

A number outside them is not a measurement but a fault (a stuck clock, a unit
mistake, a counter that wrapped, a fuzzer), and once accepted it does lasting
harm: a bandwidth of 1e308 poisons the calibration that survives restarts, a
byte count of 10**400 overflows the float arithmetic of the cost model. So the
input models refuse it with a 422 that names the field, before the service
sees it. Each ceiling leaves an order of magnitude or more above the largest
hardware shipping today; each floor sits well below the slowest device a cell
would hold. Every float is also finite: JSON `Infinity` and `NaN` (which
Python's json module reads) are refused, since `NaN` passes every `<=` check.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

MIN_BANDWIDTH_BYTES_PER_S = 10**6  # 1 MB/s
"""Slower than a failing hard disk. A lower figure is a stalled copy, not a link: priced as a bandwidth it makes
one promote of a 10 GB model take three hours, and the planner would route around healthy hardware."""

_TB = 10**12  # domain/units.py's TB: the wire package imports nothing above it

MAX_BANDWIDTH_BYTES_PER_S = 10 * _TB  # 10 TB/s
"""Twice the fastest HBM shipping (H200 4.8 TB/s; B200 8 TB/s). No link in a node (PCIe, NVMe, DRAM) moves bytes
faster than a GPU reads its own memory, so a higher figure is a unit mistake or a copy that did not happen."""

MAX_BYTES = 10**15  # 1 PB
"""More than the HBM, DRAM and NVMe of a whole cell; and below 2**53 (9.0e15), so byte counts and sums of a few of
them stay exact when the cost model turns them into floats."""

MAX_GPU_BYTES = 2 * _TB
"""Memory of one GPU: seven times the largest HBM shipping (B300, 288 GB)."""

MAX_SECONDS = 86_400.0  # a day
"""Longer than any copy, wait, horizon or penalty the planner reasons about (it replans every few seconds); a copy
reported to take longer is a stuck clock or a lost lease."""

MIN_FLOPS = 10**9  # 1 GFLOP/s
"""One CPU core does tens of GFLOP/s; a GPU slower than this cannot prefill at all."""

MAX_FLOPS = 10**16  # 10 PFLOP/s
"""Four times a B200's dense BF16 rate (2.25 PFLOP/s)."""

MAX_TOKENS = 100_000_000
"""Tokens of one request or context: a hundred times the longest context windows (1M tokens)."""

MAX_CONTEXT_TOKENS = 10**15
"""Tokens a session has accumulated over all its turns, as the service counts them: far above what a session can
reach (at 100,000 tokens/s, three centuries), so the service's own count never crosses it in earnest."""

MAX_PARAMS = 10**14
"""Parameters of one model: a hundred times the largest open models (about 1T)."""

MAX_TENSOR_PARALLEL = 1024
"""GPUs in one tensor-parallel group; a cell holds tens of GPUs."""

MAX_KV_HEADS = 4096
"""KV heads per layer of one model: past the attention heads of any open model (128 in DeepSeek-V3's config)."""

MAX_WEIGHT = 10**6
"""A dimensionless multiplier or relative frequency (SLO weights, hand-off priors): a million to one is past any
useful ratio, and larger ones make the other terms of the objective vanish in float rounding."""

MAX_CONFIG_MAGNITUDE = 10**15
"""Any number in a model's HF `config.json` (layers, hidden size, vocabulary, rope theta, token ids)."""

MAX_UNIX_SECONDS = 253_402_300_799  # 9999-12-31T23:59:59Z, the last instant a timestamp can show
"""The static ceiling of a timestamp; the service also holds each one within a clock skew of its own clock."""

DEFAULT_MAX_CLOCK_SKEW_SECONDS = 86_400.0
"""How far a client's timestamp may be from the server's clock by default: a day covers a client whose clock is
off by a time zone, and refuses rows at year 9999 that would never be pruned."""

BytesPerSecond = Annotated[
    float, Field(ge=MIN_BANDWIDTH_BYTES_PER_S, le=MAX_BANDWIDTH_BYTES_PER_S, allow_inf_nan=False)
]
ByteCount = Annotated[int, Field(ge=0, le=MAX_BYTES)]
GpuByteCount = Annotated[int, Field(ge=0, le=MAX_GPU_BYTES)]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)]
PositiveSeconds = Annotated[float, Field(gt=0, le=MAX_SECONDS, allow_inf_nan=False)]
FlopsPerSecond = Annotated[float, Field(ge=MIN_FLOPS, le=MAX_FLOPS, allow_inf_nan=False)]
Tokens = Annotated[int, Field(ge=0, le=MAX_TOKENS, description="Tokens (at most 100 million).")]
ContextTokens = Annotated[int, Field(ge=0, le=MAX_CONTEXT_TOKENS)]
ParamCount = Annotated[int, Field(ge=0, le=MAX_PARAMS)]
Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Weight = Annotated[float, Field(ge=0, le=MAX_WEIGHT, allow_inf_nan=False)]
PositiveWeight = Annotated[float, Field(gt=0, le=MAX_WEIGHT, allow_inf_nan=False)]
UnixSeconds = Annotated[float, Field(ge=0, le=MAX_UNIX_SECONDS, allow_inf_nan=False)]

Name = Annotated[str, Field(min_length=1, max_length=200)]
"""An id or name a client sends (a session, a node, a GPU, an engine, a lease)."""
EventId = Name
