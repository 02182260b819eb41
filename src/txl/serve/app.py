"""The HTTP side of `txl serve`: a Starlette app over `txl.serve.engine`.

    GET  /               the playground page (static files shipped in the package; no CDN)
    GET  /health         {"status": "ok", "active": …, "waiting": …, "sessions": …}
    GET  /api/model      the model cards and the server's limits
    POST /api/generate   server-sent events: start, token…, done (or error)
    POST /api/score      per-token NLL of a text or ids; with "attention", one query's attention

Every request is bounded (body size and the time it takes to arrive, prompt and text length, new
tokens, concurrent work, time, response size) and every refusal is one JSON object {"error": "…"}
with a 4xx status, or 503 with a Retry-After header when the server is full; a bug is one JSON 500
and one line in the log, never a traceback. Client sessions live within a memory budget (least
recently used dropped first). Connections (open count, header time) are guarded by
`txl.serve.connections`. Requests name runs by their index in the order the server was started with:
nothing a client sends is ever used as a path, and the only files served are the page's own (a fixed
list). Work runs in threads, one forward pass at a time per model, and stops between two forward
passes when its client goes away or its time is up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from importlib import resources
from time import monotonic, perf_counter  # `monotonic`: the request deadlines' clock (tests fake it)
from typing import Any

import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from txl.data.display import json_text
from txl.errors import TxlError
from txl.generate.text import encode_prompt, prompt_notice
from txl.serve.engine import (
    VIEW_MAX_ROWS,
    Cancelled,
    Decoder,
    NotFinite,
    ServedRun,
    generate,
    no_attention_view,
    score,
    token_pieces,
)
from txl.serve.requests import (
    ATTENTION_FIELDS,
    LOOPBACK_NAMES,
    MB,
    ApiError,
    Limits,
    bounded_fields,
    host_allowed,
    one_line,
    out_of_memory,
    parse_fields,
    read_json,
)
from txl.serve.sessions import Session, Sessions

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
log = logging.getLogger("txl.serve")


def _error(status: int, message: str, *, retry_after: int | None = None) -> JSONResponse:
    headers = SECURITY_HEADERS if retry_after is None else {**SECURITY_HEADERS, "retry-after": str(retry_after)}
    return JSONResponse({"error": json_text(message)}, status_code=status, headers=headers)


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
        self.outcomes: deque[bool] = deque(maxlen=8)  # the last API requests: True = failed on our side (500)
        self.failures = 0  # 500 answers and generations ended by an internal error, since the start
        self.connections = None  # txl.serve.connections.Guard, when the server runs behind one

    def note(self, failed: bool) -> None:
        self.outcomes.append(failed)
        self.failures += failed

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
        except asyncio.TimeoutError:
            raise ApiError(503, f"no work slot became free within {self.limits.queue_timeout:g} s; "
                                "try again shortly", retry_after=max(1, round(self.limits.queue_timeout))) from None
        finally:
            self.waiting -= 1
        self.active += 1

    def release(self) -> None:
        self.active -= 1
        self.slots.release()

    def start(self, job: Callable[[], Any]) -> asyncio.Future:
        """Run `job` in a worker thread; its slot is freed when the thread is done (not before), and an
        error nobody awaited any more (a request past its deadline) is collected, not logged."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self.pool, job)

        def done(f: asyncio.Future) -> None:
            self.release()
            if not f.cancelled():
                f.exception()

        future.add_done_callback(done)
        return future

    def health(self) -> tuple[int, dict]:
        """(HTTP status, body) of GET /health: "ok"; "full" (503) when a new session or request cannot
        start now; "failing" (503) when each of the last 8 API requests failed on the server's side."""
        status = "ok"
        if len(self.outcomes) == self.outcomes.maxlen and all(self.outcomes):
            status = "failing"
        elif self.sessions.full() or (self.slots is not None and self.slots.locked()
                                      and self.waiting >= self.limits.max_waiting):
            status = "full"
        body = {"status": status, "runs": len(self.runs), "active": self.active, "waiting": self.waiting,
                "sessions": len(self.sessions), "session_bytes": self.sessions.nbytes,
                "session_budget_bytes": self.limits.session_memory, "sessions_dropped": self.sessions.evicted,
                "failures": self.failures, "tokens": self.served_tokens, "recent": list(self.recent)}
        if self.connections is not None:
            body.update(self.connections.stats())
        return (200 if status == "ok" else 503), body


