"""HTTP/1.1 to the engines: a keep-alive connection pool on asyncio protocols, parsed by httptools (C).

Why not httpx on this path: its pool (httpcore) walks every pooled connection, and polls each idle socket,
for every request; with 200 streams open that was most of the gateway's CPU (docs/benchmarks/gateway.md).
Here idle connections wait per engine in a LIFO list, and one the engine closed leaves it when the event
loop reports the close, so taking one costs no system call. A request goes out in one write (head and body
together); an answer's body is handed over as it arrives, whatever arrived since the last read joined into
one piece (one write to the client instead of one per SSE event that came in the meantime).

Failures keep the one distinction the proxy needs: `ConnectFailed` (nothing reached the engine: the
request may go elsewhere) and `UpstreamBroken` (it may have started there: never resent).
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

try:
    import httptools
except ModuleNotFoundError as missing:  # the extra is part of the gateway's install, not the planner's
    raise ModuleNotFoundError("the gateway needs its extra: pip install 'statebudget[gateway]'") from missing

# an idle connection is dropped after this long: below the 5 s keep-alive of uvicorn, which serves vLLM and
# SGLang (uvicorn's `timeout_keep_alive` default; vllm/entrypoints/openai/api_server.py TIMEOUT_KEEP_ALIVE = 5),
# so the gateway never writes a request on a connection the engine is closing
IDLE_EXPIRY_SECONDS = 4.0
# an answer read no faster than the client takes it: stop reading from the engine past this much buffered
HIGH_WATER_BYTES = 256 * 1024


class UpstreamError(Exception):
    pass


class ConnectFailed(UpstreamError):
    """No connection to the engine: the request was not sent."""


class UpstreamBroken(UpstreamError):
    """The connection failed or timed out after the request was written: the engine may have started it."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where an engine listens, parsed once per URL."""

    host: str
    port: int
    tls: bool
    base_path: bytes  # the URL's path without its trailing slash ("" for most engines)
    host_header: bytes

    @classmethod
    def parse(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine URL {url!r}: an http:// or https:// URL with a host is required")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        return cls(parts.hostname, port, tls, parts.path.rstrip("/").encode(), parts.netloc.encode("idna"))


class _Connection(asyncio.Protocol):
    """One connection to an engine and the answer it is reading (httptools calls the `on_*` methods)."""

    def __init__(self, origin: Origin) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.parser = httptools.HttpResponseParser(self)
        self.begin()

    def begin(self) -> None:
        """Ready to read a new answer."""
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.keep_alive = False
        self.complete = False
        self.framed = False  # content-length or chunked: else the body ends with the connection
        self.body: list[bytes] = []
        self.buffered = 0
        self.paused = False
        self.error: UpstreamError | None = None
        self.waiter: asyncio.Future[None] | None = None

    # ---- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's TCP transport is one, not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            self.fail(UpstreamBroken(f"the engine's answer is not HTTP/1.1: {error}"))
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            if self.headers_done and not self.framed:
                self.complete = True  # a body delimited by the close
            elif self.error is None:
                self.error = UpstreamBroken("the engine closed the connection before its answer ended")
        self._wake()

    # ---- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-length" or (lowered == b"transfer-encoding" and b"chunked" in value.lower()):
            self.framed = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()  # read here: llhttp forgets it once the message ends
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER_BYTES and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.complete = True

    # ---- for the pool and the answer

    def fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self.close()
        self._wake()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def wait(self, timeout_seconds: float) -> None:
        """Until more of the answer arrived, it ended or it failed; an engine silent for the timeout fails it."""
        loop = asyncio.get_running_loop()
        self.waiter = waiter = loop.create_future()
        timer = loop.call_later(
            timeout_seconds, self.fail, UpstreamBroken(f"the engine sent nothing for {timeout_seconds:g} s")
        )
        try:
            await waiter
        finally:
            timer.cancel()
            self.waiter = None

    def take_body(self) -> bytes:
        piece = b"".join(self.body) if len(self.body) != 1 else self.body[0]
        self.body.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return piece


class UpstreamResponse:
    """An engine's answer: `head()` waits for its status and headers, the body comes as it arrives;
    `release()` when done."""

    def __init__(self, pool: UpstreamPool, connection: _Connection) -> None:
        self._pool = pool
        self._connection = connection
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.released = False

    async def head(self) -> None:
        c = self._connection
        while not c.headers_done:
            if c.error is not None:
                raise c.error
            await c.wait(self._pool.read_timeout_seconds)
        self.status, self.headers = c.status, c.headers

    async def next_chunk(self) -> tuple[bytes, bool]:
        """What arrived since the last call (waiting for something when nothing did), and whether the answer
        ended with it."""
        c = self._connection
        while not c.body and not c.complete:
            if c.error is not None:
                raise c.error
            await c.wait(self._pool.read_timeout_seconds)
        if c.error is not None and not c.complete:
            raise c.error
        return c.take_body(), c.complete and not c.body

    async def read(self) -> bytes:
        pieces = []
        while True:
            piece, ended = await self.next_chunk()
            pieces.append(piece)
            if ended:
                return b"".join(pieces)

    def abort(self) -> None:
        """Close the connection mid-answer: an OpenAI server reads that as the client going away and aborts."""
        if not self.released:
            self.released = True
            self._connection.close()

    def release(self) -> None:
        """Back to the pool if the answer was read to its end on a connection that stays open, else closed."""
        if self.released:
            return
        self.released = True
        c = self._connection
        if c.complete and not c.closed and c.keep_alive:
            self._pool.put(c)
        else:
            c.close()


class UpstreamPool:
    def __init__(self, *, connect_timeout_seconds: float, read_timeout_seconds: float, max_idle: int) -> None:
        self.connect_timeout_seconds = connect_timeout_seconds
        self.read_timeout_seconds = read_timeout_seconds
        self.max_idle = max_idle
        self._idle: dict[Origin, list[_Connection]] = {}
        self._idle_count = 0
        self._origins: dict[str, Origin] = {}
        self._tls: ssl.SSLContext | None = None
        self.connections_opened = 0  # so a test can tell a connection was reused

    def origin(self, url: str) -> Origin:
        found = self._origins.get(url)
        if found is None:
            found = self._origins[url] = Origin.parse(url)
        return found

    def put(self, connection: _Connection) -> None:
        if self._idle_count >= self.max_idle:
            connection.close()
            return
        connection.idle_since = asyncio.get_running_loop().time()
        self._idle.setdefault(connection.origin, []).append(connection)
        self._idle_count += 1

    def _take(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        fresh_after = asyncio.get_running_loop().time() - IDLE_EXPIRY_SECONDS
        while idle:
            connection = idle.pop()  # the most recently used: the least likely to have expired
            self._idle_count -= 1
            closing = connection.transport is None or connection.transport.is_closing()
            if not (connection.closed or closing) and connection.idle_since > fresh_after:
                return connection
            connection.close()
        return None

    async def _connect(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        context: ssl.SSLContext | None = None
        if origin.tls:
            context = self._tls = self._tls or ssl.create_default_context()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(origin), origin.host, origin.port, ssl=context),
                self.connect_timeout_seconds,
            )
        except TimeoutError as error:
            raise ConnectFailed(f"no connection within {self.connect_timeout_seconds:g} s") from error
        except OSError as error:
            raise ConnectFailed(error.strerror or type(error).__name__) from error
        self.connections_opened += 1
        return connection

    async def post(
        self, url: str, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes, *, method: bytes = b"POST"
    ) -> UpstreamResponse:
        """POST `body` to `url` + `path` with the client's `headers` (hop-by-hop ones already dropped); the answer
        to come (its `head()` next). Only `ConnectFailed` here: once this returns, the request is out. `method`:
        another method with the same framing (the warm-ups' GET of an engine's metrics)."""
        origin = self.origin(url)
        head = [
            method,
            b" ",
            origin.base_path,
            path,
            b" HTTP/1.1\r\nhost: ",
            origin.host_header,
            b"\r\ncontent-length: ",
            str(len(body)).encode(),
            b"\r\n",
        ]
        for name, value in headers:
            head += (name, b": ", value, b"\r\n")
        head += (b"\r\n", body)
        request = b"".join(head)
        connection = self._take(origin)
        if connection is not None:
            try:
                return self._send(connection, request)
            except RuntimeError:  # uvloop refuses a write to a transport closed since: nothing went out
                connection.close()
        return self._send(await self._connect(origin), request)

    def _send(self, connection: _Connection, request: bytes) -> UpstreamResponse:
        connection.begin()
        assert connection.transport is not None  # set when the connection was made
        connection.transport.write(request)
        return UpstreamResponse(self, connection)

    def close(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()
        self._idle_count = 0
