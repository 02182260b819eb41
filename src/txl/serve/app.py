"""The HTTP side of `txl serve`: a Starlette app over `txl.serve.engine`.

    GET  /               the playground page (static files shipped in the package; no CDN)
    GET  /health         {"status": "ok", "active": …, "waiting": …, "sessions": …}
    GET  /api/model      the model cards and the server's limits
    POST /api/generate   server-sent events: start, token…, done (or error)
    POST /api/score      per-token NLL of a text or ids; with "attention", one query's attention

Every request is bounded (body size, prompt and text length, new tokens, concurrent work, time) and
every refusal is one JSON object {"error": "…"} with a 4xx status. Requests name runs by their index
in the order the server was started with: nothing a client sends is ever used as a path, and the only
files served are the page's own (a fixed list). Work runs in threads, one forward pass at a time per
model, and stops between two forward passes when its client goes away or its time is up.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from txl.errors import TxlError
from txl.generate import encode_prompt
from txl.serve.engine import Cancelled, Decoder, ServedRun, generate, score, token_pieces

STATIC = {  # the only files the server reads after start-up: name -> media type
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")


@dataclass(frozen=True)
class Limits:
    """What one request may ask for and how much work runs at once (`txl serve --help` sets them)."""

    max_prompt_tokens: int = 2048
    max_new_tokens: int = 512
    max_score_tokens: int = 4096
    max_mem_len: int = 4096
    max_concurrent: int = 4  # generations and scorings running at once; more wait for a slot
    max_waiting: int = 64  # requests waiting for a slot; beyond that: 429
    queue_timeout: float = 30.0  # seconds a request waits for a slot
    request_timeout: float = 120.0  # seconds of work per request
    max_body_bytes: int = 256 * 1024
    max_sessions: int = 256  # client sessions kept (least recently used dropped first)
    session_ttl: float = 3600.0  # seconds an idle session keeps its memory


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=SECURITY_HEADERS)


# ---------------------------------------------------------------------------------------------
# Request bodies: JSON objects with known fields, types and ranges


@dataclass(frozen=True)
class Field:
    kind: type | tuple  # int, float, bool, str, list (of ints), dict
    default: Any = None
    low: float | None = None
    high: float | None = None  # for str: characters; for list: entries


def _check_field(name: str, value: Any, spec: Field) -> Any:
    kinds = spec.kind if isinstance(spec.kind, tuple) else (spec.kind,)
    if value is None:
        return None
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join({int: "an integer", float: "a number", bool: "true or false", str: "a string",
                             list: "a list of integers", dict: "an object"}[k] for k in kinds)
        raise ApiError(422, f"field {name!r} must be {names}, got {json.dumps(value)[:40]}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ApiError(422, f"field {name!r} must be a finite number")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if spec.low is not None and value < spec.low:
            raise ApiError(422, f"field {name!r} must be >= {spec.low:g}, got {value}")
        if spec.high is not None and value > spec.high:
            raise ApiError(413 if name in ("max_new_tokens",) else 422,
                           f"field {name!r} must be <= {spec.high:g} on this server, got {value}")
    if isinstance(value, str | list) and spec.high is not None and len(value) > spec.high:
        raise ApiError(413, f"field {name!r} is too long: {len(value)} > {spec.high:g} "
                            f"{'characters' if isinstance(value, str) else 'entries'}")
    if isinstance(value, list) and not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ApiError(422, f"field {name!r} must be a list of integers (token ids)")
    return value


def parse_fields(data: Any, fields: dict[str, Field]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ApiError(400, f"unknown field {unknown[0]!r}; known fields: {', '.join(fields)}")
    return {name: (spec.default if data.get(name) is None else _check_field(name, data[name], spec))
            for name, spec in fields.items()}


async def read_json(request: Request, limit: int) -> Any:
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        raise ApiError(415, "send the body as JSON with Content-Type: application/json")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise ApiError(413, f"the request body is larger than this server's limit of {limit:,} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the request body is larger than this server's limit of {limit:,} bytes")
    try:
        return json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not UTF-8") from None
    except (ValueError, RecursionError) as err:
        raise ApiError(400, f"the request body is not valid JSON ({str(err)[:80]})") from None


# ---------------------------------------------------------------------------------------------
# Sessions: each client's memory, per run


@dataclass
class Session:
    decoder: Decoder
    used: float
    busy: bool = False


class Sessions:
    """Client memories keyed by (session id, run index); bounded in count and idle time."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.items: OrderedDict[tuple[str, int], Session] = OrderedDict()
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.items)

    def take(self, key: tuple[str, int], make: Callable[[], Decoder] | None) -> Session:
        """The session to use (marked busy), a new one from `make()`, or an error."""
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
                while len(self.items) >= self.limits.max_sessions:
                    idle = next((k for k, s in self.items.items() if not s.busy), None)
                    if idle is None:
                        raise ApiError(503, "every session slot is in use; try again shortly")
                    del self.items[idle]
                session = Session(decoder=make(), used=now)
                self.items[key] = session
            self.items.move_to_end(key)
            session.busy, session.used = True, now
            return session

    def release(self, session: Session) -> None:
        with self.lock:
            session.busy, session.used = False, time.monotonic()


