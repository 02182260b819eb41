"""Property-based fuzzing of everything that reads a file or a string a user (or a stranger) supplies.

Random and mutated inputs go through config parsing (TransformerXLConfig.from_dict / from_json,
RunConfig, TOML, `--set`), data specs, vocabulary loading, every corpus reader (through `open_corpus`
with each spec name), the safetensors/JSON checkpoint loader (`TransformerXL.from_pretrained`) and the
trainer's resume path. The property: each input gives a valid result or one of our typed errors (a
`TxlError` with a one-line message), never another exception.

The profile is fixed for CI: derandomized (the same cases on every run), no example database, a bounded
number of examples per target so the file runs in well under a minute. The module prints how many
cases ran per target; docs/guide/robustness.md quotes the totals.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import shutil
import struct
import tempfile
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from txl.errors import TxlError

settings.register_profile(
    "txl-fuzz",
    derandomize=True,  # the same examples on every run and machine
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                           HealthCheck.function_scoped_fixture, HealthCheck.large_base_example],
)
FUZZ = settings.get_profile("txl-fuzz")

RAN: Counter[str] = Counter()  # target -> cases run
OUTCOMES: Counter[tuple[str, str]] = Counter()  # (target, "ok" or the TxlError subclass)


def expect_typed(target: str, fn, *args, **kwargs):
    """Run one case: a result or a TxlError with a one-line message; anything else fails the test."""
    RAN[target] += 1
    try:
        result = fn(*args, **kwargs)
    except TxlError as err:
        message = str(err)
        assert message and "\n" not in message, f"{type(err).__name__} message is not one line: {message!r}"
        OUTCOMES[target, type(err).__name__] += 1
        return None
    OUTCOMES[target, "ok"] += 1
    return result


@pytest.fixture(scope="module", autouse=True)
def report(request):
    yield
    lines = [f"fuzz cases run: {sum(RAN.values())} in {len(RAN)} targets, none escaped as an untyped exception"]
    for target in sorted(RAN):
        kinds = ", ".join(f"{kind} {n}" for (t, kind), n in sorted(OUTCOMES.items()) if t == target)
        lines.append(f"  {target}: {RAN[target]} ({kinds})")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print("\n" + "\n".join(lines))


# ---------------------------------------------------------------------------------------------
# Strategies

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                      st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                          max_leaves=10)


@st.composite
def mutated_bytes(draw, original: bytes) -> bytes:
    """`original` with a few flipped bits, truncations, insertions, deletions or overwritten runs."""
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 2))):
        op = draw(st.sampled_from(["flip", "flip", "truncate", "insert", "delete", "overwrite"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del data[at:]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 64))]
        else:
            chunk = draw(st.binary(min_size=1, max_size=16))
            data[at : at + len(chunk)] = chunk
    return bytes(data)


@st.composite
def mutated_json(draw, original):
    """`original` (parsed JSON) with one value somewhere replaced, a key deleted, or a key added."""
    value = copy.deepcopy(original)
    containers = []

    def walk(node):
        if isinstance(node, dict):
            containers.append(node)
            for child in node.values():
                walk(child)
        elif isinstance(node, list):
            containers.append(node)
            for child in node:
                walk(child)

    walk(value)
    for _ in range(draw(st.integers(1, 3))):
        if not containers:
            return draw(json_value)
        node = draw(st.sampled_from(containers))
        op = draw(st.sampled_from(["replace", "delete", "add"]))
        if isinstance(node, dict):
            keys = sorted(node)
            if op == "add" or not keys:
                node[draw(st.text(max_size=8))] = draw(json_value)
            elif op == "delete":
                del node[draw(st.sampled_from(keys))]
            else:
                node[draw(st.sampled_from(keys))] = draw(json_value)
        elif node:
            i = draw(st.integers(0, len(node) - 1))
            if op == "delete":
                del node[i]
            else:
                node[i] = draw(json_value)
        else:
            node.append(draw(json_value))
    return value


def fresh_dir() -> Path:
    """A new directory per example (a function-scoped tmp_path is shared by all examples of a test)."""
    return Path(tempfile.mkdtemp(prefix="txl-fuzz-"))


# ---------------------------------------------------------------------------------------------
# Model config

SMALL = dict(vocab_size=40, n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=32, mem_len=8)


@given(st.dictionaries(st.one_of(st.sampled_from(sorted(SMALL) + ["cutoffs", "div_val", "pos_encoding",
                                                                   "tie_projs", "same_length", "d_embed"]),
                                 st.text(max_size=10)), json_value, max_size=8))
@settings(FUZZ, max_examples=120)
def test_config_from_random_dict(data):
    from txl.models.transformer_xl.config import TransformerXLConfig

    expect_typed("config.from_dict random", TransformerXLConfig.from_dict, data)


@given(st.data())
@settings(FUZZ, max_examples=150)
def test_config_from_mutated_valid_dict(data):
    from txl.models.transformer_xl.config import TransformerXLConfig

    valid = TransformerXLConfig(**SMALL, cutoffs=(10, 20), div_val=2).to_dict()
    expect_typed("config.from_dict mutated", TransformerXLConfig.from_dict, data.draw(mutated_json(valid)))


@given(st.one_of(st.text(max_size=200), st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
                 st.just("[" * 5000), st.just('{"vocab_size": ' + "9" * 5000 + "}")))
@settings(FUZZ, max_examples=100)
def test_config_from_json_text_and_paths(text):
    from txl.models.transformer_xl.config import TransformerXLConfig

    expect_typed("config.from_json", TransformerXLConfig.from_json, text)


# ---------------------------------------------------------------------------------------------
# Run config: TOML files, sections, --set

TOML_TEXT = (Path(__file__).resolve().parents[1] / "src" / "txl" / "presets" / "tiny.toml").read_bytes()


@given(st.data())
@settings(FUZZ, max_examples=120)
def test_run_config_from_mutated_toml(data):
    from txl.train.config import build_run_config

    path = fresh_dir() / "run.toml"
    path.write_bytes(data.draw(st.one_of(mutated_bytes(TOML_TEXT), st.binary(max_size=300))))
    expect_typed("run config TOML", build_run_config, config_file=path)
    shutil.rmtree(path.parent)


@given(st.one_of(st.dictionaries(st.sampled_from(["model", "train", "optimizer"]), json_value, max_size=3),
                 st.builds(lambda m, t: {"model": m, "train": t},
                           st.dictionaries(st.sampled_from(sorted(SMALL) + ["x"]), json_value, max_size=3),
                           st.dictionaries(st.sampled_from(["lr", "seed", "tgt_len", "batch_size", "data",
                                                            "final_splits", "max_minutes", "y"]), json_value,
                                           max_size=3))))
@settings(FUZZ, max_examples=120)
def test_run_config_from_random_sections(data):
    from txl.train.config import RunConfig

    expect_typed("run config sections", RunConfig.from_dict, data)


@given(st.lists(st.one_of(
    st.text(max_size=30),
    st.builds(lambda k, v: f"{k}={v}", st.sampled_from(["lr", "model.d_model", "seed", "mem_len", "train.clip",
                                                        "model.cutoffs", "precision", "model.x", "a.b.c", ""]),
              st.one_of(st.text(max_size=12), json_value.map(json.dumps), st.just("[" * 3000)))),
    max_size=3))
@settings(FUZZ, max_examples=120)
def test_run_config_set_assignments(sets):
    from txl.train.config import build_run_config

    expect_typed("run config --set", build_run_config, preset="tiny", sets=sets)


# ---------------------------------------------------------------------------------------------
# Data specs and vocabularies

SPEC_NAMES = ["ptb-word", "ptb-char", "enwik8", "text8", "wikitext103", "wikitext2", "lm1b", "text", "builtin"]


@given(st.one_of(st.text(max_size=40),
                 st.builds(lambda n, p, q: f"{n}{p}{q}", st.sampled_from(SPEC_NAMES + ["nope", ""]),
                           st.sampled_from(["", ":", ":/nonexistent/x", ":\x00", ":~/x", ":/dev/null"]),
                           st.sampled_from(["", "?", "?tokenizer=words", "?tokenizer=zzz", "?vocab_size=-1",
                                            "?min_freq=x", "?a=b", "?tokenizer", "?vocab_size=99999999999999"]))))
@settings(FUZZ, max_examples=150)
def test_data_spec_parsing_and_planning(spec):
    from txl.data.readers import make_plan
    from txl.data.spec import parse_spec

    parsed = expect_typed("data spec parse", parse_spec, spec)
    if parsed is not None and parsed.name != "builtin":  # builtin's plan lists the stdlib: valid, slow
        expect_typed("data spec plan", make_plan, parsed)


def _valid_vocab_json(kind: str) -> str:
    from txl.data.vocab import Vocab

    if kind == "words":
        return Vocab("words", ["<eos>", "<unk>", "the", "cat"], eos="<eos>", unk="<unk>").to_json()
    if kind == "chars":
        return Vocab("chars", [" ", "a", "b", "\u00e9"]).to_json()
    if kind == "bpe":
        from tokenizers import Tokenizer, models, pre_tokenizers

        tk = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        return Vocab("bpe", bpe=tk.to_str()).to_json()
    return Vocab("bytes").to_json()


@given(st.data(), st.sampled_from(["words", "chars", "bytes", "bpe"]))
@settings(FUZZ, max_examples=160)
def test_vocab_from_mutated_json(data, kind):
    from txl.data.vocab import Vocab

    text = _valid_vocab_json(kind)
    mutated = data.draw(st.one_of(mutated_bytes(text.encode()), mutated_json(json.loads(text)).map(json.dumps),
                                  st.binary(max_size=100)))
    vocab = expect_typed(f"vocab.from_json {kind}", Vocab.from_json, mutated)
    if vocab is not None:  # a vocabulary that loads must also work
        ids = data.draw(st.lists(st.integers(-2, vocab.size + 2), max_size=8))
        expect_typed(f"vocab.from_json {kind}", lambda: (vocab.fingerprint, vocab.decode(ids), vocab.to_json()))


@given(st.binary(max_size=200))
@settings(FUZZ, max_examples=60)
def test_vocab_load_random_files(raw):
    from txl.data.vocab import Vocab

    path = fresh_dir() / "vocab.json"
    path.write_bytes(raw)
    expect_typed("vocab.load", Vocab.load, path)
    shutil.rmtree(path.parent)


# ---------------------------------------------------------------------------------------------
# Corpus readers: every spec name, files in the layout each expects, random or mutated contents


def _word_text(seed: int, lines: int = 60) -> bytes:
    rng = np.random.default_rng(seed)
    words = ["the", "cat", "sat", "on", "<unk>", "N", "mat", "caf\u00e9"]
    return "".join(" ".join(rng.choice(words, size=int(rng.integers(0, 9)))) + "\n" for _ in range(lines)).encode()


def _char_text(seed: int) -> bytes:
    lines = _word_text(seed).decode().splitlines()
    return "".join(" ".join(line.replace(" ", "_")) + "\n" for line in lines).encode()


LAYOUTS = {  # case -> (spec name, spec options, {relative path: valid content})
    "ptb-word": ("ptb-word", "", {f"ptb.{s}.txt": _word_text(i) for i, s in enumerate(("train", "valid", "test"))}),
    "ptb-char": ("ptb-char", "", {f"ptb.char.{s}.txt": _char_text(i) for i, s in enumerate(("train", "valid", "test"))}),
    "wikitext103": ("wikitext103", "", {f"wiki.{s}.tokens": _word_text(i)
                                        for i, s in enumerate(("train", "valid", "test"))}),
    "wikitext2": ("wikitext2", "", {f"wikitext-2/wiki.{s}.tokens": _word_text(i)
                                    for i, s in enumerate(("train", "valid", "test"))}),
    "enwik8": ("enwik8", "", {"enwik8": bytes(range(256)) * 8 + _word_text(5) * 4}),
    "enwik8-zip": ("enwik8", "", {"enwik8.zip": b""}),  # filled below
    "text8": ("text8", "", {"text8": b"the quick brown fox jumps over the lazy dog " * 60}),
    "text8-zip": ("text8", "", {"text8.zip": b""}),
    "lm1b": ("lm1b", "", {"training-monolingual.tokenized.shuffled/news.en-00001-of-00100": _word_text(7),
                          "heldout-monolingual.tokenized.shuffled/news.en.heldout-00000-of-00050": _word_text(8)}),
    "lm1b-vocab": ("lm1b", "", {"training-monolingual.tokenized.shuffled/news.en-00001-of-00100": _word_text(7),
                                "heldout-monolingual.tokenized.shuffled/news.en.heldout-00000-of-00050": _word_text(8),
                                "1b_word_vocab.txt": b"<S>\t0\n<UNK>\t1\nthe\t2\ncat\t3\n"}),
    "text-bytes": ("text", "?tokenizer=bytes", {"train.txt": _word_text(1), "valid.txt": _word_text(2)}),
    "text-chars": ("text", "?tokenizer=chars", {"corpus.txt": _word_text(3)}),
    "text-words": ("text", "?tokenizer=words&vocab_size=6", {"train.txt": _word_text(4), "test.txt": _word_text(5)}),
    "text-bpe": ("text", "?tokenizer=bpe&vocab_size=300", {"corpus.txt": _word_text(6, 30)}),
}


def _zip(name: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(name, data)
    return buf.getvalue()


LAYOUTS["enwik8-zip"][2]["enwik8.zip"] = _zip("enwik8", LAYOUTS["enwik8"][2]["enwik8"])
LAYOUTS["text8-zip"][2]["text8.zip"] = _zip("text8", LAYOUTS["text8"][2]["text8"])


def _open_and_use(spec: str, cache: Path):
    from txl.data import StreamIterator, open_corpus

    corpus = open_corpus(spec, cache)
    corpus.stats()
    for split in corpus.splits:
        ids = np.asarray(corpus.split(split)[:64])
        assert ids.size == 0 or int(ids.max()) < len(corpus.vocab)
        corpus.vocab.decode(ids)
    next(iter(StreamIterator(corpus.split("train"), batch_size=2, tgt_len=8)))
    return corpus


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@given(data=st.data())
@settings(FUZZ, max_examples=14)
def test_corpus_readers_on_random_and_mutated_files(layout, data):
    """One file of the layout damaged (mutated, random, empty or missing), the others valid."""
    name, options, files = LAYOUTS[layout]
    root = fresh_dir()
    source = root / "src"
    damaged = data.draw(st.sampled_from(sorted(files)))
    for rel, valid in files.items():
        path = source / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if rel != damaged:
            path.write_bytes(valid)
            continue
        how = data.draw(st.sampled_from(["mutate", "mutate", "mutate", "random", "empty", "missing", "valid"]))
        if how == "mutate":
            path.write_bytes(data.draw(mutated_bytes(valid)))
        elif how == "random":
            path.write_bytes(data.draw(st.binary(max_size=400)))
        elif how != "missing":
            path.write_bytes(b"" if how == "empty" else valid)
    target = source / next(iter(files)) if name == "text" and "train.txt" not in files else source
    expect_typed(f"corpus {layout}", _open_and_use, f"{name}:{target}{options}", root / "cache")
    shutil.rmtree(root)


# ---------------------------------------------------------------------------------------------
# Checkpoints: safetensors + config.json through from_pretrained


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from txl.models.transformer_xl.config import TransformerXLConfig
    from txl.models.transformer_xl.model import TransformerXL

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("fuzz-ckpt") / "ckpt"
    TransformerXL(TransformerXLConfig(**SMALL)).save_pretrained(path)
    return path


def _load(path: Path):
    from txl.models.transformer_xl.model import TransformerXL

    model = TransformerXL.from_pretrained(path)
    with torch.no_grad():
        model(torch.zeros(1, 3, dtype=torch.long))  # a checkpoint that loads must also run
    return model


@given(st.data())
@settings(FUZZ, max_examples=120)
def test_checkpoint_files_mutated(checkpoint, data):
    root = fresh_dir()
    copy_ = root / "ckpt"
    shutil.copytree(checkpoint, copy_)
    name = data.draw(st.sampled_from(["model.safetensors", "model.safetensors", "config.json"]))
    original = (copy_ / name).read_bytes()
    if name == "config.json":
        mutated = data.draw(st.one_of(mutated_bytes(original),
                                      mutated_json(json.loads(original)).map(lambda v: json.dumps(v).encode())))
    else:
        mutated = data.draw(st.one_of(mutated_bytes(original), _mutated_safetensors_header(original),
                                      st.binary(max_size=64)))
    (copy_ / name).write_bytes(mutated)
    expect_typed(f"from_pretrained mutated {name}", _load, copy_)
    shutil.rmtree(root)


@st.composite
def _mutated_safetensors_header(draw, original: bytes) -> bytes:
    """Rewrite the JSON header (dtypes, shapes, offsets, metadata) and keep the length prefix right."""
    (n,) = struct.unpack("<Q", original[:8])
    header = json.loads(original[8 : 8 + n])
    header = draw(mutated_json(header))
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + original[8 + n :]


@given(st.data())
@settings(FUZZ, max_examples=60)
def test_checkpoint_from_a_stranger_without_digest(checkpoint, data):
    """Well-formed safetensors written by someone else (no txl digest): tensors dropped, added,
    reshaped or of another dtype must fail as one CheckpointError, or load and run."""
    from safetensors.torch import load_file, save_file

    root = fresh_dir()
    copy_ = root / "ckpt"
    shutil.copytree(checkpoint, copy_)
    tensors = load_file(str(copy_ / "model.safetensors"))
    names = sorted(tensors)
    for _ in range(data.draw(st.integers(1, 3))):
        name = data.draw(st.sampled_from(names))
        op = data.draw(st.sampled_from(["drop", "add", "reshape", "dtype", "nan"]))
        if op == "drop":
            tensors.pop(name, None)
        elif op == "add":
            tensors[data.draw(st.text(min_size=1, max_size=10))] = torch.zeros(2)
        elif op == "reshape" and name in tensors:
            shape = data.draw(st.lists(st.integers(0, 4), max_size=3))
            tensors[name] = torch.zeros(shape)
        elif op == "dtype" and name in tensors:
            dtype = data.draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float64, torch.int64,
                                               torch.uint8, torch.bool, torch.int8]))
            tensors[name] = tensors[name].to(dtype)
        elif name in tensors:
            tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(copy_ / "model.safetensors"))
    expect_typed("from_pretrained stranger tensors", _load, copy_)
    shutil.rmtree(root)


# ---------------------------------------------------------------------------------------------
# The trainer's resume path: a damaged or foreign `last` checkpoint


@pytest.fixture(scope="module")
def trained_run():
    import helpers
    from txl.train import Trainer
    from txl.train.config import build_run_config

    # A path of fixed length (pytest's numbered directories grow): the saved run config quotes it, and
    # the byte mutations of trainer_state.json should land on the same fields in every session.
    root = Path(tempfile.mkdtemp(prefix="txl-fuzz-run-"))
    corpus = helpers.make_corpus(root / "corpus.txt", lines=300)
    config = helpers.write_config(root, corpus, steps=2)
    run = build_run_config(config_file=config, sets=["model.n_layer=1", "model.d_model=16", "model.d_head=8",
                                                     "model.d_inner=32", "model.mem_len=8", "tgt_len=8"])
    cache = root / "cache"
    mp = pytest.MonkeyPatch()
    mp.setenv("TXL_CACHE_DIR", str(cache))
    Trainer(run, root / "run", quiet=True).fit()
    state_file = root / "run" / "last" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["elapsed"] = 1.0  # wall-clock time: fixed, so the mutations (and the case count) are the same every run
    state_file.write_text(json.dumps(state))
    yield run, root / "run"
    mp.undo()
    shutil.rmtree(root, ignore_errors=True)


def _resume_and_step(run, out: Path):
    """Build the trainer from the checkpoint, then take one step: what loads must also train."""
    from txl.train import Trainer

    trainer = Trainer(run, out, resume=True, quiet=True)
    batch = next(iter(trainer.train_iter))
    nll, count = trainer.train_step(batch)
    trainer.optimizer_step(1e-3, True)
    return trainer


STATE_FILES = ["trainer_state.json", "optimizer.json", "optimizer.safetensors", "trainer.safetensors",
               "model.safetensors", "vocab.json", "config.json"]


@given(st.data())
@settings(FUZZ, max_examples=50)
def test_trainer_resume_from_a_damaged_checkpoint(trained_run, data):
    run, original = trained_run
    root = fresh_dir()
    out = root / "run"
    shutil.copytree(original, out)
    name = STATE_FILES[data.draw(st.integers(0, 10 * len(STATE_FILES) - 1)) % len(STATE_FILES)]  # evenly
    path = out / "last" / name
    raw = path.read_bytes()
    if name.endswith(".json"):
        mutated = data.draw(st.one_of(mutated_json(json.loads(raw)).map(lambda v: json.dumps(v).encode()),
                                      mutated_bytes(raw)))
    else:
        mutated = data.draw(st.one_of(mutated_bytes(raw), _resaved_tensors(raw)))
    path.write_bytes(mutated)
    expect_typed(f"trainer resume {name}", _resume_and_step, run, out)
    shutil.rmtree(root)


@st.composite
def _resaved_tensors(draw, raw: bytes) -> bytes:
    """A well-formed safetensors file (no digest) with one tensor dropped, reshaped, retyped or NaN."""
    from safetensors.torch import load, save

    tensors = load(raw)
    if not tensors:
        return raw
    name = draw(st.sampled_from(sorted(tensors)))
    op = draw(st.sampled_from(["drop", "reshape", "dtype", "nan", "rename"]))
    if op == "drop":
        del tensors[name]
    elif op == "reshape":
        tensors[name] = torch.zeros(draw(st.lists(st.integers(0, 5), max_size=3)))
    elif op == "dtype":
        tensors[name] = tensors[name].to(draw(st.sampled_from([torch.float16, torch.int64, torch.uint8, torch.bool])))
    elif op == "nan":
        tensors[name] = torch.full_like(tensors[name].float(), float("nan"))
    else:
        tensors[name + "x"] = tensors.pop(name)
    return save(tensors)


@given(st.data())
@settings(FUZZ, max_examples=80)
def test_resume_config_from_a_damaged_state_file(trained_run, data):
    from txl.train import resume_config

    _, original = trained_run
    state = json.loads((original / "last" / "trainer_state.json").read_text())
    root = fresh_dir()
    (root / "last").mkdir()
    (root / "last" / "trainer_state.json").write_text(json.dumps(data.draw(mutated_json(state))))
    budget = data.draw(st.one_of(st.none(), st.integers(-3, 10)))
    expect_typed("trainer resume config", resume_config, root, max_steps=budget)
    shutil.rmtree(root)


def test_every_target_ran():
    """Runs last in the file: every fuzz target above ran cases (a skipped strategy would hide gaps)."""
    expected = {"config.from_dict random", "config.from_dict mutated", "config.from_json", "run config TOML",
                "run config sections", "run config --set", "data spec parse", "vocab.load",
                "from_pretrained mutated model.safetensors", "from_pretrained stranger tensors",
                "trainer resume config"} | {f"corpus {layout}" for layout in LAYOUTS}
    if len(RAN) < len(expected):
        pytest.skip("run the whole file to check the counts")
    missing = sorted(expected - set(RAN))
    assert missing == [], missing
