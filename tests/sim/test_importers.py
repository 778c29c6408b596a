"""Trace importers: the registry, small inline sources with known answers, synthetic traces in the real formats
(tests/fixtures/make_traces.py) whose sessions are known, the real public traces when ../shared has them, the CLI."""

import json
import tarfile
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
from fixtures.make_traces import Session
from typer.testing import CliRunner

from planner_service.cli import app
from planner_service.domain.demo import demo_scenario
from planner_service.domain.scenario import Slo
from planner_service.sim.importers import ImporterRegistry, ImportOptions, TraceFormat, default_registry
from planner_service.sim.importers.alibaba import popularity
from planner_service.sim.importers.azure import default_models
from planner_service.sim.importers.mooncake import model_of
from planner_service.sim.synth import SynthParams, synth_trace
from planner_service.sim.trace import TraceEnd, TraceError, TraceRequest, read_trace, write_trace_stream

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
SCENARIO = demo_scenario()
MODELS = [m.id for m in SCENARIO.models]
LIMIT = 3000


def run(fmt: str, source: Path, tmp_path: Path, **options) -> list:
    """Import, write and read back: the output is valid and sorted, or this raises."""
    records = default_registry().get(fmt).records(source, SCENARIO, ImportOptions(**options))
    path = tmp_path / f"{fmt}.jsonl"
    write_trace_stream(path, records)
    return read_trace(path)


def requests(records) -> list[TraceRequest]:
    return [r for r in records if isinstance(r, TraceRequest)]


def check_sessions_end_once(records) -> None:
    ends = Counter(r.session for r in records if isinstance(r, TraceEnd))
    assert set(ends) == {r.session for r in records} and set(ends.values()) == {1}
    ended: set[str] = set()
    for record in records:
        assert record.session not in ended
        if isinstance(record, TraceEnd):
            ended.add(record.session)


def compact(records) -> list[tuple]:
    rows = []
    for r in records:
        if isinstance(r, TraceEnd):
            rows.append((r.t, r.session, "end"))
        else:
            rows.append((r.t, r.session, r.model, r.input_tokens, r.output_tokens))
    return rows


# --- the registry -------------------------------------------------------------------------------


def test_registry_names_unknown_and_twice() -> None:
    registry = default_registry()
    assert registry.names() == sorted(TraceFormat) == ["alibaba", "azure", "mooncake"]
    with pytest.raises(ValueError, match="unknown trace format 'csv'; choose one of: alibaba, azure, mooncake"):
        registry.get("csv")
    with pytest.raises(ValueError, match="registered already"):
        registry.register(TraceFormat.AZURE, registry.get("azure"))
    assert ImporterRegistry().names() == []


# --- Azure ----------------------------------------------------------------------------------------

AZURE_CONV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:00:00.0000000,100,10
2023-11-16 18:00:05.0000000,50,5
2023-11-16 18:00:10.0000000,300,20
2023-11-16 18:05:00.0000000,400,1
"""
AZURE_CODE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:00:02.5000000,1000,3
"""


@pytest.fixture
def azure_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "azure"
    folder.mkdir()
    (folder / "AzureLLMInferenceTrace_conv.csv").write_text(AZURE_CONV)
    (folder / "AzureLLMInferenceTrace_code.csv").write_text(AZURE_CODE)
    return folder


def test_azure_merges_services_and_derives_sessions_by_containment(azure_dir: Path, tmp_path: Path) -> None:
    assert default_models(SCENARIO) == ["coder", "planner"]
    records = run("azure", azure_dir, tmp_path)
    assert compact(records) == [
        (0.0, "conv-1", "planner", 100, 10),
        (2.5, "code-1", "coder", 1000, 3),
        (5.0, "conv-2", "planner", 50, 5),  # 50 < 110: cannot hold conv-1, a new session
        (10.0, "conv-1", "planner", 190, 20),  # the longest history (110) that fits in 300
        (122.5, "code-1", "end"),  # idle for 120 s
        (125.0, "conv-2", "end"),
        (130.0, "conv-1", "end"),
        (300.0, "conv-3", "planner", 400, 1),
        (420.0, "conv-3", "end"),
    ]
    assert {r.slo for r in requests(records) if r.session.startswith("code")} == {Slo.BLOCKING}
    assert {r.slo for r in requests(records) if r.session.startswith("conv")} == {Slo.INTERACTIVE}


