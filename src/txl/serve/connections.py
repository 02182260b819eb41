"""Connections of `txl serve`: a cap below the descriptor limit and a time limit on headers (issue 50).

uvicorn has a keep-alive timeout, but no time limit for a request's headers and no cap on open
connections that keeps it from running out of file descriptors. Its `limit_concurrency` answers 503
past a count only once a request's headers have arrived, so it never sees a client that connects and
sends nothing, and it counts such half-open connections against the real clients. With 1,100
half-open connections at a 1,024-descriptor limit, accept() failed with EMFILE, the server stopped
answering and the failure was logged again and again (51 MB in a minute).

`Guard.protocol()` is uvicorn's h11 protocol with two more rules:
- header timeout: a connection whose request headers have not all arrived `header_timeout` seconds
  after it opened (or after its previous response ended) is closed;
- connection cap: at `max_connections` open connections, a new one closes the oldest connection that
  is waiting for request headers or idle between requests (a half-open client loses its place, a
  working one keeps it); when every connection is working, the new one gets a 503 JSON line with
  Retry-After and is closed.
uvicorn's accept loop takes up to `backlog` connections each time the listening socket wakes, so
the descriptors in use stay below max_connections + ACCEPT_BATCH + what the process held at start;
`connection_cap` fits max_connections under RLIMIT_NOFILE with that margin. Header size is h11's
16 KB limit; the body's time limit is the app's (`Limits.body_timeout`). Nothing here logs per
connection: the counts are in GET /health, and `quiet_logs` keeps what uvicorn and asyncio log to
one line per message, at most once a minute each.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time

from txl.errors import UsageError

ACCEPT_BATCH = 64  # uvicorn Config(backlog=...): connections accepted per wake-up of the listening socket
SPARE_FDS = 64  # descriptors kept free beyond those open at start (files, threads, pipes opened later)
HEADER_BYTES = 16 * 1024  # h11's limit on a request's headers


def descriptors_in_use() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: assume a quiet process
        return 64


def connection_cap(wanted: int) -> int:
    """`wanted`, lowered to what RLIMIT_NOFILE leaves; one line when it leaves too little."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return wanted
    room = soft - descriptors_in_use() - ACCEPT_BATCH - SPARE_FDS
    if room < 8:
        raise UsageError(f"the descriptor limit (ulimit -n {soft}) leaves room for {max(room, 0)} connections; "
                         f"txl serve needs at least 8: raise it, e.g. ulimit -n 4096")
    return min(wanted, room)


class Guard:
    """The connection rules and their counts (shown by GET /health)."""

    def __init__(self, *, max_connections: int, header_timeout: float):
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.open: set = set()  # protocols of the open connections
        self.dropped = 0  # waiting connections closed to make room for a new one
        self.refused = 0  # new connections answered 503 (every open one was working)
        self.timed_out = 0  # connections closed because their headers did not arrive in time

    def stats(self) -> dict:
        return {"connections": len(self.open), "max_connections": self.max_connections,
                "connections_dropped": self.dropped, "connections_refused": self.refused,
                "header_timeouts": self.timed_out}

    def protocol(self) -> type:
        """uvicorn's h11 protocol bound to this guard (uvicorn.Config(http=...))."""
        from uvicorn.protocols.http.h11_impl import H11Protocol

        guard = self

        class GuardedH11(H11Protocol):
            def connection_made(self, transport) -> None:
                super().connection_made(transport)
                self.txl_since = time.monotonic()  # since when it has waited for request headers
                self.txl_timer = None
                if len(guard.open) >= guard.max_connections and not guard.make_room():
                    guard.refused += 1
                    transport.write(_refusal())
                    transport.close()
                    return
                guard.open.add(self)
                self.txl_arm()

            def txl_waiting(self) -> bool:
                """Waiting for a request's headers, or idle between two requests."""
                return self.cycle is None or self.cycle.response_complete

            def txl_arm(self) -> None:
                if self.txl_timer is not None:
                    self.txl_timer.cancel()
                self.txl_since = time.monotonic()
                self.txl_timer = self.loop.call_later(guard.header_timeout, self.txl_expire, self.cycle)

            def txl_expire(self, cycle) -> None:
                self.txl_timer = None
                if self.cycle is cycle and self.txl_waiting() and not self.transport.is_closing():
                    guard.timed_out += 1  # no new request began since the timer was armed
                    guard.open.discard(self)
                    self.transport.close()

            def on_response_complete(self) -> None:
                super().on_response_complete()
                if not self.transport.is_closing():
                    self.txl_arm()

            def connection_lost(self, exc) -> None:
                guard.open.discard(self)
                if self.txl_timer is not None:
                    self.txl_timer.cancel()
                    self.txl_timer = None
                super().connection_lost(exc)

        return GuardedH11

    def make_room(self) -> bool:
        """Close the connection that has waited longest for its request; False when none is waiting."""
        waiting = [p for p in self.open if p.txl_waiting()]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda p: p.txl_since)
        self.open.discard(oldest)
        self.dropped += 1
        oldest.transport.close()
        return True


def _refusal() -> bytes:
    body = json.dumps({"error": "the server has all the connections it can hold, each working; try again "
                                "shortly"}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class _OncePerMinute(logging.Filter):
    """Each distinct message at most once a minute, without its traceback (the count of the ones left
    out is added to the next one shown)."""

    def __init__(self):
        super().__init__()
        self.shown: dict[str, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = f"{record.name}:{record.getMessage()}"[:200]
        now = time.monotonic()
        last, skipped = self.shown.get(key, (-1e9, 0))
        if now - last < 60:
            self.shown[key] = (last, skipped + 1)
            return False
        if len(self.shown) > 1000:
            self.shown.clear()
        self.shown[key] = (now, 0)
        if record.exc_info and record.exc_info[1] is not None:
            err = record.exc_info[1]
            record.msg = f"{record.getMessage()} ({type(err).__name__}: {str(err)[:200]})"
            record.args = ()
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        if skipped:
            record.msg = f"{record.getMessage()} ({skipped} more like it in the last minute)"
            record.args = ()
        return True


class _Stderr(logging.StreamHandler):
    """Message only, to whatever sys.stderr is when a line is written (as logging's last resort does)."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def quiet_logs() -> None:
    """uvicorn's and asyncio's log lines (and ours): one line each, at most once a minute per message.
    Ours ("txl serve: internal error in …") go to stderr as they are."""
    for name in ("uvicorn", "uvicorn.error", "asyncio", "txl.serve"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OncePerMinute) for f in logger.filters):
            logger.addFilter(_OncePerMinute())
    ours = logging.getLogger("txl.serve")
    if not any(isinstance(h, _Stderr) for h in ours.handlers):
        ours.addHandler(_Stderr())
        ours.propagate = False


def server_config(app, guard: Guard, *, log_level: str = "warning", graceful: float = 2):
    """The uvicorn configuration of `txl serve` (and of its tests)."""
    import uvicorn

    config = uvicorn.Config(
        app, http=guard.protocol(), ws="none", loop="asyncio", log_level=log_level, access_log=False,
        timeout_graceful_shutdown=graceful,
        timeout_keep_alive=5,  # seconds an idle keep-alive connection stays open (uvicorn's default)
        backlog=ACCEPT_BATCH,  # the accept batch, which bounds descriptors beyond max_connections
        h11_max_incomplete_event_size=HEADER_BYTES,
        limit_concurrency=None,  # the guard caps connections; this would count half-open ones against clients
    )
    quiet_logs()
    return config
