"""The access log of `statebudget serve` never holds a credential a client put in the URL."""

from __future__ import annotations

import logging
import logging.config
from collections.abc import Iterator

import pytest
from uvicorn.logging import AccessFormatter

from planner_service.cli import REDACTED, RedactCredentials, serve_log_config
from planner_service.settings import Settings

TOKEN = "op-secret/+7f3a"  # characters that percent-encoding changes


def access_line(path: str, tokens: tuple[str, ...] = ()) -> str:
    """The line uvicorn writes for a request (its own message, arguments and formatter), after the filter."""
    args = ("127.0.0.1:5000", "GET", path, "1.1", 200)
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 0, '%s - "%s %s HTTP/%s" %d', args, None)
    assert RedactCredentials(tokens).filter(record)
    return AccessFormatter('%(client_addr)s - "%(request_line)s" %(status_code)s', use_colors=False).format(record)


@pytest.mark.parametrize(
    "query",
    ["token=s3cr3t", "access_token=s3cr3t", "api_key=s3cr3t", "API-KEY=s3cr3t", "%74oken=s3cr3t", "node_token=s3cr3t"],
)
def test_credential_parameters_are_blanked(query):
    line = access_line(f"/v1/srv?state=queued&{query}&n=2")
    assert "s3cr3t" not in line
    assert f"&{query.split('=')[0]}={REDACTED}&" in line and "state=queued" in line and "n=2" in line


def test_configured_tokens_are_blanked_anywhere_raw_or_encoded():
    from urllib.parse import quote

    for path in (f"/v1/srv?q={quote(TOKEN, safe='')}", f"/v1/nodes/{quote(TOKEN, safe='')}/lease", f"/x?{TOKEN}"):
        line = access_line(path, (TOKEN,))
        assert TOKEN not in line and quote(TOKEN, safe="") not in line and REDACTED in line


def test_ordinary_request_lines_are_kept():
    assert access_line("/v1/operations?node=n1&state=queued").endswith(
        '127.0.0.1:5000 - "GET /v1/operations?node=n1&state=queued HTTP/1.1" 200 OK'
    )
    assert access_line("/livez").endswith('"GET /livez HTTP/1.1" 200 OK')


@pytest.fixture
def uvicorn_loggers() -> Iterator[None]:
    """dictConfig changes process-wide loggers: put uvicorn's back as they were."""
    loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "uvicorn.access")]
    saved = [(lg.handlers[:], lg.filters[:], lg.level, lg.propagate, lg.disabled) for lg in loggers]
    yield
    for lg, (handlers, filters, level, propagate, disabled) in zip(loggers, saved, strict=True):
        lg.handlers[:], lg.filters[:], lg.level, lg.propagate, lg.disabled = (
            handlers,
            filters,
            level,
            propagate,
            disabled,
        )


def test_serve_log_config_filters_uvicorns_access_log(capsys, uvicorn_loggers):
    settings = Settings(operator_tokens=[TOKEN], node_tokens={"n1": "n1-secret"})
    config = serve_log_config(settings)
    assert "redact_credentials" in config["handlers"]["access"]["filters"]
    logging.config.dictConfig(config)
    logging.getLogger("uvicorn.access").info(
        '%s - "%s %s HTTP/%s" %d', "127.0.0.1:1", "GET", "/v1/srv?token=n1-secret&x=1", "1.1", 401
    )
    out = capsys.readouterr().out
    assert "n1-secret" not in out and f"token={REDACTED}&x=1" in out