def test_azure_options_single_file_and_limit(azure_dir: Path, tmp_path: Path) -> None:
    conv = azure_dir / "AzureLLMInferenceTrace_conv.csv"
    records = run("azure", conv, tmp_path, limit=2, models=("vision", "air"), idle_timeout_seconds=1000)
    assert compact(records) == [
        (0.0, "conv-1", "air", 100, 10),
        (5.0, "conv-2", "air", 50, 5),
        (1000.0, "conv-1", "end"),
        (1005.0, "conv-2", "end"),
    ]
    with pytest.raises(ValueError, match="unknown model"):
        run("azure", conv, tmp_path, models=("gpt-5",))


def test_azure_bad_sources(tmp_path: Path) -> None:
    other = tmp_path / "trace.csv"
    other.write_text(AZURE_CONV)
    with pytest.raises(TraceError, match="'code' or 'conv'"):
        run("azure", other, tmp_path)
    bad = tmp_path / "bad_conv.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,12,3\n2023-11-16 18:00:01,many,3\n")
    with pytest.raises(TraceError, match="bad_conv.csv line 3"):
        run("azure", bad, tmp_path)
    unsorted = tmp_path / "unsorted_conv.csv"
    unsorted.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:09,12,3\n2023-11-16 18:00:01,12,3\n")
    with pytest.raises(TraceError, match="unsorted_conv.csv line 3: time -8.0 goes back"):
        run("azure", unsorted, tmp_path)


# --- Mooncake -------------------------------------------------------------------------------------

MOONCAKE = [
    {"timestamp": 0, "input_length": 1000, "output_length": 100, "hash_ids": [0, 1]},
    {"timestamp": 1000, "input_length": 1500, "output_length": 50, "hash_ids": [0, 2]},  # shares only block 0
    {"timestamp": 2000, "input_length": 1600, "output_length": 10, "hash_ids": [0, 1, 3, 4]},
    {"timestamp": 3000, "input_length": 2000, "output_length": 10, "hash_ids": [0, 1, 3, 5]},
    {"timestamp": 900000, "input_length": 600, "output_length": 10, "hash_ids": [0, 2, 7]},  # mc-2 ended by then
]


def test_mooncake_sessions_from_shared_leading_blocks(tmp_path: Path) -> None:
    source = tmp_path / "conversation_trace.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in MOONCAKE))
    records = run("mooncake", tmp_path, tmp_path)  # a folder reads its conversation_trace.jsonl
    m1, m2, m3 = (model_of(f"mc-{i}", MODELS) for i in (1, 2, 3))
    assert compact(records) == [
        (0.0, "mc-1", m1, 1000, 100),
        (1.0, "mc-2", m2, 1500, 50),
        (2.0, "mc-1", m1, 500, 10),  # 1600 - the 1100 tokens mc-1 holds
        (3.0, "mc-1", m1, 390, 10),
        (601.0, "mc-2", "end"),  # idle for 600 s
        (603.0, "mc-1", "end"),
        (900.0, "mc-3", m3, 600, 10),
        (1500.0, "mc-3", "end"),
    ]
    assert len({model_of(f"mc-{i}", MODELS) for i in range(1, 200)}) == len(MODELS)  # spread over the catalogue


def test_handoffs_follow_the_scenario_chain_deterministically(tmp_path: Path) -> None:
    source = tmp_path / "conversation_trace.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in MOONCAKE))
    plain = requests(run("mooncake", tmp_path, tmp_path))
    chained = requests(run("mooncake", tmp_path, tmp_path, handoffs=True))
    again = requests(run("mooncake", tmp_path, tmp_path, handoffs=True))
    assert [r.model for r in chained] == [r.model for r in again]  # seeded by session id
    assert [(r.t, r.session, r.input_tokens) for r in chained] == [(r.t, r.session, r.input_tokens) for r in plain]
    first = {}
    for plain_r, chained_r in zip(plain, chained, strict=True):
        if plain_r.session not in first:  # a session's first turn keeps the importer's model
            first[plain_r.session] = True
            assert chained_r.model == plain_r.model
    prior = SCENARIO.predictor.handoff
    previous = {}
    for r in chained:  # every move is one the scenario's prior allows
        if r.session in previous and previous[r.session] in prior:
            assert r.model in prior[previous[r.session]]
        previous[r.session] = r.model


def test_mooncake_malformed_line(tmp_path: Path) -> None:
    source = tmp_path / "trace.jsonl"
    source.write_text(json.dumps(MOONCAKE[0]) + "\n" + '{"timestamp": 5, "input_length": 3}\n')
    with pytest.raises(TraceError, match="line 2: missing field\\(s\\) output_length, hash_ids"):
        run("mooncake", source, tmp_path)


