"""`statebudget-agent`: run a node agent, or list the executors.

statebudget-agent run --config agent.yaml
statebudget-agent run --server http://127.0.0.1:8080 --node n1 --executor local --scale 1e-6 --nvme-dir /tmp/n1/nvme
statebudget-agent executors
"""

from __future__ import annotations

import asyncio
import logging
import signal
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from clients.agent.config import AgentConfig, ExecutorName, load_config
from clients.agent.errors import invalid_fields
from clients.agent.executors import UnknownExecutor, default_registry
from clients.agent.runner import Agent
from clients.sdk import APIError, AsyncStateBudgetClient, RetryPolicy, log_retries

app = typer.Typer(
    help="StateBudget node agent: leases operations for one node and carries them out.",
    no_args_is_help=True,
    rich_markup_mode=None,  # click's plain help: real flag syntax and `<a|b>` choices, no `<bool>` on flags
)


class LogLevel(StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


def install_signal_handlers(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """SIGTERM and SIGINT set `stop`: the agent stops leasing, finishes what runs, and exits."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


def remove_signal_handlers(loop: asyncio.AbstractEventLoop) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)


async def run_agent(config: AgentConfig, *, handle_signals: bool = True) -> Agent:
    executor = default_registry().create(config.executor, config)
    # one retry layer: the agent's own loops back off and try again (register, lease, report), so the SDK
    # makes each call once instead of retrying inside them
    client = AsyncStateBudgetClient(
        config.server_url, token=config.token, timeout_seconds=config.timeout_seconds, retry=RetryPolicy(attempts=1)
    )
    agent = Agent(config, client, executor)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if handle_signals:
        install_signal_handlers(loop, stop)
    try:
        await agent.run(stop)
    finally:
        if handle_signals:
            remove_signal_handlers(loop)
        await executor.aclose()
        await client.aclose()
    return agent


@app.command()
def run(
    config_path: Annotated[Path | None, typer.Option("--config", "-c", help="YAML or JSON settings file.")] = None,
    server: Annotated[str | None, typer.Option(help="Service URL, e.g. http://127.0.0.1:8080.")] = None,
    node: Annotated[str | None, typer.Option(help="This node's id in the cluster topology.")] = None,
    token: Annotated[
        str | None, typer.Option(envvar="STATEBUDGET_AGENT_TOKEN", help="Bearer token (the node's own).")
    ] = None,
    executor: Annotated[
        ExecutorName | None, typer.Option(help="What carries out the operations (default: local, or the file's).")
    ] = None,
    scale: Annotated[
        float | None,
        typer.Option(
            help="local: bytes materialized per planned byte (1e-6: a 60 GB model is 60 KB). Below 1 the service "
            "takes the run for a test and calibrates no bandwidth from it."
        ),
    ] = None,
    nvme_dir: Annotated[Path | None, typer.Option(help="local: directory standing for the NVMe tier.")] = None,
    host_dir: Annotated[
        Path | None, typer.Option(help="local: directory (tmpfs) for host RAM; default memory.")
    ] = None,
    engine: Annotated[
        list[str] | None, typer.Option(help="vllm/sglang: MODEL=URL of the engine serving MODEL (repeatable).")
    ] = None,
    lease_wait: Annotated[float | None, typer.Option(help="Long-poll wait in seconds.")] = None,
    max_parallel: Annotated[int | None, typer.Option(help="Operations run at once.")] = None,
    log_level: Annotated[LogLevel, typer.Option(help="Log level.")] = LogLevel.INFO,
) -> None:
    """Register the node, heartbeat, lease operations and carry them out until SIGTERM."""
    logging.basicConfig(level=log_level.value.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if log_level is not LogLevel.DEBUG:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per long-poll and heartbeat otherwise
    log_retries(logging.getLogger("statebudget.agent"))
    engines = None
    if engine:
        pairs = [e.split("=", 1) for e in engine]
        if any(len(p) != 2 for p in pairs):
            raise typer.BadParameter("--engine takes MODEL=URL", param_hint="--engine")
        engines = dict(pairs)
    overrides = {
        "server_url": server,
        "node_id": node,
        "token": token,
        "executor": executor,
        "scale": scale,
        "nvme_dir": nvme_dir,
        "host_dir": host_dir,
        "engines": engines,
        "lease_wait_seconds": lease_wait,
        "max_parallel": max_parallel,
    }
    try:
        config = load_config(config_path, overrides)
        default_registry().create(config.executor, config)  # fail before connecting when the executor cannot start
    except ValidationError as error:
        typer.echo(f"invalid agent configuration: {invalid_fields(error, whole='settings')}", err=True)
        raise typer.Exit(2) from None
    except (UnknownExecutor, ValueError, OSError) as error:
        typer.echo(f"invalid agent configuration: {error}", err=True)
        raise typer.Exit(2) from None
    try:
        asyncio.run(run_agent(config))
    except APIError as error:  # e.g. an unknown node (404) or a token that does not reach it (401/403)
        typer.echo(f"the service refused the agent: {error}", err=True)
        raise typer.Exit(1) from error
    except ValidationError as error:  # a registration or lease the API's models refuse: no retry can help
        typer.echo(f"the agent's request is invalid: {invalid_fields(error)}", err=True)
        raise typer.Exit(1) from None


@app.command()
def executors() -> None:
    """The executors and the capabilities each declares by default."""
    registry = default_registry()
    table = Table("executor", "capabilities")
    probe = AgentConfig(node_id="probe")
    for name in registry.names():
        caps = sorted(c.value for c in registry.create(name, probe).capabilities)
        table.add_row(name, ", ".join(caps) or "(none)")
    Console().print(table)