# ---------------------------------------------------------------------------------------------
# The app


class Server:
    def __init__(self, runs: list[ServedRun], limits: Limits):
        self.runs = runs
        self.limits = limits
        self.sessions = Sessions(limits)
        self.pool = ThreadPoolExecutor(max_workers=limits.max_concurrent, thread_name_prefix="txl-serve")
        self.slots: asyncio.Semaphore | None = None  # made on the server's event loop
        self.active = 0
        self.waiting = 0
        self.served_tokens = 0
        self.recent: deque[dict] = deque(maxlen=32)  # how the last generations ended (GET /health)

    def run_of(self, index: int) -> ServedRun:
        if not 0 <= index < len(self.runs):
            raise ApiError(422, f"field 'run' must be 0…{len(self.runs) - 1} (this server has {len(self.runs)} "
                                f"run{'s' if len(self.runs) > 1 else ''})")
        return self.runs[index]

    def check_capacity(self) -> None:
        """Refuse at once (429) when every slot is taken and the waiting line is full."""
        if self.slots is None:
            self.slots = asyncio.Semaphore(self.limits.max_concurrent)
        if self.slots.locked() and self.waiting >= self.limits.max_waiting:
            raise ApiError(429, f"the server is busy ({self.limits.max_waiting} requests waiting); try again shortly")

    async def acquire(self) -> None:
        """Wait for a work slot (at most queue_timeout seconds)."""
        self.check_capacity()
        self.waiting += 1
        try:
            await asyncio.wait_for(self.slots.acquire(), timeout=self.limits.queue_timeout)
        except TimeoutError:
            raise ApiError(503, f"no work slot became free within {self.limits.queue_timeout:g} s; "
                                "try again shortly") from None
        finally:
            self.waiting -= 1
        self.active += 1

    def release(self) -> None:
        self.active -= 1
        self.slots.release()

    def start(self, job: Callable[[], Any]) -> asyncio.Future:
        """Run `job` in a worker thread; its slot is freed when the thread is done (not before)."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.pool, job)
        future.add_done_callback(lambda _: self.release())
        return future


GENERATE_FIELDS = {
    "run": Field(int, 0),
    "prompt": Field(str, ""),
    "session": Field(str, None, high=64),
    "continue": Field(bool, False),
    "max_new_tokens": Field(int, 50, low=1),
    "temperature": Field(float, 1.0, low=0, high=100),
    "top_k": Field(int, 40, low=0),
    "top_p": Field(float, 1.0, low=0, high=1),
    "seed": Field(int, None, low=0, high=2**63 - 1),
    "mem_len": Field(int, None, low=0),
}
SCORE_FIELDS = {
    "run": Field(int, 0),
    "text": Field(str, None),
    "ids": Field(list, None),
    "mem_len": Field(int, None, low=0),
    "tgt_len": Field(int, None, low=1, high=4096),
    "attention": Field(dict, None),
}
ATTENTION_FIELDS = {"token": Field(int, None, low=1), "layer": Field(int, 0, low=0), "head": Field(int, 0, low=0)}


def _sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def create_app(runs: list[ServedRun], limits: Limits | None = None, *, allowed_hosts: tuple[str, ...] | None = None):
    """The ASGI app. allowed_hosts: the Host header values accepted (default: loopback names only, which
    keeps a web page elsewhere from reaching this server through DNS rebinding); None in the tuple
    accepts any host."""
    limits = limits or Limits()
    server = Server(runs, limits)
    hosts = LOOPBACK_HOSTS if allowed_hosts is None else allowed_hosts
    generate_fields = dict(GENERATE_FIELDS)  # with this server's bounds
    generate_fields["prompt"] = Field(str, "", high=limits.max_prompt_tokens * 8)
    generate_fields["max_new_tokens"] = Field(int, min(50, limits.max_new_tokens), low=1, high=limits.max_new_tokens)
    generate_fields["mem_len"] = Field(int, None, low=0, high=limits.max_mem_len)
    score_fields = dict(SCORE_FIELDS)
    score_fields["text"] = Field(str, None, high=limits.max_score_tokens * 8)
    score_fields["ids"] = Field(list, None, high=limits.max_score_tokens)
    score_fields["mem_len"] = Field(int, None, low=0, high=limits.max_mem_len)

    async def index(request: Request) -> Response:
        return _static("index.html")

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC:
            raise ApiError(404, "not found")
        return _static(name)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "runs": len(runs), "active": server.active, "waiting": server.waiting,
                             "sessions": len(server.sessions), "tokens": server.served_tokens,
                             "recent": list(server.recent)},
                            headers=SECURITY_HEADERS)

    async def model_info(request: Request) -> Response:
        return JSONResponse({"runs": [{**run.card, "eval_tgt_len": run.tgt_len} for run in runs],
                             "limits": asdict(limits)}, headers=SECURITY_HEADERS)

    async def generate_route(request: Request) -> Response:
        args = parse_fields(await read_json(request, limits.max_body_bytes), generate_fields)
        run = server.run_of(args["run"])
        model = run.model
        session_id = args["session"]
        if session_id is not None and not (8 <= len(session_id) <= 64 and session_id.replace("-", "").replace("_", "").isalnum()):
            raise ApiError(422, "field 'session' must be 8-64 letters, digits, '-' or '_'")
        if args["continue"] and session_id is None:
            raise ApiError(422, "\"continue\": true needs the \"session\" whose memory to continue")
        if args["top_k"] > model.config.vocab_size:
            args["top_k"] = 0
        if args["top_p"] == 0:
            raise ApiError(422, "field 'top_p' must be in (0, 1]")
        mem_len = model.mem_len if args["mem_len"] is None else args["mem_len"]
        try:
            ids = (encode_prompt(run.vocab, args["prompt"]) if not args["continue"] or args["prompt"] else [])
        except TxlError as err:
            raise ApiError(422, str(err)) from None
        if len(ids) > limits.max_prompt_tokens:
            raise ApiError(413, f"the prompt is {len(ids):,} tokens; this server takes at most "
                                f"{limits.max_prompt_tokens:,}")
        server.check_capacity()
        window = run.ckpt.train_setting("tgt_len") if mem_len == 0 else None  # as `txl generate`
        session_id = session_id or secrets.token_urlsafe(12)
        key = (session_id, args["run"])
        if args["continue"]:
            session = server.sessions.take(key, None)
            if args["mem_len"] is not None and args["mem_len"] != session.decoder.mem_len:
                server.sessions.release(session)
                raise ApiError(422, f"this session runs with mem_len {session.decoder.mem_len}; a new mem_len needs "
                                    "a new generation (without \"continue\")")
            if not ids and session.decoder.logits is None:
                server.sessions.release(session)
                raise ApiError(422, "nothing to continue from: give a prompt")
        else:
            session = server.sessions.take(key, lambda: Decoder(run, mem_len=mem_len, window=window))
        seed = args["seed"] if args["seed"] is not None else secrets.randbits(62)
        settings = {k: args[k] for k in ("max_new_tokens", "temperature", "top_k", "top_p")}
        return StreamingResponse(_generation(server, run, session, session_id, ids, seed, settings),
                                 media_type="text/event-stream", headers={**SECURITY_HEADERS, "x-accel-buffering": "no"})

    async def score_route(request: Request) -> Response:
        args = parse_fields(await read_json(request, limits.max_body_bytes), score_fields)
        run = server.run_of(args["run"])
        if (args["text"] is None) == (args["ids"] is None):
            raise ApiError(422, "give exactly one of \"text\" and \"ids\"")
        if args["text"] is not None:
            from txl.evaluate import encode_text

            try:
                ids = [int(i) for i in encode_text(run.vocab, args["text"])]
            except TxlError as err:
                raise ApiError(422, str(err)) from None
        else:
            ids = args["ids"]
            vocab = run.model.config.vocab_size
            if any(not 0 <= i < vocab for i in ids):
                raise ApiError(422, f"field 'ids' holds token ids outside the vocabulary [0, {vocab})")
        if len(ids) < 2:
            raise ApiError(422, f"the text is {len(ids)} token(s); at least 2 are needed to score one prediction")
        if len(ids) > limits.max_score_tokens:
            raise ApiError(413, f"the text is {len(ids):,} tokens; this server scores at most {limits.max_score_tokens:,}")
        attention = None
        if args["attention"] is not None:
            attention = parse_fields(args["attention"], ATTENTION_FIELDS)
            config = run.model.config
            if config.arch in ("lstm", "sha-rnn"):
                raise ApiError(422, f"attention views are for Transformer runs; this run is arch={config.arch!r} "
                                    "(a recurrent LM): score without 'attention'")
            if attention["token"] is None or attention["token"] >= len(ids):
                raise ApiError(422, f"attention.token must be a token position in 1…{len(ids) - 1} (the query "
                                    "before it is the one shown)")
            if attention["layer"] >= config.n_layer or attention["head"] >= config.n_head:
                raise ApiError(422, f"attention.layer must be < {config.n_layer} and attention.head < {config.n_head}")
        mem_len = args["mem_len"]
        if mem_len is None:
            mem_len = run.ckpt.train_setting("eval_mem_len")
            mem_len = run.model.mem_len if mem_len is None else mem_len
        tgt_len = args["tgt_len"] or run.tgt_len
        deadline = time.monotonic() + limits.request_timeout
        await server.acquire()
        future = server.start(lambda: score(run, ids, mem_len=mem_len, tgt_len=tgt_len, attention=attention,
                                            cancelled=lambda: time.monotonic() > deadline))
        try:
            result = await future
        except Cancelled:
            raise ApiError(503, f"scoring took longer than this server's limit of {limits.request_timeout:g} s") from None
        except TxlError as err:
            raise ApiError(422, str(err)) from None
        result.update(run=args["run"], ids=ids, tokens=token_pieces(run.vocab, ids), metric=run.card["metric"])
        return JSONResponse(result, headers=SECURITY_HEADERS)

    async def on_api_error(request: Request, err: ApiError) -> Response:
        return _error(err.status, str(err))

    async def on_http_error(request: Request, err: HTTPException) -> Response:
        message = {404: "not found", 405: f"method {request.method} is not allowed here"}.get(err.status_code, err.detail)
        return _error(err.status_code, message)

    async def on_disconnect(request: Request, err: ClientDisconnect) -> Response:
        return _error(400, "the client went away")

    async def on_crash(request: Request, err: Exception) -> Response:
        return _error(500, f"internal error ({type(err).__name__}); the server keeps running")

    app = Starlette(
        routes=[
            Route("/", index, methods=["GET"]),
            Route("/static/{name}", static, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/api/model", model_info, methods=["GET"]),
            Route("/api/generate", generate_route, methods=["POST"]),
            Route("/api/score", score_route, methods=["POST"]),
        ],
        exception_handlers={ApiError: on_api_error, HTTPException: on_http_error, ClientDisconnect: on_disconnect,
                            Exception: on_crash},
    )
    app.state.server = server
    return _HostCheck(app, hosts)


async def _generation(server: Server, run: ServedRun, session: Session, session_id: str, ids: list[int], seed: int,
                      settings: dict):
    """The event stream of one generation. Runs in the response task: when the client disconnects,
    Starlette cancels it, `finally` sets `stop`, and the worker ends at its next forward pass, which
    frees the slot."""
    limits = server.limits
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()
    deadline = time.monotonic() + limits.request_timeout
    timed_out = []

    def cancelled() -> bool:
        if time.monotonic() > deadline:
            timed_out.append(True)
            return True
        return stop.is_set()

    def put(event: str, data: dict) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (event, data))

    def job() -> None:
        decoder = session.decoder
        count = 0
        started = time.perf_counter()

        def on_token(token: int, logprob: float, text: str) -> None:
            nonlocal count
            put("token", {"i": decoder.length, "id": token, "text": text, "logprob": logprob})
            count += 1

        stopped_by = "max_new_tokens"
        try:
            generator = torch.Generator().manual_seed(seed)
            decoder.feed(ids, cancelled)
            put("start", {"run": run.name, "session": session_id, "seed": seed, "mem_len": decoder.mem_len,
                          "first": decoder.length - len(ids), "prompt_ids": ids,
                          "prompt_pieces": token_pieces(run.vocab, ids), **settings})
            generate(decoder, generator=generator, on_token=on_token, cancelled=cancelled, **settings)
        except Cancelled:
            stopped_by = "time_limit" if timed_out else "disconnected"
        except TxlError as err:
            stopped_by = "error"
            put("error", {"error": str(err)})
        except Exception as err:  # never let one request take the server down
            stopped_by = "error"
            put("error", {"error": f"internal error ({type(err).__name__}); the server keeps running"})
        finally:
            server.sessions.release(session)
        seconds = time.perf_counter() - started
        server.served_tokens += count
        server.recent.append({"stopped_by": stopped_by, "tokens": count, "seconds": round(seconds, 4)})
        put("done", {"stopped_by": stopped_by, "tokens": count, "seconds": seconds,
                     "ms_per_token": 1000 * seconds / count if count else None})
        put("", {})  # end of stream

    started = False
    try:
        try:
            await server.acquire()
        except ApiError as err:
            yield _sse("error", {"error": str(err), "status": err.status})
            return
        server.start(job)
        started = True
        while True:
            event, data = await queue.get()
            if not event:
                return
            yield _sse(event, data)
    finally:
        stop.set()
        if not started:  # the worker releases the session it ran on
            server.sessions.release(session)


def _static(name: str) -> Response:
    body = resources.files("txl.serve").joinpath("static", name).read_bytes()
    return Response(body, media_type=STATIC[name], headers=SECURITY_HEADERS)


class _HostCheck:
    """Refuse requests whose Host header is not one of `hosts` (DNS rebinding), as JSON."""

    def __init__(self, app, hosts: tuple[str, ...]):
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and None not in self.hosts:
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name not in self.hosts:
                await _error(400, f"Host {host[:60]!r} is not served here; use http://127.0.0.1 "
                                  "(or start with --host NAME to serve that name)")(scope, receive, send)
                return
        await self.app(scope, receive, send)

    @property
    def state(self):
        return self.app.state