# --- Alibaba --------------------------------------------------------------------------------------

ALIBABA_HEADER = (
    "gmt_create,predict_type,predict_status,exec_time_seconds,groupId,prompt_length,negative_prompt_length,"
    "num_images_per_prompt,num_inference_steps,checkpoint_model_version_id,num_lora"
)
ALIBABA = (
    ALIBABA_HEADER
    + """
2024-11-15 16:00:00,TXT_2_IMG,SUCCEED,32.0,G1,63.0,26.0,1.0,30.0,M9,0
2024-11-15 16:00:10,TXT_2_IMG,SUCCEED,20.0,G2,10.0,,4.0,30.0,M5,0
2024-11-15 16:01:00,TXT_2_IMG,FAILED,1.0,G1,,,1.0,20.0,M5,0
2024-11-15 17:00:00,IMG_2_IMG,SUCCEED,9.0,G1,4.0,4.0,2.0,25.0,M5,1
"""
)
ALIBABA_EXPECTED = [
    (0.0, "G1/1", "coder", 23, 30),  # M9, second most requested -> the second model; ceil(89 chars / 4)
    (10.0, "G2/1", "planner", 3, 120),  # M5, most requested -> the first model; 4 images x 30 steps
    (60.0, "G1/1", "planner", 0, 20),
    (1810.0, "G2/1", "end"),
    (1860.0, "G1/1", "end"),
    (3600.0, "G1/2", "planner", 2, 50),  # G1 was idle for 59 min: its next session
    (5400.0, "G1/2", "end"),
]


def test_alibaba_groups_popularity_and_tokens(tmp_path: Path) -> None:
    source = tmp_path / "lora_request_trace.csv"
    source.write_text(ALIBABA)
    assert popularity(source) == ["M5", "M9"]
    records = run("alibaba", source, tmp_path)
    assert compact(records) == ALIBABA_EXPECTED
    assert {r.user for r in requests(records)} == {"G1", "G2"}
    folded = run("alibaba", source, tmp_path, models=("air",), limit=2)
    assert [r.model for r in requests(folded)] == ["air", "air"]  # the long tail folds onto the catalogue


def test_alibaba_reads_a_tarball_as_a_stream(tmp_path: Path) -> None:
    source = tmp_path / "lora_request_trace.csv"
    source.write_text(ALIBABA)
    archive = tmp_path / "trace.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source, arcname="cluster-trace-v2026-GenAI/lora_request_trace.csv")
    assert compact(run("alibaba", archive, tmp_path)) == ALIBABA_EXPECTED
    empty = tmp_path / "empty.tar.gz"
    with tarfile.open(empty, "w:gz"):
        pass
    with pytest.raises(TraceError, match="holds no lora_request_trace.csv"):
        run("alibaba", empty, tmp_path)


def test_alibaba_missing_columns(tmp_path: Path) -> None:
    source = tmp_path / "x.csv"
    source.write_text("gmt_create,groupId\n2024-11-15 16:00:00,G1\n")
    with pytest.raises(TraceError, match="missing column"):
        run("alibaba", source, tmp_path)


# --- synthetic traces in the real formats (tests/fixtures/make_traces.py), with the sessions they hold --------


def observed(records) -> dict[str, tuple[list[tuple], list[float]]]:
    """session -> (its requests as (t, model, input, output, slo, user), the times of its end records)."""
    sessions: dict[str, tuple[list[tuple], list[float]]] = defaultdict(lambda: ([], []))
    for r in records:
        if isinstance(r, TraceEnd):
            sessions[r.session][1].append(r.t)
        else:
            sessions[r.session][0].append((r.t, r.model, r.input_tokens, r.output_tokens, r.slo, r.user))
    return dict(sessions)


def expected(truth: list[Session], model, slo, user=lambda session: None, limit: int | None = None):
    """What `observed` must give for the generated sessions, over the first `limit` source rows."""
    out = {}
    for session in truth:
        turns = [turn for turn in session.turns if limit is None or turn.row < limit]
        if turns:
            last = round(turns[-1].t + session.timeout_seconds, 3)
            rows = [
                (t.t, model(session, t), t.input_tokens, t.output_tokens, slo(session), user(session)) for t in turns
            ]
            out[session.id] = (rows, [last])
    return out


def check_time_order(records) -> None:
    times = [r.t for r in records]
    assert times == sorted(times)


AZURE_MODELS = {"code": "coder", "conv": "planner"}
AZURE_SLOS = {"code": Slo.BLOCKING, "conv": Slo.INTERACTIVE}