def _sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def create_app(runs: list[ServedRun], limits: Limits | None = None, *, allowed_hosts: tuple[str, ...] = (),
               connections=None):
    """The ASGI app. A request's Host header must be an IP address (with or without a port), a loopback
    name, or one of `allowed_hosts` (host names, `txl serve --allow-host`); any other name is refused,
    which keeps a web page elsewhere from reaching this server through DNS rebinding (see
    `host_allowed`). connections: the `txl.serve.connections.Guard` it runs behind (its counts go into
    GET /health)."""
    limits = limits or Limits()
    server = Server(runs, limits)
    server.connections = connections
    hosts = frozenset(name.lower() for name in (*LOOPBACK_NAMES, *allowed_hosts))
    generate_fields, score_fields = bounded_fields(limits)

    page = _read_page()

    async def index(request: Request) -> Response:
        return Response(page["index.html"], media_type=STATIC["index.html"], headers=SECURITY_HEADERS)

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC:
            raise ApiError(404, "not found")
        return Response(page[name], media_type=STATIC[name], headers=SECURITY_HEADERS)

    async def health(request: Request) -> Response:
        status, body = server.health()
        return JSONResponse(body, status_code=status, headers=SECURITY_HEADERS)

    async def model_info(request: Request) -> Response:
        cards = [{**run.card, "eval_tgt_len": run.tgt_len, "no_attention_view": no_attention_view(run)} for run in runs]
        return JSONResponse({"runs": cards, "limits": asdict(limits)}, headers=SECURITY_HEADERS)

    async def generate_route(request: Request) -> Response:
        args = parse_fields(await read_json(request, limits.max_body_bytes, limits.body_timeout), generate_fields)
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
        window = run.window if mem_len == 0 else None  # as `txl generate`
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
            session = server.sessions.take(key, lambda: Decoder(run, mem_len=mem_len, window=window),
                                           reserve=run.session_bytes(mem_len=mem_len, window=window))
        # "continue" without a seed draws on from the session's random stream (20 tokens + 15 = 35 at once)
        seed = args["seed"] if args["seed"] is not None or args["continue"] else secrets.randbits(62)
        settings = {k: args[k] for k in ("max_new_tokens", "temperature", "top_k", "top_p")}
        notice = prompt_notice(run.vocab, args["prompt"])  # words read as <unk>, named (issue 45), or None
        return StreamingResponse(_generation(server, run, session, session_id, ids, seed, settings, notice),
                                 media_type="text/event-stream", headers={**SECURITY_HEADERS, "x-accel-buffering": "no"})

    async def score_route(request: Request) -> Response:
        args = parse_fields(await read_json(request, limits.max_body_bytes, limits.body_timeout), score_fields)
        run = server.run_of(args["run"])
        if (args["text"] is None) == (args["ids"] is None):
            raise ApiError(422, "give exactly one of \"text\" and \"ids\"")
        if args["text"] is not None:
            from txl.eval.corpus import encode_text

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
            if config.n_layer * config.n_head > VIEW_MAX_ROWS:
                raise ApiError(422, f"the attention view covers at most {VIEW_MAX_ROWS:,} layer x head rows; this model "
                                    f"has {config.n_layer * config.n_head:,}: score without 'attention'")
        mem_len = args["mem_len"]
        if mem_len is None:
            mem_len = min(run.eval_mem_len, limits.max_mem_len)
        tgt_len = args["tgt_len"] or run.tgt_len

        def job() -> bytes:  # in a worker thread: the scoring and the JSON (never on the event loop)
            result = score(run, ids, mem_len=mem_len, tgt_len=tgt_len, attention=attention,
                           cancelled=lambda: monotonic() > deadline)
            result.update(run=args["run"], ids=ids, tokens=token_pieces(run.vocab, ids), metric=run.card["metric"])
            body = json.dumps(result, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
            if len(body) > limits.max_response_bytes:
                raise ApiError(413, f"the answer would be {len(body):,} bytes, more than this server's limit of "
                                    f"{limits.max_response_bytes:,}: score a shorter text")
            return body

        await server.acquire()
        deadline = monotonic() + limits.request_timeout
        future = server.start(job)
        late = ApiError(503, f"scoring took longer than this server's limit of {limits.request_timeout:g} s; score a "
                             "shorter text or smaller tgt_len/mem_len", retry_after=1)
        try:  # answered at the deadline even while a long forward pass is still running (it stops after it)
            body = await asyncio.wait_for(asyncio.shield(future), max(deadline - monotonic(), 0.001))
        except (asyncio.TimeoutError, Cancelled):
            raise late from None
        except NotFinite as err:
            raise ApiError(500, str(err)) from None
        except TxlError as err:
            raise ApiError(422, str(err)) from None
        except Exception as err:
            if out_of_memory(err):
                raise ApiError(503, "the server ran out of memory for this request; score a shorter text or a smaller "
                                    "tgt_len/mem_len, or try again shortly", retry_after=5) from None
            raise
        return Response(body, media_type="application/json", headers=SECURITY_HEADERS)

    async def on_api_error(request: Request, err: ApiError) -> Response:
        return _error(err.status, str(err), retry_after=err.retry_after)

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
    return _Guard(app, hosts, server)


async def _generation(server: Server, run: ServedRun, session: Session, session_id: str, ids: list[int], seed: int | None,
                      settings: dict, notice: str | None = None):
    """The event stream of one generation. Runs in the response task: when the client disconnects,
    Starlette cancels it, `finally` sets `stop`, and the worker ends at its next forward pass, which
    frees the slot."""
    limits = server.limits
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()
    deadline = monotonic() + limits.request_timeout
    timed_out = []

    def cancelled() -> bool:
        if monotonic() > deadline:
            timed_out.append(True)
            return True
        return stop.is_set()

    def put(event: str, data: dict) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (event, data))

    def job() -> None:
        decoder = session.decoder
        count = 0
        started = perf_counter()

        def on_token(token: int, logprob: float, text: str) -> None:
            nonlocal count
            put("token", {"i": decoder.length, "id": token, "text": text, "logprob": logprob})
            count += 1

        stopped_by = "max_new_tokens"
        try:
            if seed is not None or decoder.generator is None:
                decoder.seed = secrets.randbits(62) if seed is None else seed
                decoder.generator = torch.Generator().manual_seed(decoder.seed)
            generator = decoder.generator
            decoder.feed(ids, cancelled)
            put("start", {"run": run.name, "session": session_id, "seed": decoder.seed, "reseeded": seed is not None,
                          "mem_len": decoder.mem_len, "first": decoder.length - len(ids), "prompt_ids": ids,
                          "prompt_pieces": token_pieces(run.vocab, ids), "notice": notice, **settings})
            generate(decoder, generator=generator, on_token=on_token, cancelled=cancelled, **settings)
        except Cancelled:
            stopped_by = "time_limit" if timed_out else "disconnected"
        except TxlError as err:
            stopped_by = "error"
            put("error", {"error": json_text(str(err)), "status": 422})
        except NotFinite as err:
            stopped_by = "error"
            server.note(True)
            put("error", {"error": str(err), "status": 500})
        except Exception as err:  # never let one request take the server down
            stopped_by = "error"
            server.note(True)
            if out_of_memory(err):
                put("error", {"error": "the server ran out of memory for this generation; try a shorter prompt, a "
                                       "smaller mem_len, or again shortly", "status": 503, "retry_after": 5})
            else:
                log.error("txl serve: internal error in a generation: %s", one_line(err))
                put("error", {"error": f"internal error ({type(err).__name__}); the server keeps running",
                              "status": 500})
        finally:
            server.sessions.release(session)
        seconds = perf_counter() - started
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
            yield _sse("error", {"error": str(err), "status": err.status,
                                 **({"retry_after": err.retry_after} if err.retry_after else {})})
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


