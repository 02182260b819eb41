"""The model side of `txl serve`: loaded runs, per-client decoding state, scoring with attention.

Nothing here knows about HTTP. `Decoder` is one session's state (memory and the next-token logits): the
library's `txl.generate.decoder.Decoder` and the one token picker (`txl.nn.sampling.pick_tokens`), so it
makes exactly the forward calls and random draws of `txl.generate.decoder.sample` for one row and a page
generation with a seed equals `txl generate --seed` (tests/test_serve.py checks it). `score` runs the
text through the model in segments with memory the way `txl eval` does with one stream, and on
request returns the attention probabilities of one query over [memory ; segment], downsampled to a
bounded number of cells (issue 50: a 4096 x 8192 matrix was 97 MB of JSON).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from txl.data.display import json_text
from txl.errors import CheckpointError, UsageError
from txl.generate.decoder import Decoder as StreamDecoder
from txl.generate.text import TextStream
from txl.models.checkpoint import LoadedCheckpoint, load_checkpoint
from txl.models.registry import not_a_language_model
from txl.nn.memory import Memory
from txl.nn.sampling import check_sampling, pick_tokens

CURVE_POINTS = 400  # training-curve points sent to the page per split (evenly thinned)
CURVE_LINE_BYTES = 64 * 1024  # a metrics.jsonl line longer than this is damaged: skipped, never held whole

# The attention view (issue 50): at most VIEW_QUERIES x VIEW_KEYS cells for the chosen head's matrix and
# VIEW_ROW_CELLS for the query's rows over every layer and head; keys are summed and queries averaged in
# equal runs ("keys_per_cell", "queries_per_row" in the response), so every row still sums to 1. Rows
# are rounded to 8 decimals (at most 11 bytes of JSON a cell), the matrix to 5 (8 bytes): the view is
# at most about 1.3 MB.
VIEW_QUERIES = 128
VIEW_KEYS = 512
VIEW_ROW_CELLS = 65536
VIEW_MAX_ROWS = 4096  # layers x heads beyond this: no view (no served model comes near it)


@dataclass
class ServedRun:
    """One run the server was started with. `lock` serialises forward passes on the model (token-level
    interleaving of concurrent streams: fair, and the fast backend's memoised tables are filled once)."""

    name: str
    ckpt: LoadedCheckpoint
    card: dict
    tgt_len: int = 128  # the segment length `txl eval` uses for this run (eval_tgt_len, else tgt_len)
    window: int | None = None  # with mem_len 0, generation re-runs the last `window` tokens (train tgt_len)
    eval_mem_len: int = 0  # the memory `txl eval` uses (eval_mem_len, else the model's mem_len)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def session_bytes(self, *, mem_len: int, window: int | None) -> int:
        """What one client session of this run holds at most between two requests: per layer mem_len
        hidden states (plus the compressed ones), the next-token logits, and with mem_len 0 the window
        of ids. The server reserves this when a session starts; `Decoder.nbytes` is the measured size."""
        config = self.model.config
        itemsize = next(self.model.parameters()).element_size()
        # + 1: after a generated token the memory is a view of [memory ; token] (compacting it at every
        # token would copy it twice per step); a prompt's longer chunk is compacted (Decoder.feed)
        states = (mem_len + 1 + getattr(config, "cmem_len", 0)) * config.n_layer * config.d_model * itemsize
        return states + config.vocab_size * 4 + (window or 0) * 8

    @property
    def model(self):
        return self.ckpt.model

    @property
    def vocab(self):
        return self.ckpt.vocab


def open_run(path: str | Path, *, device: str = "cpu") -> ServedRun:
    ckpt = load_checkpoint(path, device=device, require_vocab=True)
    for name, tensor in ckpt.model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{ckpt.path}: the weights hold NaN or infinite values ({name}); this checkpoint "
                                  "cannot score or generate: serve another one (e.g. the run's last/ or best/) "
                                  "or retrain")
    config = ckpt.model.config
    other = not_a_language_model(config)
    if other is not None:
        raise UsageError(f"{ckpt.path} is {other[0]}: txl serve continues text with a language model; {other[1]}")
    if not config.causal:
        raise UsageError(f"{ckpt.path} is a bidirectional (masked-LM) model: it cannot generate text; "
                         "txl serve needs a causal language model")
    run_dir = ckpt.path.parent if ckpt.path.name in ("best", "last") else ckpt.path
    name = run_dir.name
    window = _setting(ckpt, "tgt_len", low=1)
    eval_mem_len = _setting(ckpt, "eval_mem_len", low=0)
    return ServedRun(name=name, ckpt=ckpt, card=model_card(ckpt, name=name, run_dir=run_dir),
                     tgt_len=_setting(ckpt, "eval_tgt_len", low=0) or window or 128, window=window,
                     eval_mem_len=ckpt.model.mem_len if eval_mem_len is None else eval_mem_len)