def service(session: Session) -> str:
    return session.id.split("-")[0]


@pytest.mark.parametrize("limit", [None, 100])
def test_synthetic_azure_sessions_are_recovered_by_containment(synthetic_traces, tmp_path: Path, limit) -> None:
    folder, truth = synthetic_traces
    records = run("azure", folder / "azure_llm_2023", tmp_path, limit=limit)
    check_time_order(records)
    check_sessions_end_once(records)
    want = expected(truth.azure, lambda s, _: AZURE_MODELS[service(s)], lambda s: AZURE_SLOS[service(s)], limit=limit)
    assert observed(records) == want
    assert len(requests(records)) == (limit or truth.azure_rows)
    multi_turn = [s for s in truth.azure if len(s.turns) > 1]
    assert len(multi_turn) > len(truth.azure) / 2  # the fixture exercises containment, not only first turns


@pytest.mark.parametrize("limit", [None, 200])
def test_synthetic_mooncake_sessions_follow_shared_leading_blocks(synthetic_traces, tmp_path: Path, limit) -> None:
    folder, truth = synthetic_traces
    records = run("mooncake", folder / "mooncake_fast25", tmp_path, limit=limit)
    check_time_order(records)
    check_sessions_end_once(records)
    want = expected(truth.mooncake, lambda s, _: model_of(s.id, MODELS), lambda _: Slo.INTERACTIVE, limit=limit)
    assert observed(records) == want
    assert {r.model for r in requests(records)} == set(MODELS)  # the sessions spread over the whole catalogue


def test_synthetic_mooncake_handoffs_keep_times_and_tokens(synthetic_traces, tmp_path: Path) -> None:
    folder, _ = synthetic_traces
    plain = requests(run("mooncake", folder / "mooncake_fast25", tmp_path))
    chained = requests(run("mooncake", folder / "mooncake_fast25", tmp_path, handoffs=True))
    assert [(r.t, r.session, r.input_tokens, r.output_tokens) for r in chained] == [
        (r.t, r.session, r.input_tokens, r.output_tokens) for r in plain
    ]
    prior = SCENARIO.predictor.handoff
    previous: dict[str, str] = {}
    for p, c in zip(plain, chained, strict=True):
        if c.session not in previous:
            assert c.model == p.model  # a session's first turn keeps the importer's model
        elif previous[c.session] in prior:
            assert c.model in prior[previous[c.session]]  # every move is one the scenario's prior allows
        previous[c.session] = c.model
    assert sum(p.model != c.model for p, c in zip(plain, chained, strict=True)) > 0  # some turns hand off


def want_rows(want: dict, group: str) -> list[tuple]:
    return [row for sid, (rows, _) in want.items() if sid.split("/")[0] == group for row in rows]


def checkpoint_models(truth: list[Session], limit: int | None = None) -> dict[str, str]:
    """Checkpoints ranked by their requests in the rows read (ties by id), folded onto the catalogue."""
    counts = Counter(t.checkpoint for s in truth for t in s.turns if limit is None or t.row < limit)
    ranked = sorted(counts, key=lambda ckpt: (-counts[ckpt], ckpt))
    return {ckpt: MODELS[rank % len(MODELS)] for rank, ckpt in enumerate(ranked)}


@pytest.mark.parametrize("limit", [None, 150])
def test_synthetic_alibaba_groups_visits_and_checkpoints(synthetic_traces, tmp_path: Path, limit) -> None:
    folder, truth = synthetic_traces
    source = folder / "alibaba_genai_2026"
    records = run("alibaba", source, tmp_path, limit=limit)
    check_time_order(records)
    check_sessions_end_once(records)
    models = checkpoint_models(truth.alibaba, limit)
    assert len(models) > len(MODELS)  # more checkpoints than models: the tail folds
    want = expected(
        truth.alibaba,
        lambda _, turn: models[turn.checkpoint],
        lambda _: Slo.INTERACTIVE,
        user=lambda s: s.id.split("/")[0],
        limit=limit,
    )
    assert observed(records) == want
    assert popularity(source, limit) == list(models)  # most requested first
    switching = [
        g for g in {s.id.split("/")[0] for s in truth.alibaba} if len({m for _, m, *_ in want_rows(want, g)}) > 1
    ]
    assert switching  # some groups switch models: the fixture exercises the per-request mapping


# --- extra checks on the real public traces (skipped when ../shared/traces is absent) ---------------------


def real(folder: str) -> Path:
    path = TRACES / folder
    if not path.exists():
        pytest.skip(f"{path} is not here")
    return path