def _read_page() -> dict[str, bytes]:
    """The page's files, read once when the app is made (the only files read after start-up: none)."""
    from txl.io import read_bytes

    folder = resources.files("txl.serve").joinpath("static")
    page = {}
    for name in STATIC:
        with resources.as_file(folder.joinpath(name)) as path:
            page[name] = read_bytes(path, what="a page file of txl serve", limit=4 * MB)
    return page


class _Guard:
    """The outermost layer: refuse requests whose Host header is a name not in `hosts` (DNS rebinding),
    as JSON; count the API answers that failed on our side (GET /health); and end any exception that
    escaped the app as one JSON 500 and one log line. Starlette's error middleware re-raises after
    answering, which made uvicorn print a traceback for each (issue 50)."""

    def __init__(self, app, hosts: frozenset[str], server: Server):
        self.app = app
        self.hosts = hosts
        self.server = server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if not host_allowed(host, self.hosts):
            port = host.rpartition(":")[2] if host.rpartition(":")[2].isdigit() else "PORT"
            await _error(400, f"Host {host[:60]!r} is not served here; open the server by its IP address (e.g. http://"
                              f"127.0.0.1:{port[:5]}/), or start txl serve with --allow-host NAME to serve that name")(
                scope, receive, send)
            return
        answered = []

        async def sending(message):
            if message["type"] == "http.response.start":
                answered.append(message["status"])
                if scope["path"].startswith("/api/"):
                    self.server.note(message["status"] == 500)  # a 503 is the server full, not failing
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as err:
            log.error("txl serve: internal error in %s %s: %s", scope.get("method"), scope.get("path", "")[:100],
                      one_line(err))
            if not answered:
                await _error(500, f"internal error ({type(err).__name__}); the server keeps running")(
                    scope, receive, sending)

    @property
    def state(self):
        return self.app.state
