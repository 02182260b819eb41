"""Hugging Face TransfoXL `vocab.pkl` -> our `vocab.json`, without unpickling.

`TransfoXLTokenizer.save_vocabulary` pickles the tokenizer's whole `__dict__`; loading it with `pickle`
runs whatever the file names (CVE-2023-6730). We read it with `txl.io.plain_pickle`, which builds plain
data only, and take what a vocabulary is made of. Two layouts exist and both are read:

- transformers 4.x (4.35.2 checked): `idx2sym`, `sym2idx` (OrderedDict), `counter` (Counter), `special`,
  `lower_case`, `delimiter`, `never_split`, `unk_idx`, ... plus compiled regexes, sacremoses objects
  and tokenizer bookkeeping, which are kept as inert placeholders and ignored;
- pytorch-pretrained-bert, with which the hub's `transfo-xl-wt103` file was made: the same keys
  without the regexes and Moses objects.

Settings in a `tokenizer_config.json` next to the file take precedence over those in the pickle, as
they do when transformers loads the tokenizer (its constructor arguments win over the pickled ones).

Tokens added beyond `vocab.pkl` (`TransfoXLTokenizer` adds its `additional_special_tokens`, by default
`<formula>`, when the vocabulary lacks them; `tokenizer.add_tokens(...)` adds more) are not in the pickle:
transformers 4.34+ lists them in tokenizer_config.json's `added_tokens_decoder`, older versions in
`added_tokens.json`, and the model's `vocab_size` counts them. They keep their ids here, and are split out
of the text whole before Moses sees it, as transformers' `tokenize` does (they become protected symbols).
Every JSON file of the folder is read bounded (size, nesting, duplicate keys) through `txl.io`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from txl.data.vocab import Vocab
from txl.errors import CheckpointError, DataError
from txl.io import CONFIG_LIMIT, VOCAB_LIMIT, read_bytes, read_json
from txl.io.plain_pickle import PickleRefused, brief, read_plain_pickle_at

DEFAULT_PROTECTED = ("<unk>", "<eos>", "<formula>")  # TransfoXLTokenizer's unk, eos, additional special
TORCH_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch.save before 1.6: magic, protocol, sys_info, object, storages


def read_hf_vocab(path: str | Path, *, tokenizer_config: dict[str, Any] | None = None,
                  added_tokens: AddedTokens | None = None) -> Vocab:
    """The `Vocab` (words, with WikiText-103 text rules) of a TransfoXL `vocab.pkl`, followed by the
    tokens added beyond it (see `read_added_tokens`)."""
    path = Path(path)
    # a hub snapshot's files are links into its blob store: links are followed in a folder the user names
    data = read_bytes(path, what="vocabulary", limit=VOCAB_LIMIT, error=CheckpointError, follow_links=True)
    try:
        state, end = read_plain_pickle_at(data, 0)
        if state == TORCH_LEGACY_MAGIC and not isinstance(state, bool):  # a dictionary saved with torch.save
            for _ in range(3):  # protocol version, sys_info, then the object itself
                state, end = read_plain_pickle_at(data, end)
    except PickleRefused as err:
        raise CheckpointError(f"refused {path}: {err}; nothing in it was run (a TransfoXL vocab.pkl holds "
                              "plain data only)") from None
    try:
        return vocab_from_hf_state(state, tokenizer_config or {}, added_tokens)
    except DataError as err:
        raise CheckpointError(f"{path} is not a TransfoXL vocabulary: {err}") from None


def vocab_from_hf_state(state: Any, config: dict[str, Any], added_tokens: AddedTokens | None = None) -> Vocab:
    """Build our vocabulary from the plain data of a `vocab.pkl` (and tokenizer_config.json values, and
    the tokens added beyond the pickle)."""
    if not isinstance(state, dict):
        raise DataError(f"it holds a {type(state).__name__}, not the tokenizer's dictionary")
    symbols = _symbols(state)
    added = added_tokens.extend(symbols) if added_tokens is not None else []
    symbols = symbols + added

    def setting(key: str, kind: type | tuple[type, ...], default: Any) -> Any:
        value = config.get(key, state.get(key, default))
        if value is None and default is None:
            return None
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise DataError(f"its {key!r} is {brief(value)}")
        return value

    lower_case = setting("lower_case", bool, False)
    delimiter = setting("delimiter", str, None)
    if delimiter == "":
        raise DataError("it is a character-level vocabulary (delimiter ''), which txl does not import")
    language = setting("language", str, "en")
    clean_up = setting("clean_up_tokenization_spaces", bool, True)
    present = set(symbols)

    unk = config.get("unk_token")
    if not isinstance(unk, str) or unk not in present:
        unk_idx = state.get("unk_idx")
        if isinstance(unk_idx, int) and not isinstance(unk_idx, bool) and 0 <= unk_idx < len(symbols):
            unk = symbols[unk_idx]
        else:  # what TransfoXLTokenizer._convert_token_to_id falls back to
            unk = next((s for s in ("<unk>", "<UNK>") if s in present), None)
    eos = config.get("eos_token", "<eos>")
    eos = eos if isinstance(eos, str) and eos in present else None

    protected = config.get("never_split", state.get("never_split"))
    if protected is None:
        protected = [s for s in (unk, eos, *DEFAULT_PROTECTED) if s]
    if not isinstance(protected, list | tuple) or not all(isinstance(s, str) for s in protected):
        raise DataError(f"its 'never_split' is {brief(protected)}")
    # transformers splits every added token out of the text before its Moses pipeline sees it
    protected = list(dict.fromkeys(s for s in (*protected, *added) if s.strip()))
    rules = {"tokenizer": "moses", "language": language, "lower_case": lower_case, "protected": protected,
             "clean_up_spaces": clean_up}
    return Vocab("words", symbols, eos=eos, unk=unk, text=rules)


def _symbols(state: dict) -> list[str]:
    """idx2sym, checked against sym2idx (transformers 4.35 reloads only sym2idx, so both must agree)."""
    idx2sym = state.get("idx2sym")
    sym2idx = state.get("sym2idx")
    if isinstance(sym2idx, dict) and not all(isinstance(k, str) and isinstance(v, int) for k, v in sym2idx.items()):
        raise DataError("its 'sym2idx' is not a map from symbols to ids")
    if isinstance(idx2sym, list) and idx2sym:
        if not all(isinstance(s, str) for s in idx2sym):
            raise DataError("its 'idx2sym' holds something other than strings")
        if isinstance(sym2idx, dict) and sym2idx and any(sym2idx.get(s) != i for i, s in enumerate(idx2sym)):
            raise DataError("its 'idx2sym' and 'sym2idx' disagree")
        return idx2sym
    if isinstance(sym2idx, dict) and sym2idx:
        ids = sorted(sym2idx.values())
        if ids != list(range(len(ids))):
            raise DataError("its 'sym2idx' ids are not 0..n-1")
        return sorted(sym2idx, key=sym2idx.__getitem__)
    raise DataError("it has neither 'idx2sym' nor 'sym2idx'")


def read_tokenizer_config(path: Path) -> dict[str, Any]:
    """tokenizer_config.json as a dict ({} if absent); a damaged one is an error naming the file."""
    return _read_optional_object(path, "tokenizer config")


def _read_optional_object(path: Path, what: str) -> dict[str, Any]:
    """A JSON object read bounded ({} when there is no such entry; a FIFO or a directory is refused)."""
    if not os.path.lexists(path):
        return {}
    data = read_json(path, what=what, limit=CONFIG_LIMIT, error=CheckpointError, follow_links=True)
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} {path} is not a JSON object")
    return data


class AddedTokens:
    """Tokens a TransfoXL tokenizer added beyond its vocab.pkl: id -> token, and the file that says so."""

    def __init__(self, source: Path, tokens: dict[int, str]):
        self.source = source
        self.tokens = tokens

    def extend(self, symbols: list[str]) -> list[str]:
        """The symbols to append to `symbols` (ids len(symbols), len(symbols) + 1, ...). An added token whose
        id names the same symbol in the pickle is already there; any other id is an error naming the file."""
        where = {s: i for i, s in enumerate(symbols)}
        out: list[str] = []
        for token_id, token in sorted(self.tokens.items()):
            if token_id < len(symbols) and symbols[token_id] == token:
                continue
            if token_id < len(symbols):
                raise CheckpointError(
                    f"{self.source} gives {brief(token)} id {token_id}, which vocab.pkl gives to "
                    f"{brief(symbols[token_id])}; the tokenizer's files disagree (remove the entry to import "
                    "without that token)")
            if token in where:
                raise CheckpointError(f"{self.source} adds {brief(token)} as id {token_id}, but it has id "
                                      f"{where[token]} already; the tokenizer's files disagree")
            expected = len(symbols) + len(out)
            if token_id != expected:
                raise CheckpointError(f"{self.source} gives {brief(token)} id {token_id}, but the next free id is "
                                      f"{expected} (vocab.pkl has {len(symbols)} symbols); ids must follow on "
                                      "without a gap")
            where[token] = token_id
            out.append(token)
        return out


def read_added_tokens(directory: Path, tokenizer_config: dict[str, Any]) -> AddedTokens | None:
    """The tokens added beyond vocab.pkl, as transformers 4.35.2 finds them: tokenizer_config.json's
    `added_tokens_decoder` ({"67": {"content": "<formula>", ...}}) when it has one, else the legacy
    `added_tokens.json` ({"<formula>": 67}); None when neither is there."""
    if "added_tokens_decoder" in tokenizer_config:
        source = directory / "tokenizer_config.json"
        table = tokenizer_config["added_tokens_decoder"]
        if not isinstance(table, dict):
            raise CheckpointError(f"{source}: 'added_tokens_decoder' is {brief(table)}, not a JSON object")
        pairs = []
        for key, entry in table.items():
            token = entry.get("content") if isinstance(entry, dict) else None
            if not isinstance(token, str):
                raise CheckpointError(f"{source}: 'added_tokens_decoder' entry {brief(key)} has no 'content' string")
            pairs.append((key, token))
        return AddedTokens(source, _token_ids(source, pairs, key_is_id=True))
    source = directory / "added_tokens.json"
    table = _read_optional_object(source, "added tokens file")
    if not table:
        return None
    return AddedTokens(source, _token_ids(source, list(table.items()), key_is_id=False))


def _token_ids(source: Path, pairs: list[tuple[Any, Any]], *, key_is_id: bool) -> dict[int, str]:
    out: dict[int, str] = {}
    for key, value in pairs:
        token, token_id = (value, key) if key_is_id else (key, value)
        if key_is_id and isinstance(token_id, str) and token_id.isdecimal() and len(token_id) < 12:
            token_id = int(token_id)
        if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < 2**31:
            raise CheckpointError(f"{source}: token {brief(token)} has id {brief(token_id)}, not a non-negative "
                                  "integer")
        if not isinstance(token, str) or not token.strip():
            raise CheckpointError(f"{source}: id {token_id} names {brief(token)}, not a token (a non-blank string)")
        if token_id in out:
            raise CheckpointError(f"{source} gives id {token_id} to both {brief(out[token_id])} and {brief(token)}")
        out[token_id] = token
    return out
