"""`statebudget gateway`: run the gateway (uvicorn), logging JSON lines without prompt contents."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from clients.gateway.settings import GatewaySettings
from clients.sdk import log_retries


class JsonLines(logging.Formatter):
    """One JSON object a record: time, level, logger, message (the gateway never logs prompts or answers)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "at": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line)


def serve(**overrides: Any) -> None:
    """Build the settings (options over `STATEBUDGET_GATEWAY_*`) and serve until a signal stops it."""
    import uvicorn

    from clients.gateway.app import create_gateway_app

    settings = GatewaySettings(**{k: v for k, v in overrides.items() if v is not None})
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines())
    logging.basicConfig(level=settings.log_level.upper(), handlers=[handler])
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per upstream call otherwise
    log_retries(logging.getLogger("statebudget.gateway"))
    uvicorn.run(
        create_gateway_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,  # the JSON handler above takes uvicorn's records too
        access_log=False,  # a line per request costs CPU at hundreds a second; the metrics count them
        timeout_graceful_shutdown=5,
    )
