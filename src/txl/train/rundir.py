"""A training run's directory: checked and locked before anything in it is read or written, the data spec
it records, `run.json`, and the weights a fine-tuning run starts from (`--init-from`).

One `RunLock` per run: `open_run_dir` takes it (the caller holds it for the whole run, `txl.cli.train`, or
the `Trainer` when it is built without one).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

from txl.errors import CheckpointError, ConfigError, DataError, OutputError, UsageError, describe_os_error
from txl.io.rundir import LOCK_NAME, RunLock, check_utf8_path, refuse_link, remove_stale_temporaries
from txl.models.pretrained import check_state_dict, read_json, recover_directory, write_json

LAST, BEST = "last", "best"  # the resumable checkpoint and the best validated weights


def check_out_dir(out: Path) -> None:
    """A new run's --out, before anything is created: refuse one that holds a run or is not a
    directory, and one whose nearest existing parent cannot be written."""
    if (out / LAST).exists():
        raise UsageError(f"{out} already holds a run; continue it with --resume {out} or pick a new --out")
    if out.exists() and not out.is_dir():
        raise OutputError(f"output directory {out} exists and is not a directory; pick a new --out")
    parent = out.absolute()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"cannot write to output directory {out}: {parent} is a file, not a directory; "
                          "pick a new --out")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write to output directory {out}: {parent} is not writable (permission denied); "
                          "pick a new --out")


def create_out_dir(out: Path) -> None:
    """Create a new run's --out (the last step before training) and prove it is writable."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):  # O_EXCL: never an existing entry
            pass
    except OSError as err:
        raise OutputError(f"cannot write to output directory {out}: {describe_os_error(err)}") from None


# What a run directory holds that txl wrote (its temporaries start with "." and one of these names).
RUN_ENTRIES = (LAST, BEST, "run.json", "metrics.jsonl", "result.json", "sample.txt", "tensorboard", "curves.png",
               "arena.json", LOCK_NAME)  # arena.json: experiments/campaign.py records the command before training


_OVERWRITTEN = ("run.json", "metrics.jsonl", "result.json", "sample.txt", "curves.png")  # what a new run replaces


def _is_txl_entry(name: str) -> bool:
    return name in RUN_ENTRIES or any(name.startswith(f".{known}.") for known in RUN_ENTRIES)


def check_run_entries(out: Path) -> None:
    """A run directory from a stranger may hold links aimed outside it; every entry txl writes, moves
    or deletes is refused by name when it is one (the directory itself may be a link the user made)."""
    if not out.is_dir():
        return
    for name in RUN_ENTRIES:
        refuse_link(out / name, "in a run directory")
    for entry in out.iterdir():
        if entry.name.startswith(".") and _is_txl_entry(entry.name):
            refuse_link(entry, "in a run directory")


def check_foreign_files(out: Path, *, force: bool) -> None:
    """Refuse a new run's --out that holds files txl did not write (unless `force`): training would
    overwrite a user's own metrics.jsonl, run.json, result.json or sample.txt."""
    if not out.is_dir():
        return
    names = sorted(e.name for e in out.iterdir() if e.name != LOCK_NAME)
    foreign = [n for n in names if not _is_txl_entry(n)]
    # txl's names without a run.json (e.g. a metrics.jsonl alone) are not proof that txl wrote them
    unproven = [] if "run.json" in names else [n for n in names if n in _OVERWRITTEN]
    if (foreign or unproven) and not force:
        example = (foreign or unproven)[0]
        raise OutputError(f"{out} exists and holds files txl did not write ({example!r}); training would overwrite "
                          "its metrics.jsonl, run.json, result.json and sample.txt: pick an empty or new --out, or "
                          "pass --force")


def open_run_dir(out: Path, *, resume: bool, force: bool = False) -> RunLock:
    """Check and lock a run directory before anything in it is read, moved or written.

    The lock comes first (a second writer fails at once naming the holder); a new run's directory is
    created for it and `RunLock.abandon` removes it again (and the lock file) if the start fails, so a
    failed start leaves nothing behind. Then links among the entries txl touches are refused, crash
    leftovers are recovered, and a new run's --out is checked (`check_out_dir`; no files txl did not
    write unless `force`). Resume: the run must exist.
    """
    check_utf8_path(out, "--resume" if resume else "--out")
    if resume:
        if not out.is_dir():
            raise CheckpointError(f"{out} is not a txl training run (no such directory); pass the --out directory "
                                  "of an earlier `txl train`")
    elif not out.exists():
        check_out_dir(out)  # the parent: a file, or not writable
    elif not out.is_dir():
        raise OutputError(f"output directory {out} exists and is not a directory; pick a new --out")
    created = False
    if not out.exists():
        try:
            out.mkdir(parents=True)
            created = True
        except FileExistsError:  # another txl made it this instant: the lock below decides who writes
            if not out.is_dir():
                raise OutputError(f"output directory {out} exists and is not a directory; pick a new --out") from None
        except OSError as err:
            raise OutputError(f"cannot write to output directory {out}: {describe_os_error(err)}") from None
    lock = RunLock.acquire(out, created_dir=created)
    try:
        check_run_entries(out)
        remove_stale_temporaries(out, RUN_ENTRIES)  # what a killed session left half-written
        for name in (LAST, BEST):  # a crash mid-checkpoint leaves the previous one set aside
            recover_directory(out / name)
        if not resume:  # checked under the lock: no other txl can be writing it now
            check_out_dir(out)
            check_foreign_files(out, force=force)
    except BaseException:
        lock.abandon()
        raise
    return lock