def _setting(ckpt: LoadedCheckpoint, key: str, *, low: int) -> int | None:
    """A [train] length recorded with the run (run.json, trainer_state.json), checked: an integer in
    low…MAX_LENGTH, or None when it is not recorded. Anything else ends the start in one line."""
    from txl.nn.options import MAX_LENGTH

    value = ckpt.train_setting(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and low <= value <= MAX_LENGTH):
        return value
    raise CheckpointError(f"{ckpt.path}: the run records train.{key} = {json.dumps(value)[:40]}, not an integer in "
                          f"{low}…{MAX_LENGTH:,}; fix it in the run's run.json or last/trainer_state.json")


def model_card(ckpt: LoadedCheckpoint, *, name: str, run_dir: Path) -> dict:
    """What the page shows about a run: config, parameter count, corpus, training curve. Read once at
    start-up from files the server was pointed at; no request can name another file."""
    from txl.eval.corpus import checkpoint_metric

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
    CURVE_POINTS per split. Damaged lines are skipped: the card is a view, not a check. The file is
    opened as a regular file only (a FIFO planted there is refused in one line, not waited on for
    ever) and read line by line: at most METRICS_LIMIT bytes, lines past CURVE_LINE_BYTES skipped, and
    at most 4 x CURVE_POINTS points per split held at once (every other one dropped when full)."""
    from txl.io import METRICS_LIMIT, open_regular

    if not os.path.lexists(path):
        return {}
    handle = open_regular(path, what="the run's metrics.jsonl", limit=METRICS_LIMIT)
    curve: dict[str, list[list[float]]] = {}
    stride: dict[str, int] = {}  # per split: keep every stride-th point
    seen: dict[str, int] = {}
    last: dict[str, list[float]] = {}
    read = 0
    with handle:
        while read < METRICS_LIMIT:
            line = handle.readline(CURVE_LINE_BYTES + 1)
            if not line:
                break
            read += len(line)
            if len(line) > CURVE_LINE_BYTES:  # the rest of a damaged line: skip to its end
                while line and not line.endswith(b"\n") and read < METRICS_LIMIT:
                    line = handle.readline(CURVE_LINE_BYTES + 1)
                    read += len(line)
                continue
            try:
                record = json.loads(line)
                step, loss, split = int(record["step"]), float(record["loss"]), str(record["split"])[:40]
            except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
                continue
            if not math.isfinite(loss):
                continue
            points = curve.setdefault(split, [])
            if len(points) >= 4 * CURVE_POINTS:
                del points[1::2]
                stride[split] = stride.get(split, 1) * 2
            index = seen[split] = seen.get(split, -1) + 1
            last[split] = [step, loss]
            if index % stride.get(split, 1) == 0:
                points.append([step, loss])
    for split, points in curve.items():
        if points[-1] != last[split]:
            points.append(last[split])
        if len(points) > CURVE_POINTS:
            stride_ = len(points) / CURVE_POINTS
            curve[split] = [points[int(i * stride_)] for i in range(CURVE_POINTS - 1)] + [points[-1]]
    return curve


def no_attention_view(run: ServedRun) -> str | None:
    """Why the page shows no attention for this run, in one plain sentence; None when it does. (The API's
    own refusal of an "attention" request says the same in its terms: app.score_route.)"""
    config = run.model.config
    if config.arch == "lstm":
        return f"{run.name} is a recurrent model (LSTM): it has no attention to show."
    if config.arch == "sha-rnn":
        return (f"{run.name} is a recurrent model (SHA-RNN): its single attention layer is not drawn here; the "
                "attention view is for Transformer runs.")
    if config.n_layer * config.n_head > VIEW_MAX_ROWS:
        return (f"{run.name} has {config.n_layer * config.n_head:,} layer × head pairs, more than the attention view "
                f"draws ({VIEW_MAX_ROWS:,}).")
    return None


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


class NotFinite(Exception):
    """The model's scores came out NaN or infinite (damaged weights, or an overflow): one line, never a
    NaN in the JSON."""


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """Bytes of the storages behind `tensors` (a view keeps its whole storage alive), each counted once."""
    storages = {}
    for tensor in tensors:
        if tensor is not None:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class Decoder(StreamDecoder):
    """One client session's decoding state for one run: `txl.generate.decoder.Decoder` for one row (the
    same forward calls as `sample`, under the run's lock), plus what a session needs. The prompt is fed
    in chunks of max(mem_len, 128) tokens; each new token is one forward with the memory; with mem_len 0
    every step re-runs a window of the last `window` tokens instead. Continuing a session feeds more
    text on top of the same memory. Between two requests it holds no more than
    `ServedRun.session_bytes` (and its random generator's few KB): the logits and the window are copied out of longer buffers (the base
    class does), and a memory that is a view into a longer [memory ; chunk] buffer is compacted."""

    TAIL = 64  # a session can go on for ever; its state stays bounded

    def __init__(self, run: ServedRun, *, mem_len: int, window: int | None):
        super().__init__(run.model, mem_len=mem_len, segment_len=window, lock=run.lock)
        self.run = run
        self.window = window
        self.length = 0  # tokens fed so far (prompt, continuations, generated): the next token's position
        self.tail: list[int] = []  # the last TAIL of them, the decoding context of the next piece of text
        self.seed: int | None = None  # the seed of `generator`, the session's random stream ("continue" draws on)
        self.generator: torch.Generator | None = None

    def nbytes(self) -> int:
        """The bytes this session holds now (memory storages, logits, window)."""
        memory = () if self.memory is None else (*self.memory.hidden, *self.memory.compressed)
        return tensor_bytes(*memory, self.logits, self.context)

    def feed(self, ids: Sequence[int], cancelled=lambda: False) -> None:
        if not ids:
            return
        self.length += len(ids)
        self.tail = (self.tail + [int(i) for i in ids])[-self.TAIL :]

        def stop_if_cancelled() -> None:
            if cancelled():
                raise Cancelled

        super().feed(torch.tensor([list(ids)], dtype=torch.long), before_chunk=stop_if_cancelled)
        if len(ids) > 1 and self.memory is not None:  # a view of the longer [memory ; chunk]: keep only itself
            held = sum(t.numel() * t.element_size() for t in (*self.memory.hidden, *self.memory.compressed))
            if tensor_bytes(*self.memory.hidden, *self.memory.compressed) > held:
                self.memory = Memory(tuple(h.clone() for h in self.memory.hidden),
                                     tuple(c.clone() for c in self.memory.compressed),
                                     key_padding=self.memory.key_padding)  # a reset row's padding stays

    def restart(self) -> None:
        """Start the session's text over on the same decoder (its random stream kept): the library's row
        reset (`txl.generate.decoder.Decoder.reset`, `Memory.reset`), so the next prompt is read as a
        fresh session's would be."""
        self.reset([0])
        self.length, self.tail, self.logits = 0, [], None

    def pick(self, *, temperature: float, top_k: int, top_p: float, generator) -> tuple[int, float]:
        """The next token and its log-probability under the model (temperature 1, before filtering)."""
        if self.logits is None:
            raise UsageError("nothing to continue from: give a prompt")
        logits = self.logits.float()
        if not bool(torch.isfinite(logits).all()):
            raise NotFinite("the model's next-token scores are NaN or infinite; this checkpoint cannot generate "
                            "from here (its weights may be damaged): try another prompt or checkpoint")
        token = pick_tokens(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
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
    position p - 1) over [memory ; segment], every layer and head, and the segment's matrix for
    layer l, head h, downsampled to at most VIEW_QUERIES x VIEW_KEYS cells (see `AttentionView`)."""
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
        view = AttentionView(start=start, query=query, layers=model.config.n_layer, **attention) if wanted else None
        with run.lock, (view.hooks(model) if view else contextlib.nullcontext()):
            out = model(inputs[None, segment], memory=memory, labels=labels[None, segment], mem_len=mem_len,
                        return_logits=False, output_attentions=view is not None)
        memory = out.memory if mem_len else None
        nll.extend(out.nll[0].float().tolist())
        if view is not None:
            if cancelled():
                raise Cancelled
            found = view.result()
    if not all(math.isfinite(v) for v in nll):
        raise NotFinite("the model's scores for this text are NaN or infinite (its weights may be damaged, or "
                        "the text overflows them): try another text or checkpoint")
    result = {"nll": nll, "mean_nll": sum(nll) / len(nll), "mem_len": mem_len, "tgt_len": tgt_len}
    if found is not None:
        result["attention"] = found
    return result


def _cell_size(n: int, most: int) -> int:
    """Entries per cell so that n entries fill at most `most` cells."""
    return max(1, -(-n // most))


def _sum_cells(x: torch.Tensor, per: int) -> torch.Tensor:
    """x (..., n) -> (..., ceil(n / per)): sums of runs of `per` entries (the last run may be shorter)."""
    if per == 1:
        return x
    return torch.nn.functional.pad(x, (0, -x.shape[-1] % per)).unflatten(-1, (-1, per)).sum(-1)


def _json_numbers(x: torch.Tensor, decimals: int) -> list:
    """Values rounded in float64 (so they print as short decimals in JSON)."""
    return x.double().round(decimals=decimals).tolist()


class AttentionView:
    """The attention of one query, taken from each layer as the layer returns it (a forward hook that
    keeps what the view needs and hands the model None), so one layer's (heads, queries, keys)
    probabilities are alive at a time, never all layers' (issue 50: 2.7 GB for one request).

    The result holds, over the keys [memory ; segment] (input positions first_key … segment_end - 1):
    "rows" [layer][head][cell], the query's attention summed over runs of `keys_per_cell` keys; the
    chosen head's "matrix" [row][cell], each row the mean over `queries_per_row` consecutive queries;
    "avg_distance" [layer][head], computed before any summing. Cells are at most VIEW_KEYS wide,
    rows over all layers and heads at most VIEW_ROW_CELLS, the matrix at most VIEW_QUERIES tall."""

    def __init__(self, *, start: int, query: int, layers: int, token: int, layer: int, head: int):
        self.start, self.query, self.layers, self.token, self.layer, self.head = start, query, layers, token, layer, head
        self.rows: list[torch.Tensor] = []  # per layer (heads, key cells)
        self.distance: list[torch.Tensor] = []  # per layer (heads,)
        self.matrix: torch.Tensor | None = None  # (query cells, key cells) of the chosen layer and head
        self.q_len = self.n_keys = 0
        self.keys_per_cell = self.queries_per_row = 1

    @contextlib.contextmanager
    def hooks(self, model):
        handles = [block.register_forward_hook(self._take) for block in model.blocks]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _take(self, module, args, output):
        hidden, probs = output
        if probs is None:
            return None
        probs = probs[0].float()  # (heads, q, keys)
        heads, self.q_len, self.n_keys = probs.shape
        if not self.rows:
            self.keys_per_cell = _cell_size(self.n_keys, min(VIEW_KEYS, VIEW_ROW_CELLS // (self.layers * heads)))
            self.queries_per_row = _cell_size(self.q_len, VIEW_QUERIES)
        row = probs[:, self.query - self.start]  # (heads, keys)
        positions = torch.arange(self.start + self.q_len - self.n_keys, self.start + self.q_len, dtype=torch.float32)
        self.distance.append(((self.query - positions) * row).sum(-1))  # expected distance to the keys attended
        self.rows.append(_sum_cells(row, self.keys_per_cell).clone())  # (heads, key cells); not a view of probs
        if len(self.rows) - 1 == self.layer:
            keys = _sum_cells(probs[self.head], self.keys_per_cell)  # (q, key cells)
            counts = _sum_cells(torch.ones(self.q_len), self.queries_per_row)
            self.matrix = _sum_cells(keys.T, self.queries_per_row).T / counts[:, None]
        return hidden, None

    def result(self) -> dict:
        rows = torch.stack(self.rows)  # (layers, heads, key cells)
        first_key = self.start + self.q_len - self.n_keys  # keys are the last n_keys inputs up to the segment's end
        return {
            "token": self.token,
            "query": self.query,
            "layer": self.layer,
            "head": self.head,
            "first_key": first_key,  # input position of key 0 (keys first_key … segment_start - 1 are memory)
            "segment_start": self.start,
            "segment_end": self.start + self.q_len,
            "n_keys": self.n_keys,
            "n_queries": self.q_len,
            "keys_per_cell": self.keys_per_cell,  # cell j sums keys first_key + j*keys_per_cell … (+keys_per_cell - 1)
            "queries_per_row": self.queries_per_row,  # matrix row i: the mean of queries i*queries_per_row … (+…- 1)
            "rows": _json_numbers(rows, 8),  # [layer][head][cell]: the query's attention
            "avg_distance": _json_numbers(torch.stack(self.distance), 6),  # [layer][head]
            "matrix": _json_numbers(self.matrix, 5),  # [row][cell]: the segment, layer `layer`, head `head`
        }