def test_real_azure(tmp_path: Path) -> None:
    records = run("azure", real("azure_llm_2023"), tmp_path, limit=LIMIT)
    reqs = requests(records)
    assert len(reqs) == LIMIT
    check_sessions_end_once(records)
    for r in reqs:
        service = r.session.split("-")[0]
        assert (r.model, r.slo) == {"code": ("coder", Slo.BLOCKING), "conv": ("planner", Slo.INTERACTIVE)}[service]
    turns = Counter(r.session for r in reqs)
    assert {s.split("-")[0] for s in turns} == {"code", "conv"}
    assert sum(1 for n in turns.values() if n > 1) > 100  # containment chains conversations


def test_real_mooncake(tmp_path: Path) -> None:
    records = run("mooncake", real("mooncake_fast25"), tmp_path, limit=LIMIT)
    reqs = requests(records)
    assert len(reqs) == LIMIT
    check_sessions_end_once(records)
    assert all(r.model == model_of(r.session, MODELS) for r in reqs)
    assert {r.model for r in reqs} == set(MODELS)
    turns = Counter(r.session for r in reqs)
    assert LIMIT / 3 < len(turns) < LIMIT and max(turns.values()) > 5


def test_real_alibaba(tmp_path: Path) -> None:
    source = real("alibaba_genai_2026")
    records = run("alibaba", source, tmp_path, limit=LIMIT)
    reqs = requests(records)
    assert len(reqs) == LIMIT
    check_sessions_end_once(records)
    assert all(r.session.split("/")[0] == r.user for r in reqs)
    ranked = popularity(source, LIMIT)
    assert len(ranked) > len(MODELS)  # more checkpoints than models: the tail folds
    per_model = Counter(r.model for r in reqs)
    assert per_model.most_common(1)[0][0] == MODELS[0]  # the most popular checkpoint (and its fold)
    groups = defaultdict(set)
    for r in reqs:
        groups[r.user].add(r.model)
    assert sum(1 for models in groups.values() if len(models) > 1) > 10  # groups switch models


# --- the command line -----------------------------------------------------------------------------


def test_cli_trace_synth(tmp_path: Path) -> None:
    runner = CliRunner()
    paths = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for path in paths:
        args = ["trace", "synth", "--sessions", "3", "--hours", "1", "--seed", "5", "--out", str(path), "--json"]
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["requests"] == len(requests(read_trace(paths[1]))) > 0
    assert paths[0].read_bytes() == paths[1].read_bytes()
    result = runner.invoke(app, ["trace", "synth", "--sessions", "0", "--out", str(paths[0])])
    assert result.exit_code == 2 and "sessions" in result.output


def test_cli_trace_synth_takes_the_load_and_hand_off_options(tmp_path: Path) -> None:
    """`study seeds`'s gap scale, hand-off rate and context semantics reach `trace synth`'s trace."""
    runner = CliRunner()
    path = tmp_path / "fresh.jsonl"
    args = ["trace", "synth", "--sessions", "3", "--hours", "1", "--seed", "5", "--gap-scale", "8"]
    result = runner.invoke(app, [*args, "--handoff-rate", "0.5", "--context", "fresh", "--out", str(path)])
    assert result.exit_code == 0, result.output
    params = SynthParams(sessions=3, hours=1, gap_scale=8, handoff_rate=0.5, context="fresh")
    expected = synth_trace(demo_scenario(), params, np.random.default_rng(5))
    assert requests(read_trace(path)) == requests(expected)
    assert any(r.parent for r in requests(expected))  # fresh sub-agents name the session that handed off
    for bad, field in (("--context", "context"), ("--handoff-rate", "handoff_rate")):
        result = runner.invoke(app, [*args, bad, "2" if field == "handoff_rate" else "own", "--out", str(path)])
        assert result.exit_code == 2 and field in result.output


def test_cli_trace_import(azure_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "out.jsonl"
    args = ["trace", "import", "--input", str(azure_dir), "--out", str(out)]
    result = runner.invoke(app, [*args, "--format", "azure", "--limit", "3", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["requests"] == 3 == len(requests(read_trace(out)))
    result = runner.invoke(app, [*args, "--format", "parquet"])
    assert result.exit_code == 2
    assert all(name in " ".join(result.output.split()) for name in ("alibaba", "azure", "mooncake"))
    nowhere = ["trace", "import", "--format", "azure", "--input", str(tmp_path / "nowhere"), "--out", str(out)]
    result = runner.invoke(app, nowhere)
    assert result.exit_code == 2 and "no such file" in " ".join(result.output.split())  # rich wraps lines
