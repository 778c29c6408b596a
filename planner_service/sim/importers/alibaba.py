"""Alibaba GenAI 2026 request trace (cluster-trace-v2026-GenAI; ../shared/traces/alibaba_genai_2026/SOURCE.md).

Source: `lora_request_trace.csv` (production Stable-Diffusion serving, one row per request, in time
order): `gmt_create` (second resolution), `groupId` (anonymised user group),
`checkpoint_model_version_id` (anonymised base model), `prompt_length` and
`negative_prompt_length` (characters), `num_images_per_prompt`, `num_inference_steps`, ... The input
may be that CSV, a folder holding it, or a .tar.gz with it (read as a stream, never extracted).

- **Sessions and users.** `groupId` is the user; its requests form a session `G.../k` that ends
  `idle_timeout_seconds` (default 1800 s) after its last request, and a later request of the same
  group opens the next one (k + 1). On the full file this gives 5,904 sessions from 26,823
  requests, 4,018 of them multi-turn (up to 202 requests).
- **Models.** Checkpoints are ranked by request count (ties by id) over the rows read; rank r maps
  onto `models[r % len(models)]` (default: the scenario's models in their order), so the most
  popular checkpoint becomes the first model and the long tail folds onto the catalogue. This
  takes two streaming passes over the source.
- **Tokens.** There are no token counts: `input_tokens = ceil((prompt_length +
  negative_prompt_length) / 4)` (about four characters a token), and `output_tokens =
  num_images_per_prompt * num_inference_steps` (a denoising step is one forward pass, like a
  decoded token). Failed requests are kept: they arrived and needed their model. SLO: interactive.
- `t` counts seconds from the first row; `--limit N` reads the first N rows.
"""

from __future__ import annotations

import csv
import math
import tarfile
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from itertools import islice
from pathlib import Path

from planner_service.domain.scenario import Scenario, Slo
from planner_service.sim.importers.common import IdleSessions, ImportOptions, check_order, pick_models
from planner_service.sim.trace import TraceError, TraceRecord, TraceRequest

FILE = "lora_request_trace.csv"
DEFAULT_IDLE_TIMEOUT_SECONDS = 1800.0
CHARS_PER_TOKEN = 4
COLUMNS = (
    "gmt_create",
    "groupId",
    "checkpoint_model_version_id",
    "prompt_length",
    "negative_prompt_length",
    "num_images_per_prompt",
    "num_inference_steps",
)


@contextmanager
def _open_csv(source: Path) -> Iterator[Iterable[str]]:
    """The request CSV's lines, from a CSV, a folder holding it, or a .tar.gz streamed member by member."""
    if source.is_dir():
        source = source / FILE
    if source.name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(source, "r|gz") as archive:  # a stream: no seeking, nothing extracted
            for member in archive:
                if member.isfile() and Path(member.name).name == FILE:
                    raw = archive.extractfile(member)
                    if raw is not None:
                        yield (line.decode("utf-8") for line in raw)
                        return
        raise TraceError(f"{source}: holds no {FILE}")
    with source.open(newline="") as fh:
        yield fh


def _number(row: dict, column: str) -> float:
    text = (row.get(column) or "").strip()
    return float(text) if text else 0.0


def _rows(source: Path, limit: int | None) -> Iterator[tuple[int, dict]]:
    with _open_csv(source) as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{source}: missing column(s) {', '.join(missing)}")
        for row in islice(reader, limit):
            yield reader.line_num, row


def popularity(source: Path, limit: int | None = None) -> list[str]:
    """Checkpoint ids, most requested first (ties by id), over the first `limit` rows."""
    counts = Counter(row["checkpoint_model_version_id"] for _, row in _rows(source, limit))
    return [ckpt for ckpt, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


class AlibabaImporter:
    def records(self, source: Path, scenario: Scenario, options: ImportOptions) -> Iterator[TraceRecord]:
        models = pick_models(scenario, options.models, [m.id for m in scenario.models])
        rank = {ckpt: r for r, ckpt in enumerate(popularity(source, options.limit))}
        sessions = IdleSessions(options.idle_timeout_seconds or DEFAULT_IDLE_TIMEOUT_SECONDS)
        visits: Counter[str] = Counter()  # group -> sessions opened
        origin: datetime | None = None
        last = 0.0
        for line, row in _rows(source, options.limit):
            try:
                stamp = datetime.fromisoformat(row["gmt_create"])
                chars = _number(row, "prompt_length") + _number(row, "negative_prompt_length")
                steps = _number(row, "num_images_per_prompt") * _number(row, "num_inference_steps")
            except ValueError as error:
                raise TraceError(f"{source} line {line}: {error}") from None
            group = row["groupId"]
            if not group:
                raise TraceError(f"{source} line {line}: groupId is empty")
            origin = origin or stamp
            t = (stamp - origin).total_seconds()
            check_order(t, last, f"{source} line {line}")
            last = t
            yield from sessions.expire(t)
            session = f"{group}/{visits[group]}"
            if not sessions.is_open(session):
                visits[group] += 1
                session = f"{group}/{visits[group]}"
            sessions.touch(session, t)
            yield TraceRequest(
                t=t,
                session=session,
                model=models[rank[row["checkpoint_model_version_id"]] % len(models)],
                input_tokens=math.ceil(chars / CHARS_PER_TOKEN),
                output_tokens=round(steps),
                slo=Slo.INTERACTIVE,
                user=group,
            )
        yield from sessions.close_all()
