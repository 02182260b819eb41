"""What a `txl serve` request may ask for: the server's limits (`Limits`), refusals (`ApiError`: a status
and one line), the Host headers served (`host_allowed`), and request bodies read and checked field by
field (`read_json`, `parse_fields`: a JSON object with known fields, types and ranges; anything else is
a 4xx naming the field)."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
from dataclasses import dataclass
from typing import Any

import torch
from starlette.requests import Request

from txl.data.display import json_text

MB = 1 << 20
LOOPBACK_NAMES = ("localhost",)  # loopback addresses are IP literals, served as every address is


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
    body_timeout: float = 10.0  # seconds for a request's body to arrive once its headers have
    max_response_bytes: int = 4 * MB  # a /api/score answer (the attention view alone is at most ~1.3 MB)
    max_sessions: int = 256  # client sessions kept (least recently used dropped first)
    session_memory: int = 1024 * MB  # bytes all client sessions may hold (least recently used dropped first)
    session_ttl: float = 3600.0  # seconds an idle session keeps its memory


class ApiError(Exception):
    """A refusal: its status and one line. retry_after: seconds, sent as Retry-After (503s)."""

    def __init__(self, status: int, message: str, *, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


def host_name(host: str) -> str:
    """The name in a Host header, lower-cased, without its port or an IPv6 address's brackets."""
    host = host.strip().lower()
    if host.startswith("["):  # [v6]:port
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def host_allowed(host: str, names: frozenset[str]) -> bool:
    """Whether a request with this Host header is served. DNS rebinding needs a name: a page at
    attacker.example re-points that name to this machine, and the browser then sends `Host:
    attacker.example`. A Host that is an IP address was reached by that address, with no name to
    re-point, so every IP literal is accepted (`--host 0.0.0.0` reached as http://192.168.1.20:8000/);
    names only when they are in `names` (loopback names and `--allow-host`)."""
    name = host_name(host)
    if name in names:
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def out_of_memory(err: BaseException) -> bool:
    """torch's CPU allocator raises RuntimeError("... can't allocate memory ..."), CUDA OutOfMemoryError."""
    return isinstance(err, MemoryError | torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "can't allocate memory" in str(err))


def one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {json_text(str(err)).splitlines()[0][:200] if str(err) else ''}"


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
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:  # JSON may carry "\ud800"; text is never encoded with it
            raise ApiError(422, f"field {name!r} holds a lone surrogate (\\u{ord(value[err.start]):04x} at character "
                                f"{err.start}), which is not text: send valid Unicode") from None
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


async def read_json(request: Request, limit: int, timeout: float = 10.0) -> Any:
    """The body as JSON: at most `limit` bytes, arriving within `timeout` seconds (a client that sends
    its headers and then trickles or stalls its body holds a connection only that long)."""
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        raise ApiError(415, "send the body as JSON with Content-Type: application/json")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise ApiError(413, f"the request body is larger than this server's limit of {limit:,} bytes")

    async def whole() -> bytearray:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError(413, f"the request body is larger than this server's limit of {limit:,} bytes")
        return body

    try:
        body = await asyncio.wait_for(whole(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s; send it at once") from None
    try:
        return json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not UTF-8") from None
    except (ValueError, RecursionError) as err:
        raise ApiError(400, f"the request body is not valid JSON ({str(err)[:80]})") from None


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


def bounded_fields(limits: Limits) -> tuple[dict[str, Field], dict[str, Field]]:
    """The fields of /api/generate and /api/score with this server's bounds."""
    generate_fields = dict(GENERATE_FIELDS)
    generate_fields["prompt"] = Field(str, "", high=limits.max_prompt_tokens * 8)
    generate_fields["max_new_tokens"] = Field(int, min(50, limits.max_new_tokens), low=1, high=limits.max_new_tokens)
    generate_fields["mem_len"] = Field(int, None, low=0, high=limits.max_mem_len)
    score_fields = dict(SCORE_FIELDS)
    score_fields["text"] = Field(str, None, high=limits.max_score_tokens * 8)
    score_fields["ids"] = Field(list, None, high=limits.max_score_tokens)
    score_fields["mem_len"] = Field(int, None, low=0, high=limits.max_mem_len)
    return generate_fields, score_fields
