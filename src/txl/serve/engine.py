"""The model side of `txl serve`: loaded runs, per-client decoding state, scoring with attention.

Nothing here knows about HTTP. `Decoder` is one stream's state (memory and the next-token logits) and
makes exactly the forward calls and random draws of `txl.generate.sample` for one row, so a page
generation with a seed equals `txl generate --seed` (tests/test_serve.py checks it). `score` runs the
text through the model in segments with memory the way `txl eval` does with one stream, and on
request returns the attention probabilities of one query over [memory ; segment].
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from txl.checkpoint import LoadedCheckpoint, load_checkpoint
from txl.display import json_text
from txl.errors import UsageError
from txl.generate import TextStream, check_sampling, pick_tokens
from txl.memory import Memory

CURVE_POINTS = 400  # training-curve points sent to the page per split (evenly thinned)


@dataclass
class ServedRun:
    """One run the server was started with. `lock` serialises forward passes on the model (token-level
    interleaving of concurrent streams: fair, and the fast backend's memoised tables are filled once)."""

    name: str
    ckpt: LoadedCheckpoint
    card: dict
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def model(self):
        return self.ckpt.model

    @property
    def vocab(self):
        return self.ckpt.vocab

    @property
    def tgt_len(self) -> int:
        """The segment length `txl eval` uses for this run."""
        return int(self.ckpt.train_setting("eval_tgt_len") or self.ckpt.train_setting("tgt_len") or 128)


def open_run(path: str | Path, *, device: str = "cpu") -> ServedRun:
    ckpt = load_checkpoint(path, device=device, require_vocab=True)
    if not ckpt.model.config.causal:
        raise UsageError(f"{ckpt.path} is a bidirectional (masked-LM) model: it cannot generate text; "
                         "txl serve needs a causal language model")
    run_dir = ckpt.path.parent if ckpt.path.name in ("best", "last") else ckpt.path
    name = run_dir.name
    return ServedRun(name=name, ckpt=ckpt, card=model_card(ckpt, name=name, run_dir=run_dir))


def model_card(ckpt: LoadedCheckpoint, *, name: str, run_dir: Path) -> dict:
    """What the page shows about a run: config, parameter count, corpus, training curve. Read once at
    start-up from files the server was pointed at; no request can name another file."""
    from txl.evaluate import checkpoint_metric

    model = ckpt.model
    train = {}
    for source in (ckpt.run.get("config"), ckpt.state.get("run")):
        if isinstance(source, dict) and isinstance(source.get("train"), dict):
            train = {**source["train"], **train}
    keep = ("tgt_len", "eval_tgt_len", "batch_size", "lr", "max_steps", "warmup_steps", "precision", "seed")
    return {
        "name": name,
        "checkpoint": ckpt.path.name,
        "config": model.config.to_dict(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "corpus": _corpus_name(ckpt.data_spec),
        "vocab": {"kind": ckpt.vocab.kind, "size": ckpt.vocab.size},
        "metric": checkpoint_metric(ckpt),
        "step": ckpt.state.get("step"),
        "train": {k: train[k] for k in keep if k in train},
        "curve": training_curve(run_dir / "metrics.jsonl"),
    }


def _corpus_name(spec: str | None) -> str | None:
    """The corpus without the directory it was read from (the page is no place for local paths)."""
    if not spec:
        return None
    kind, sep, rest = spec.partition(":")
    if not sep:
        return spec
    location, qmark, query = rest.partition("?")
    return f"{kind}:{Path(location).name}{qmark}{query}"


def training_curve(path: Path) -> dict[str, list[list[float]]]:
    """{split: [[step, loss], ...]} from a run's metrics.jsonl ({} when there is none), thinned to
    CURVE_POINTS per split. Damaged lines are skipped: the card is a view, not a check."""
    curve: dict[str, list[list[float]]] = {}
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    for line in lines:
        try:
            record = json.loads(line)
            step, loss, split = int(record["step"]), float(record["loss"]), str(record["split"])
        except (ValueError, KeyError, TypeError):
            continue
        if math.isfinite(loss):
            curve.setdefault(split, []).append([step, loss])
    for split, points in curve.items():
        if len(points) > CURVE_POINTS:
            stride = len(points) / CURVE_POINTS
            curve[split] = [points[int(i * stride)] for i in range(CURVE_POINTS - 1)] + [points[-1]]
    return curve


def token_pieces(vocab, ids: Sequence[int]) -> list[str]:
    """The text each token adds when decoded in order (a byte of a multi-byte character adds "" until
    the character is complete; its last byte adds the character)."""
    pieces: list[str] = []
    current: list[str] = []
    stream = TextStream(vocab, current.append)
    for token in ids:
        current.clear()
        stream.push(int(token))
        pieces.append(json_text("".join(current)))
    current.clear()
    stream.close()
    if current and pieces:
        pieces[-1] += json_text("".join(current))
    return pieces


class Cancelled(Exception):
    """The client went away or the request ran out of time: stop between two forward passes."""


class Decoder:
    """One stream's decoding state for one run: memory and the logits of the next token.

    Mirrors `txl.generate.sample` for a single row: the prompt is fed in chunks of
    max(mem_len, 128) tokens; each new token is one forward with the memory; with mem_len 0 every
    step re-runs a window of the last `window` tokens instead. Continuing a session feeds more text
    on top of the same memory."""

    TAIL = 64  # a session can go on for ever; its state stays bounded

    def __init__(self, run: ServedRun, *, mem_len: int, window: int | None):
        self.run = run
        self.mem_len = mem_len
        self.segment_len = window or max(mem_len, 128)
        self.memory: Memory | None = None
        self.context: torch.Tensor | None = None  # mem_len 0: the window of the last tokens (1, t)
        self.logits: torch.Tensor | None = None  # (1, V) of the next token
        self.length = 0  # tokens fed so far (prompt, continuations, generated): the next token's position
        self.tail: list[int] = []  # the last TAIL of them, the decoding context of the next piece of text

    @torch.no_grad()
    def feed(self, ids: Sequence[int], cancelled=lambda: False) -> None:
        if not ids:
            return
        model = self.run.model
        tokens = torch.tensor([list(ids)], dtype=torch.long, device=next(model.parameters()).device)
        self.length += len(ids)
        self.tail = (self.tail + [int(i) for i in ids])[-self.TAIL :]
        if self.mem_len == 0:
            context = tokens if self.context is None else torch.cat([self.context, tokens], dim=1)
            self.context = context[:, -self.segment_len :]
            with self.run.lock:
                self.logits = model(self.context, mem_len=0).logits[:, -1]
            return
        for chunk in tokens.split(self.segment_len, dim=1):
            if cancelled():
                raise Cancelled
            with self.run.lock:
                out = model(chunk, memory=self.memory, mem_len=self.mem_len)
            self.memory, self.logits = out.memory, out.logits[:, -1]

    def pick(self, *, temperature: float, top_k: int, top_p: float, generator) -> tuple[int, float]:
        """The next token and its log-probability under the model (temperature 1, before filtering)."""
        if self.logits is None:
            raise UsageError("nothing to continue from: give a prompt")
        logits = self.logits.float()
        token = pick_tokens(logits, temperature, top_k, top_p, generator)
        logprob = logits.log_softmax(-1)[0, int(token[0])]
        return int(token[0]), float(logprob)


def generate(decoder: Decoder, *, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
             generator, on_token, cancelled=lambda: False) -> str:
    """Sample up to `max_new_tokens` tokens; `on_token(token, logprob, text)` gets each with the text
    it adds. Returns why it stopped: "max_new_tokens", or raises `Cancelled`. Each token is fed back
    (as `sample` does), so the session can continue from it."""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    pieces: list[str] = []
    stream = TextStream(decoder.run.vocab, pieces.append, prefix=decoder.tail)
    for _ in range(max_new_tokens):
        if cancelled():
            raise Cancelled
        token, logprob = decoder.pick(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        pieces.clear()
        stream.push(token)
        on_token(token, logprob, json_text("".join(pieces)))
        decoder.feed([token])
    return "max_new_tokens"


@torch.no_grad()
def score(run: ServedRun, ids: Sequence[int], *, mem_len: int, tgt_len: int, attention: dict | None = None,
          cancelled=lambda: False) -> dict:
    """Per-token NLL (nats) of ids[1:], scored in segments of `tgt_len` inputs with `mem_len` memory
    per layer, one stream from the start (what `txl eval --batch-size 1` computes). `attention`
    {"token": p, "layer": l, "head": h}: the attention of the query that predicted token p (input
    position p - 1) over [memory ; segment], every layer and head, and the whole segment's matrix
    for layer l, head h."""
    model = run.model
    device = next(model.parameters()).device
    inputs = torch.tensor(list(ids[:-1]), dtype=torch.long, device=device)
    labels = torch.tensor(list(ids[1:]), dtype=torch.long, device=device)
    query = attention["token"] - 1 if attention else -1
    nll: list[float] = []
    found = None
    memory = None
    for start in range(0, len(inputs), tgt_len):
        if cancelled():
            raise Cancelled
        segment = slice(start, start + tgt_len)
        wanted = start <= query < start + tgt_len
        with run.lock:
            out = model(inputs[None, segment], memory=memory, labels=labels[None, segment], mem_len=mem_len,
                        return_logits=False, output_attentions=wanted)
        memory = out.memory if mem_len else None
        nll.extend(out.nll[0].float().tolist())
        if wanted:
            found = _attention_view(out.attentions, start=start, query=query, **attention)
    result = {"nll": nll, "mean_nll": sum(nll) / len(nll), "mem_len": mem_len, "tgt_len": tgt_len}
    if found is not None:
        result["attention"] = found
    return result


def _attention_view(attentions, *, start: int, query: int, token: int, layer: int, head: int) -> dict:
    """attentions: per layer (1, heads, q, keys) over [memory ; segment] for the segment at `start`."""
    q_len = attentions[0].shape[2]
    n_keys = attentions[0].shape[3]
    first_key = start + q_len - n_keys  # keys are the last n_keys inputs up to the segment's end
    row = query - start
    rows = torch.stack([a[0, :, row] for a in attentions]).float()  # (layers, heads, keys)
    positions = torch.arange(first_key, first_key + n_keys, dtype=torch.float32)
    distance = ((query - positions) * rows).sum(-1)  # (layers, heads): expected distance to the keys attended
    matrix = attentions[layer][0, head].float()  # (q, keys)
    return {
        "token": token,
        "query": query,
        "layer": layer,
        "head": head,
        "first_key": first_key,  # input position of key 0 (keys first_key … segment_start - 1 are memory)
        "segment_start": start,
        "segment_end": start + q_len,
        "rows": rows.tolist(),  # [layer][head][key]: the query's attention, every layer and head
        "avg_distance": distance.tolist(),  # [layer][head]
        "matrix": [[round(v, 5) for v in r] for r in matrix.tolist()],  # the segment, layer `layer`, head `head`
    }
