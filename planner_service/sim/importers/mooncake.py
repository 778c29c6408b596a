"""Mooncake (Kimi) FAST'25 conversation trace (../shared/traces/mooncake_fast25/SOURCE.md).

Source: JSON Lines with `timestamp` (ms from the trace start), `input_length`, `output_length` and
`hash_ids` (remapped hashes of the prompt's 512-token blocks; equal leading ids mean a shared
prefix). A directory input reads its `conversation_trace.jsonl`.

- **Sessions.** There is no session id. A request continues the session of the latest earlier
  request with which it shares the longest run of leading blocks, if that run is at least
  `min_shared_blocks` long (default 2: every request starts with block 0, the common system
  prompt, so one shared block says nothing) and that session is still open; otherwise it opens a
  new session `mc-N`. A session ends `idle_timeout_seconds` (default 600 s) after its last request.
  On the full conversation trace this gives 7,624 sessions from 12,031 requests, 2,154 of them
  multi-turn (up to 43 turns).
- **Models.** Each session stays on one model: `models[crc32(session id) % len(models)]`, over the
  given models or by default all of the scenario's (a deterministic, roughly even spread). With
  `--handoffs` that is only its first turn's model; later turns follow the scenario's hand-off
  chain (`common.HandoffChain`).
- **Tokens.** `input_tokens = input_length - history` (what the prompt adds to the session's input
  and output so far; 0 if shorter), `output_tokens = output_length`. SLO: interactive (a chat).
- `--limit N` reads the first N requests.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

from planner_service.domain.scenario import Scenario, Slo
from planner_service.sim.importers.common import (
    HandoffChain,
    IdleSessions,
    ImportOptions,
    check_order,
    new_input_tokens,
    pick_models,
)
from planner_service.sim.trace import TraceError, TraceRecord, TraceRequest

FILE = "conversation_trace.jsonl"
DEFAULT_IDLE_TIMEOUT_SECONDS = 600.0
MIN_SHARED_BLOCKS = 2
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def model_of(session: str, models: list[str]) -> str:
    return models[zlib.crc32(session.encode()) % len(models)]


class _PrefixTree:
    """Block-hash prefixes seen so far; each node remembers the latest session through it."""

    def __init__(self) -> None:
        self.root: dict[int, list] = {}  # block -> [session, children]

    def longest_match(self, blocks: list[int]) -> tuple[int, str | None]:
        depth, session, children = 0, None, self.root
        for block in blocks:
            node = children.get(block)
            if node is None:
                break
            depth, session, children = depth + 1, node[0], node[1]
        return depth, session

    def insert(self, blocks: list[int], session: str) -> None:
        children = self.root
        for block in blocks:
            node = children.get(block)
            if node is None:
                node = children[block] = [session, {}]
            node[0] = session
            children = node[1]


def _rows(path: Path) -> Iterator[tuple[int, dict]]:
    with path.open() as fh:
        for line, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as error:
                raise TraceError(f"{path} line {line}: not JSON: {error.msg}") from None
            missing = [f for f in FIELDS if f not in row]
            if missing:
                raise TraceError(f"{path} line {line}: missing field(s) {', '.join(missing)}")
            yield line, row


class MooncakeImporter:
    def __init__(self, min_shared_blocks: int = MIN_SHARED_BLOCKS) -> None:
        self.min_shared_blocks = min_shared_blocks

    def records(self, source: Path, scenario: Scenario, options: ImportOptions) -> Iterator[TraceRecord]:
        path = source / FILE if source.is_dir() else source
        models = pick_models(scenario, options.models, [m.id for m in scenario.models])
        sessions = IdleSessions(options.idle_timeout_seconds or DEFAULT_IDLE_TIMEOUT_SECONDS)
        tree = _PrefixTree()
        history: dict[str, int] = {}
        chain = HandoffChain(scenario) if options.handoffs else None
        opened, last = 0, 0.0
        for line, row in islice(_rows(path), options.limit):
            try:
                t = round(float(row["timestamp"]) / 1000, 3)  # ms -> s
                prompt, output = int(row["input_length"]), int(row["output_length"])
                blocks = [int(b) for b in row["hash_ids"]]
            except (TypeError, ValueError) as error:
                raise TraceError(f"{path} line {line}: {error}") from None
            check_order(t, last, f"{path} line {line}")
            last = t
            yield from sessions.expire(t)
            depth, session = tree.longest_match(blocks)
            if depth < self.min_shared_blocks or session is None or not sessions.is_open(session):
                opened += 1
                session = f"mc-{opened}"
                history[session] = 0
            new_input = new_input_tokens(prompt, history[session])
            history[session] += new_input + output
            tree.insert(blocks, session)
            sessions.touch(session, t)
            model = model_of(session, models)
            yield TraceRequest(
                t=t,
                session=session,
                model=chain.model(session, model) if chain else model,
                input_tokens=new_input,
                output_tokens=output,
                slo=Slo.INTERACTIVE,
            )
        yield from sessions.close_all()
