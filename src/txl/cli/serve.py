"""`txl serve RUN [RUN2]`: argument parsing and start-up (no torch or Starlette at import time)."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import math
import socket
import sys

from txl.cli.arguments import add_threads
from txl.errors import UsageError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN",
                        help="a `txl train` run directory or a checkpoint directory (with vocab.json); give two "
                             "to compare them side by side")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only). Anything else "
                             "exposes the model to the network (0.0.0.0: every address of this machine)")
    parser.add_argument("--allow-host", default="", metavar="NAMES",
                        help="host names the page may be opened by, comma-separated (e.g. mybox.lan); "
                             "addresses (http://192.168.1.20:8000/) and localhost always work, other names are "
                             "refused so that a web page elsewhere cannot reach the server (DNS rebinding)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    add_threads(parser)  # applied by txl.cli.main before run(), as for every command that computes
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where to run (default: auto, a GPU when there is one)")
    limits = parser.add_argument_group("limits (each request is refused with a 4xx past them)")
    limits.add_argument("--max-new-tokens", type=int, default=512, help="tokens one generation may ask for (512)")
    limits.add_argument("--max-prompt-tokens", type=int, default=2048, help="prompt tokens (2048)")
    limits.add_argument("--max-score-tokens", type=int, default=4096, help="tokens of a text to score (4096)")
    limits.add_argument("--max-concurrent", type=int, default=4,
                        help="generations and scorings running at once; more wait for a slot (4)")
    limits.add_argument("--timeout", type=float, default=120.0, help="seconds of work per request (120)")
    limits.add_argument("--max-sessions", type=int, default=256, help="client memories kept (256)")
    limits.add_argument("--session-memory", type=float, default=1024,
                        help="MB all client memories may hold; least recently used dropped first (1024)")
    limits.add_argument("--max-connections", type=int, default=512,
                        help="open connections (512; lowered to fit the descriptor limit, ulimit -n)")
    limits.add_argument("--header-timeout", type=float, default=10.0,
                        help="seconds a connection may take to send a request's headers, and its body (10)")


# (low, high) of each number: out of range or not finite ends the start in one line (issue 50)
RANGES = {
    "port": (0, 65535), "max_new_tokens": (1, 1_000_000), "max_prompt_tokens": (1, 1_000_000),
    "max_score_tokens": (1, 1_000_000), "max_concurrent": (1, 1024), "timeout": (0.001, 86400.0),
    "max_sessions": (1, 1_000_000), "session_memory": (1.0, 1_048_576.0), "max_connections": (1, 1_000_000),
    "header_timeout": (0.001, 3600.0),
}


def check_numbers(args: argparse.Namespace) -> None:
    for name, (low, high) in RANGES.items():
        value, flag = getattr(args, name), f"--{name.replace('_', '-')}"
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{flag} must be a finite number, got {value}")
        if name == "port" and not low <= value <= high:
            raise UsageError(f"--port must be in 0…65535, got {value}")
        if name == "timeout" and value <= 0:  # the message of the start-up check before issue 50
            raise UsageError(f"--timeout must be > 0 seconds, got {value}")
        if not low <= value <= high:
            bound = f">= {low:g}" if value < low else f"<= {high:,}" if isinstance(high, int) else f"<= {high:,g}"
            raise UsageError(f"{flag} must be {bound}, got {value:g}")


def allowed_hosts(host: str, allow_host: str) -> tuple[str, ...]:
    """The host names requests may name besides IP addresses and localhost: --allow-host's, and --host
    itself when it is a name (`--host mybox.lan`)."""
    names = [name.strip().lower() for name in allow_host.split(",") if name.strip()]
    for name in names:
        if not all(c.isalnum() or c in "-._" for c in name):
            raise UsageError(f"--allow-host takes host names separated by commas, without scheme or port "
                             f"(e.g. mybox.lan), got {name[:60]!r}")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        names.append(host.lower())
    return tuple(names)


def run(args: argparse.Namespace) -> int:
    check_numbers(args)
    hosts = allowed_hosts(args.host, args.allow_host)  # a bad name ends the start before the model loads
    if len(args.runs) > 2:
        raise UsageError(f"txl serve shows one run or two side by side; got {len(args.runs)}")
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as err:
        raise UsageError(f"txl serve needs the serve extra ({err.name} is not installed): "
                         "pip install 'txl[serve]'") from None
    from txl.cli.arguments import resolve_device
    from txl.serve.app import MB, Limits, create_app
    from txl.serve.connections import Guard, connection_cap, server_config
    from txl.serve.engine import open_run

    device = resolve_device(args.device)
    runs = [open_run(path, device=device) for path in args.runs]
    if len(runs) == 2 and runs[0].name == runs[1].name:
        runs[1].name += " (2)"
    limits = Limits(max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                    max_score_tokens=args.max_score_tokens, max_concurrent=args.max_concurrent,
                    request_timeout=args.timeout, max_sessions=args.max_sessions,
                    session_memory=int(args.session_memory * MB), body_timeout=args.header_timeout)
    loopback = _is_loopback(args.host)
    guard = Guard(max_connections=connection_cap(args.max_connections), header_timeout=args.header_timeout)
    app = create_app(runs, limits, allowed_hosts=hosts, connections=guard)
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    if ipaddress.ip_address(host).is_unspecified:  # 0.0.0.0 or ::, every address: this machine's own link
        host = "::1" if ":" in host else "127.0.0.1"
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/"
    if not loopback:
        print(f"txl serve: warning: listening on {args.host}: anyone who can reach this machine can use the model; "
              f"others open it by this machine's address (http://ADDRESS:{port}/) or a name given with --allow-host",
              file=sys.stderr)
    print(f"txl serve: {', '.join(r.name for r in runs)} at {url} (Ctrl-C to stop)", flush=True)
    config = server_config(app, guard)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn shuts down gracefully, then re-raises the Ctrl-C
        uvicorn.Server(config).run(sockets=[sock])
    print("txl serve: stopped", flush=True)
    return 0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except socket.gaierror as err:
        sock.close()
        raise UsageError(f"--host {host}: {err.strerror}") from None
    except OSError as err:
        sock.close()
        what = "is in use; pick another with --port (0 = any free port)" if err.errno == 98 else f"failed: {err.strerror}"
        raise UsageError(f"listening on {host}:{port} {what}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock
