"""A bounded load test of a running `txl serve` (standard library only):

    python -m txl.serve.load http://127.0.0.1:8000 --clients 16 --requests 20 --tokens 16

Each client thread sends its requests one after another; every request streams a generation and the
client times each token's arrival. Reports errors, p50/p95 time per token (the gap between two
consecutive tokens of one stream, the first token counted from the request) and p50/p95 time to the
first token. Only for a server on this machine: the URL must be a loopback address.
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import statistics
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

from txl.errors import UsageError


def _connection(url: str, timeout: float = 120.0) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    host = parts.hostname or ""
    if host != "localhost":
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise UsageError(f"{url}: the load test only targets a server on this machine (127.0.0.1 or localhost)")
    return http.client.HTTPConnection(host, parts.port or 80, timeout=timeout)


def sse_events(response) -> Iterator[tuple[str, dict]]:
    """(event, data) pairs of a text/event-stream response, as they arrive."""
    event, data = "message", ""
    for raw in response:
        line = raw.decode("utf-8").rstrip("\n")
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data += line[6:]
        elif not line:
            if data:
                yield event, json.loads(data)
            event, data = "message", ""


def post(url: str, path: str, body: dict, timeout: float = 120.0):
    """(connection, response) of a JSON POST; read the response, then close the connection."""
    conn = _connection(url, timeout)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def stream_generation(url: str, body: dict, timeout: float = 120.0) -> dict:
    """One streamed generation: {"status", "events": [(event, data)], "gaps": [s per token], "error"}."""
    started = time.perf_counter()
    conn, response = post(url, "/api/generate", body, timeout)
    try:
        if response.status != 200:
            return {"status": response.status, "events": [], "gaps": [], "error": json.loads(response.read())["error"]}
        events, gaps, last = [], [], started
        for event, data in sse_events(response):
            now = time.perf_counter()
            events.append((event, data))
            if event == "token":
                gaps.append(now - last)
                last = now
        error = next((d["error"] for e, d in events if e == "error"), None)
        return {"status": 200, "events": events, "gaps": gaps, "error": error}
    finally:
        conn.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def run_load(url: str, *, clients: int = 16, requests: int = 20, tokens: int = 16, prompt: str = "the memory",
             timeout: float = 120.0) -> dict:
    """`clients` threads × `requests` sequential streamed generations of `tokens` tokens each."""
    results: list[dict] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        for n in range(requests):
            try:
                result = stream_generation(url, {"prompt": prompt, "max_new_tokens": tokens, "seed": index * requests + n},
                                           timeout)
            except OSError as err:
                result = {"status": 0, "events": [], "gaps": [], "error": f"{type(err).__name__}: {err}"}
            with lock:
                results.append(result)

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started
    errors = [r["error"] or f"HTTP {r['status']}" for r in results if r["status"] != 200 or r["error"]]
    incomplete = [r for r in results if not errors and not any(e == "done" for e, _ in r["events"])]
    per_token = [g for r in results for g in r["gaps"][1:]]
    first = [r["gaps"][0] for r in results if r["gaps"]]
    count = sum(len(r["gaps"]) for r in results)
    ms = lambda values, q: 1000 * percentile(values, q) if values else None  # noqa: E731
    return {"clients": clients, "requests": len(results), "errors": len(errors) + len(incomplete),
            "first_errors": errors[:3], "tokens": count, "seconds": seconds, "tokens_per_second": count / seconds,
            "p50_ms_per_token": ms(per_token, 50), "p95_ms_per_token": ms(per_token, 95),
            "p50_ms_first_token": ms(first, 50), "p95_ms_first_token": ms(first, 95),
            "median_ms_per_token": 1000 * statistics.median(per_token) if per_token else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m txl.serve.load", description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=20, help="requests per client")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per generation")
    parser.add_argument("--prompt", default="the memory")
    args = parser.parse_args(argv)
    if min(args.clients, args.requests, args.tokens) < 1 or args.clients * args.requests > 10_000:
        parser.error("--clients, --requests and --tokens must be >= 1, and clients × requests <= 10000")
    try:
        print(json.dumps(run_load(args.url, clients=args.clients, requests=args.requests, tokens=args.tokens,
                                  prompt=args.prompt), indent=2))
    except UsageError as err:
        parser.error(str(err))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
