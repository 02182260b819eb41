"""Raw text <-> WikiText-103 symbols, the way the published Transformer-XL models were trained.

WikiText-103 is tokenised with Moses conventions: punctuation split off, hyphens inside words written
` @-@ `, and commas and dots between digits written ` @,@ ` / ` @.@ ` (`23,000` -> `23 @,@ 000`). A user's
prompt must be turned into the same symbols, or the model sees `<unk>` where it knows the word. These
rules are those of Hugging Face's `TransfoXLTokenizer` (transformers 4.35.2, whose `_tokenize`,
`moses_pipeline`, `convert_tokens_to_string` and `_decode` we follow step by step), using `sacremoses`
as it does:

encode one line: split out the protected symbols (`<unk>`, `<eos>`, `<formula>`: kept whole) ->
lower-case the rest if the vocabulary is lower-cased -> Moses punctuation normalisation -> Moses
tokenisation (`aggressive_dash_splits`, no escaping) -> numbers split.

decode: Moses detokenisation -> number splits undone -> strip -> the tokenizer's clean-up of spaces
before punctuation (`clean_up_tokenization_spaces`).

The rules travel inside `vocab.json` (`"text": {...}`, see `check_rules`), so every command that loads
a checkpoint tokenises the same way. Pre-tokenised corpus files never pass through here: they are
whitespace-split as they are, as the paper's numbers require.
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import Any

from txl.errors import DataError

# transformers 4.35.2 tokenization_transfo_xl.py: MATCH_NUMBERS / DETOKENIZE_NUMBERS
_NUMBER_SPLIT = re.compile(r"(?<=\d)[,.](?=\d)")
_NUMBER_JOIN = ((re.compile(r" @\,@ "), ","), (re.compile(r" @\.@ "), "."))
# PreTrainedTokenizerBase.clean_up_tokenization, in its order
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))

RULE_KEYS = {"tokenizer": str, "language": str, "lower_case": bool, "protected": list, "clean_up_spaces": bool}


def check_rules(rules: Any) -> dict[str, Any]:
    """Validate the `"text"` object of a vocab.json; returns it with every key present."""
    if not isinstance(rules, dict):
        raise DataError("text rules must be a JSON object")
    unknown = set(rules) - set(RULE_KEYS)
    if unknown:
        raise DataError(f"text rules have unknown keys {sorted(unknown)}; known: {', '.join(RULE_KEYS)}")
    out = {"tokenizer": "moses", "language": "en", "lower_case": False, "protected": [], "clean_up_spaces": True,
           **rules}
    for key, kind in RULE_KEYS.items():
        if not isinstance(out[key], kind):
            raise DataError(f"text rule {key!r} must be a {kind.__name__}, got {out[key]!r}")
    if out["tokenizer"] != "moses":
        raise DataError(f"text rule tokenizer {out['tokenizer']!r} is unknown; this txl knows 'moses'")
    if not re.fullmatch(r"[a-z]{2,3}", out["language"]):
        raise DataError(f"text rule language {out['language']!r} is not a language code such as 'en'")
    if not all(isinstance(s, str) and s and not s.isspace() for s in out["protected"]):
        raise DataError("text rule protected must be a list of non-blank strings")
    return out


def _sacremoses():
    try:
        import sacremoses
    except ImportError:
        raise DataError("this vocabulary tokenises raw text the WikiText-103 way, which needs the optional "
                        "dependency 'sacremoses': pip install 'txl[hf]' (or sacremoses)") from None
    return sacremoses


class MosesText:
    """Tokeniser and detokeniser for one set of rules (see the module docstring)."""

    def __init__(self, rules: dict[str, Any]):
        self.rules = check_rules(rules)
        protected = sorted(set(self.rules["protected"]), key=len, reverse=True)
        self._protected = set(protected)
        self._split = re.compile("(" + "|".join(map(re.escape, protected)) + ")") if protected else None

    @cached_property
    def _moses(self):
        sm = _sacremoses()
        lang = self.rules["language"]
        return sm.MosesPunctNormalizer(lang), sm.MosesTokenizer(lang), sm.MosesDetokenizer(lang)

    def tokenize(self, line: str) -> list[str]:
        """Symbols of one line of raw text (no `<eos>`)."""
        pieces = self._split.split(line) if self._split else [line]
        if self.rules["lower_case"]:  # HF lower-cases everything but the special tokens, one character at a
            # time (so a word-final capital sigma becomes σ, not the ς of str.lower() on the whole word)
            pieces = [p if p in self._protected else "".join(c.lower() for c in p) for p in pieces]
        out: list[str] = []
        for piece in pieces:
            if piece in self._protected:
                out.append(piece)
            elif piece.strip():
                out.extend(self._moses_pipeline(piece.strip()))
        return out

    def _moses_pipeline(self, text: str) -> list[str]:
        normalizer, tokenizer, _ = self._moses
        text = normalizer.normalize(text)
        tokens = tokenizer.tokenize(text, aggressive_dash_splits=True, return_str=False, escape=False,
                                    protected_patterns=self.rules["protected"])
        return [t for token in tokens for t in _NUMBER_SPLIT.sub(r" @\g<0>@ ", token).split()]

    def detokenize(self, symbols: list[str]) -> str:
        """Readable text of the symbols of one line."""
        if not symbols:
            return ""
        text = self._moses[2].detokenize(symbols)
        for pattern, replacement in _NUMBER_JOIN:
            text = pattern.sub(replacement, text)
        text = text.strip()
        if self.rules["clean_up_spaces"]:
            for old, new in _CLEAN_UP:
                text = text.replace(old, new)
        return text