def resolve_data(spec_text: str) -> str:
    """The data spec with an absolute path (stored in the run, so eval/generate/resume work from any
    directory). A spec without a path (a preset names corpora, not paths) means the default download
    location; when the corpus is not there, one line says how to get it or point at it."""
    from txl.data import parse_spec

    spec = parse_spec(spec_text)
    body = spec.text.partition("?")[0] if "?" in spec.text else spec.text
    implicit = ":" not in body
    if spec.path is not None and spec.name != "builtin":
        paths = spec.path.split(",") if spec.name == "style" else [spec.path]  # style: one file per style
        spec = dataclasses.replace(spec, path=",".join(map(os.path.abspath, paths)))  # normalised: no "work/../data"
    if implicit and spec.info.download and spec.path is not None and not Path(spec.path).exists():
        raise DataError(f"corpus {spec.name} not found in its download location {spec.path}; fetch it with "
                        f"`txl data download {spec.info.download}` or point at your copy with --data "
                        f"{spec.name}:DIR")
    return spec.canonical()


def fixed_vocabulary(out: Path, *, init_from: str | Path | None, resume: bool):
    """The vocabulary a run reads its text with when it is not the text's own: a fine-tuning run's
    (`--init-from`) is its checkpoint's, so ids keep meaning the symbols the weights learned; resuming one
    (run.json records `init_from`) reads with the vocab.json it saved. None: the text's own vocabulary (a
    plain run, a checkpoint without vocab.json, an encoder-decoder's pair vocabulary)."""
    from txl.data import Vocab
    from txl.models.pretrained import resolve_checkpoint

    if resume:
        if not isinstance(previous_run_record(out).get("init_from"), str) or not (out / LAST / "vocab.json").is_file():
            return None
        source = out / LAST / "vocab.json"
    elif init_from is None:
        return None
    else:
        source = resolve_checkpoint(init_from) / "vocab.json"
        if not source.is_file():
            return None
    try:
        return Vocab.load(source, follow_links=False)
    except DataError as err:
        raise CheckpointError(f"{source}: {err}") from None


def open_training_corpus(objective, spec: str, out: Path, *, init_from: str | Path | None, resume: bool,
                         say=None):
    """The corpus a run trains on (`objective.open_corpus`), read with the checkpoint's vocabulary when the
    run fine-tunes one (`fixed_vocabulary`; issue 45: new text whose symbols are a subset of the
    checkpoint's was refused). Symbols the vocabulary lacks: one line through `say` (a note on stderr)
    when they read as <unk>, else one DataError naming them and what to do."""
    from txl.data.corpus import OtherTokenizer, UnknownSymbols, describe_symbols

    if init_from is not None and not resume:
        check_init_source(init_from, objective)
    vocab = fixed_vocabulary(out, init_from=init_from, resume=resume) if objective.name != "seq2seq" else None
    if vocab is None:
        return objective.open_corpus(spec)
    where = f"--init-from {init_from}" if not resume else f"{out} (fine-tuned from {previous_run_record(out)['init_from']})"
    try:
        corpus = objective.open_corpus(spec, vocab=vocab)  # (a classifier's documents too: issue 47)
    except UnknownSymbols as err:
        total = sum(err.counts.values())
        raise DataError(f"{where}: the checkpoint's {vocab.kind} vocabulary has no <unk> and lacks {len(err.counts):,} "
                        f"symbol(s) of {spec} ({describe_symbols(err.counts)}; {total:,} in all); replace or remove "
                        "them in the text, or train a new run on it without --init-from") from None
    except OtherTokenizer as err:
        raise DataError(f"{where}: the checkpoint has a {vocab.kind} vocabulary but {spec} makes a {err.tokenizer} "
                        f"vocabulary; fine-tune with the same tokenizer: {err.fix}") from None
    if corpus.unknown and not resume and say is not None:
        total = sum(corpus.unknown.values())
        lower = sum(n for word, n in corpus.unknown.items() if vocab.kind == "words" and word.lower() in vocab.stoi)
        hint = f"; {lower:,} of them are known in lower case: lower-case the text to keep them" if lower else ""
        say(f"note: {where}: {total:,} occurrence(s) of {len(corpus.unknown):,} symbol(s) of {spec} that the "
            f"checkpoint's vocabulary lacks read as {vocab.unk} ({describe_symbols(corpus.unknown)}){hint}")
    return corpus


