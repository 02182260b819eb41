"""Client sessions of `txl serve`: each client's decoding state (`engine.Decoder`: memory and the next
token's logits) per run, kept within a count, an idle time and a memory budget."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from txl.serve.engine import Decoder
from txl.serve.requests import MB, ApiError, Limits


@dataclass
class Session:
    decoder: Decoder
    used: float
    reserved: int = 0  # bytes set aside when it started (ServedRun.session_bytes)
    held: int = 0  # bytes measured after its last request (Decoder.nbytes)
    busy: bool = False

    @property
    def nbytes(self) -> int:
        return max(self.reserved, self.held)


class Sessions:
    """Client memories keyed by (session id, run index); bounded in count, idle time and bytes.

    A new session reserves the most it can hold (`ServedRun.session_bytes` at its mem_len); when the
    sessions would pass `Limits.session_memory` or `max_sessions`, the least recently used idle ones
    are dropped (a later "continue" of theirs gets 404); when only busy ones are left, the request gets
    503 with Retry-After. After each request a session's measured size replaces the estimate where
    it is larger, and the budget is restored the same way."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.items: OrderedDict[tuple[str, int], Session] = OrderedDict()
        self.lock = threading.Lock()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self.items)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.items.values())

    def full(self) -> bool:
        """True when a new session could not start now (every slot or byte held by busy sessions)."""
        with self.lock:
            idle = any(not s.busy for s in self.items.values())
            return not idle and (len(self.items) >= self.limits.max_sessions or self.nbytes >= self.limits.session_memory)

    def _make_room(self, nbytes: int, count: int, keep: Session | None = None) -> bool:
        """Drop least recently used idle sessions until `count` more sessions of `nbytes` fit."""
        while len(self.items) + count > self.limits.max_sessions or self.nbytes + nbytes > self.limits.session_memory:
            idle = next((k for k, s in self.items.items() if not s.busy and s is not keep), None)
            if idle is None:
                return False
            del self.items[idle]
            self.evicted += 1
        return True

    def take(self, key: tuple[str, int], make: Callable[[], Decoder] | None, reserve: int = 0) -> Session:
        """The session to use (marked busy), a new one from `make()` that reserves `reserve` bytes, or an error."""
        now = time.monotonic()
        with self.lock:
            for old in [k for k, s in self.items.items() if not s.busy and now - s.used > self.limits.session_ttl]:
                del self.items[old]
            session = self.items.get(key)
            stale = self.limits.queue_timeout + self.limits.request_timeout + 60  # a stream that never started
            if session is not None and session.busy and now - session.used < stale:
                raise ApiError(409, "this session is already generating; wait for it to finish or use another session")
            if make is None:
                if session is None:
                    raise ApiError(404, "no such session to continue (it expired or was never started); "
                                        "generate without \"continue\" first")
            else:
                budget = self.limits.session_memory
                if reserve > budget:
                    raise ApiError(413, f"a session at this mem_len holds up to {reserve / MB:.1f} MB, more than this "
                                        f"server's {budget / MB:.1f} MB for all sessions: ask for a smaller mem_len")
                if session is not None:  # a new generation replaces this session's memory
                    del self.items[key]
                if not self._make_room(reserve, 1):
                    raise ApiError(503, f"every session slot or the sessions' memory ({budget / MB:.1f} MB) is held by "
                                        "generations still running; try again shortly", retry_after=5)
                session = Session(decoder=make(), used=now, reserved=reserve)
                self.items[key] = session
            self.items.move_to_end(key)
            session.busy, session.used = True, now
            return session

    def release(self, session: Session) -> None:
        held = session.decoder.nbytes()
        with self.lock:
            session.busy, session.used, session.held = False, time.monotonic(), held
            if not self._make_room(0, 0, keep=session):  # it outgrew its estimate and nothing else can go
                for key in [k for k, s in self.items.items() if s is session]:
                    del self.items[key]
                    self.evicted += 1
