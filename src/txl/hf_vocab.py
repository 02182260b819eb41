"""Hugging Face TransfoXL `vocab.pkl` -> our `vocab.json`, without unpickling.

`TransfoXLTokenizer.save_vocabulary` pickles the tokenizer's whole `__dict__`; loading it with `pickle`
runs whatever the file names (CVE-2023-6730). We read it with `txl.plain_pickle`, which builds plain
data only, and take what a vocabulary is made of. Two layouts exist and both are read:

- transformers 4.x (4.35.2 checked): `idx2sym`, `sym2idx` (OrderedDict), `counter` (Counter), `special`,
  `lower_case`, `delimiter`, `never_split`, `unk_idx`, ... plus compiled regexes, sacremoses objects
  and tokenizer bookkeeping, which are kept as inert placeholders and ignored;
- pytorch-pretrained-bert, with which the hub's `transfo-xl-wt103` file was made: the same keys
  without the regexes and Moses objects.

Settings in a `tokenizer_config.json` next to the file take precedence over those in the pickle, as
they do when transformers loads the tokenizer (its constructor arguments win over the pickled ones).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from txl.data.vocab import Vocab
from txl.errors import CheckpointError, DataError
from txl.plain_pickle import PickleRefused, read_plain_pickle_at

DEFAULT_PROTECTED = ("<unk>", "<eos>", "<formula>")  # TransfoXLTokenizer's unk, eos, additional special
TORCH_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch.save before 1.6: magic, protocol, sys_info, object, storages


def read_hf_vocab(path: str | Path, *, tokenizer_config: dict[str, Any] | None = None) -> Vocab:
    """The `Vocab` (words, with WikiText-103 text rules) of a TransfoXL `vocab.pkl`."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err.strerror or err}") from None
    try:
        state, end = read_plain_pickle_at(data, 0)
        if state == TORCH_LEGACY_MAGIC and not isinstance(state, bool):  # a dictionary saved with torch.save
            for _ in range(3):  # protocol version, sys_info, then the object itself
                state, end = read_plain_pickle_at(data, end)
    except PickleRefused as err:
        raise CheckpointError(f"refused {path}: {err}; nothing in it was run (a TransfoXL vocab.pkl holds "
                              "plain data only)") from None
    try:
        return vocab_from_hf_state(state, tokenizer_config or {})
    except DataError as err:
        raise CheckpointError(f"{path} is not a TransfoXL vocabulary: {err}") from None


def vocab_from_hf_state(state: Any, config: dict[str, Any]) -> Vocab:
    """Build our vocabulary from the plain data of a `vocab.pkl` (and tokenizer_config.json values)."""
    if not isinstance(state, dict):
        raise DataError(f"it holds a {type(state).__name__}, not the tokenizer's dictionary")
    symbols = _symbols(state)

    def setting(key: str, kind: type | tuple[type, ...], default: Any) -> Any:
        value = config.get(key, state.get(key, default))
        if value is None and default is None:
            return None
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise DataError(f"its {key!r} is {value!r}")
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
        raise DataError(f"its 'never_split' is {protected!r}")
    protected = list(dict.fromkeys(s for s in protected if s.strip()))
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
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return data