FAMILIES = {"seq2seq": "a sequence-to-sequence model", "style": "a Style Transformer",
            "mlm": "a bidirectional masked LM", "lm": "a causal language model"}


def check_init_source(source: str | Path, objective) -> None:
    """A fine-tuning run (`--init-from`) starts from a checkpoint of its own family (a causal language model or
    classifier, a masked LM, an encoder-decoder, a Style Transformer), said in one line before the checkpoint's
    vocabulary is read (an encoder-decoder's pair vocabulary read as a language model's was "not a txl
    vocabulary"; a masked LM's extra mask id was a shape mismatch)."""
    from txl.models.pretrained import read_config_data, resolve_checkpoint
    from txl.models.registry import is_seq2seq

    data = read_config_data(resolve_checkpoint(source))
    arch = data.get("arch", "decoder") if isinstance(data, dict) else None
    if not isinstance(arch, str):
        return  # load_checkpoint names what is wrong with the config
    have = ("seq2seq" if is_seq2seq(arch) else "style" if arch == "style-transformer"
            else "mlm" if data.get("causal") is False else "lm")
    want = objective.name if objective.name in FAMILIES else "lm"
    if have != want:
        raise ConfigError(f"--init-from {source}: the checkpoint is {FAMILIES[have]} (model.arch={arch!r}) but this "
                          f"run trains {FAMILIES[want]}; fine-tune from a run of the same kind, or train without "
                          "--init-from")


def load_initial_weights(model, source: str | Path, vocab) -> Path:
    """Fine-tuning (`--init-from`): copy trained weights into a new run's model. The vocabulary must be
    the same one (ids mean the same symbols: `open_training_corpus` reads the new text with it); the
    error says how the two differ."""
    from txl.models.checkpoint import load_checkpoint

    ckpt = load_checkpoint(source)
    if ckpt.vocab is not None and ckpt.vocab.fingerprint != vocab.fingerprint:
        raise DataError(f"--init-from {source}: {vocab_difference(ckpt.vocab, vocab)}; fine-tune on data with the "
                        "checkpoint's vocabulary (same tokenizer and symbols)")
    if ckpt.vocab is None and ckpt.model.config.vocab_size != vocab.size:
        raise DataError(f"--init-from {source}: the checkpoint has {ckpt.model.config.vocab_size} ids but the data has "
                        f"{vocab.size}")
    weights = ckpt.model.state_dict()
    # a classifier fine-tuned from a language model (issue 47): the LM's weights, its classification head fresh
    weights.update({k: v for k, v in model.state_dict().items() if k.startswith("classifier.") and k not in weights})
    own = model.state_dict()
    for name in sorted(set(own) & set(weights)):  # the run's settings against the checkpoint's, named as such
        if tuple(own[name].shape) != tuple(weights[name].shape):
            raise ConfigError(f"--init-from {source}: tensor {name!r} has shape {tuple(weights[name].shape)} in the "
                              f"checkpoint but {tuple(own[name].shape)} in this run's model; give the run the "
                              f"checkpoint's model settings (its config.json: {ckpt.path / 'config.json'})")
    check_state_dict(own, weights, ckpt.path)
    model.load_state_dict(weights)
    return ckpt.path


def vocab_difference(old, new) -> str:
    """How two vocabularies differ, in words (kind, size, the first symbols only one of them has)."""
    if old.kind != new.kind:
        return f"the checkpoint has a {old.kind} vocabulary, the data a {new.kind} vocabulary"
    text = f"the checkpoint's {old.kind} vocabulary has {old.size} ids, the data's {new.size}"
    if old.symbols is not None and new.symbols is not None:
        missing = [s for s in new.symbols if s not in set(old.symbols)][:5]
        extra = [s for s in old.symbols if s not in set(new.symbols)][:5]
        if missing:
            text += f"; the data has symbols the checkpoint lacks ({', '.join(map(repr, missing))})"
        if extra:
            text += f"; the checkpoint has symbols the data lacks ({', '.join(map(repr, extra))})"
        if not missing and not extra:
            text += "; the same symbols in a different order"
    return text


def previous_run_record(out: Path) -> dict:
    """run.json of an existing run ({} when absent). An entry that is not a small regular JSON file (a FIFO
    would block for ever, holding the run's lock) is one CheckpointError naming it; a JSON value that is
    not an object counts as no record (it is a record, not state)."""
    if not os.path.lexists(out / "run.json"):
        return {}
    data = read_json(out / "run.json", "run record", follow_links=False)
    return data if isinstance(data, dict) else {}


def write_run_file(out: Path, record: dict) -> None:
    """run.json: what the run is (its configuration, model, data as resolved and as typed, precision)."""
    write_json(out / "run.json", record)
