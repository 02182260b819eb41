"""The published TransfoXL models end to end: vocab.pkl read without unpickling, WikiText-103 text rules
that reproduce transformers 4.35.2's `TransfoXLTokenizer`, `txl generate` / `txl eval` on the imported
directory, and hostile vocab.pkl files refused without running anything."""

from __future__ import annotations

import builtins
import collections
import contextlib
import os
import pickle
import subprocess
from pathlib import Path

import pytest
import torch

import hf_fixtures as F
from txl.cli.main import main
from txl.data import Vocab
from txl.errors import DataError
from txl.io.plain_pickle import MAX_DEPTH, PickleRefused, read_plain_pickle

# ---------------------------------------------------------------------------------------------
# the restricted reader on its own


PLAIN = {
    "list": [1, -2, 2**70, -(2**70), 2.5, None, True, False, "x", "é ünïcödé", b"\x00\xffbytes", (1, 2), ()],
    "set": {1, 2, "three"}, "frozen": frozenset([3, 4]), "nested": {"a": [{"b": (1, [2, [3]])}]},
    "counter": collections.Counter("abracadabra"), "ordered": collections.OrderedDict([("z", 1), ("a", 2)]),
    "empty": {}, "long_text": "w" * 300,
}


@pytest.mark.parametrize("protocol", range(6))
def test_plain_data_reads_back_equal_in_every_protocol(protocol):
    got = read_plain_pickle(pickle.dumps(PLAIN, protocol=protocol))
    assert got == PLAIN
    assert type(got["counter"]) is collections.Counter and type(got["ordered"]) is collections.OrderedDict
    assert list(got["ordered"]) == ["z", "a"]


def test_shared_objects_stay_shared():
    inner = [1, 2]
    got = read_plain_pickle(pickle.dumps({"a": inner, "b": inner}, protocol=4))
    assert got["a"] is got["b"]


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "truncated"),
        (b"\x80\x04K\x01", "truncated"),
        (b"\x80\x04X\xff\xff\xff\x7fabc.", "runs past the end"),
        (b"\x80\x04\xffK\x01.", "unknown opcode"),
        (b"\x80\x04h\x05.", "memo reference to nothing"),
        (b"\x80\x04a.", "stack underflow"),
        (b"\x80\x04K\x01K\x02.", "STOP with a stack"),
        (b"\x80\x04\x8b\x00\x00\x00\x10" + b"\x01" * 16, "integer of"),
        (b"\x80\x02X\x01\x00\x00\x00xX\x01\x00\x00\x00yb.", "BUILD on a str"),
        (b"\x80\x02Q.", "persistent ids"),
    ],
)
def test_malformed_streams_are_refused_with_a_reason(data, why):
    with pytest.raises(PickleRefused, match=why):
        read_plain_pickle(data)


def test_damaged_streams_end_in_a_refusal_never_another_exception():
    """Mutated pickles of every protocol (a local run of 612,066 found nothing; CI runs 3,000)."""
    import random

    seeds = [pickle.dumps(PLAIN, protocol=p) for p in range(6)]
    rng = random.Random(0)
    for _ in range(3000):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(data))
            kind = rng.randrange(4)
            if kind == 0:
                data[i] = rng.randrange(256)
            elif kind == 1:
                del data[i]
            elif kind == 2:
                data.insert(i, rng.randrange(256))
            else:
                data[i:i] = data[rng.randrange(len(data)):][: rng.randint(1, 8)]
        with contextlib.suppress(PickleRefused):  # anything else escapes and fails the test
            read_plain_pickle(bytes(data))


def test_unhashable_keys_are_a_refusal():
    data = b"\x80\x02}(]\x85K\x02u."  # {([],): 2}
    with pytest.raises(PickleRefused, match="unhashable"):
        read_plain_pickle(data)


def test_deep_nesting_is_refused_before_it_exhausts_the_stack():
    depth = 150_000  # within MAX_CONTAINERS (200,000): the depth is what refuses it
    bomb = b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."
    with pytest.raises(PickleRefused, match=f"nest more than {MAX_DEPTH} deep"):
        read_plain_pickle(bomb)


def test_billion_laughs_through_the_memo_is_refused():
    data = _laughs(40)  # 4**40 strings if expanded
    # the stream is valid pickle (the standard unpickler builds it in no time, sharing every level)
    assert len(pickle.loads(data)["x"]) == 4
    with pytest.raises(PickleRefused, match="pickle bomb"):
        read_plain_pickle(data)


# ---------------------------------------------------------------------------------------------
# Hostile vocab.pkl files: refused in one line, the payload never runs, nothing is written

# Payload factories: `marker` -> an object whose unpickling creates `marker` (checked on a control copy).


class ReduceToOpen:
    """Any class whose __reduce__ names a callable (here builtins.open, which creates the file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (builtins.open, (self.marker, "w"))


class Call:
    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


class PlainObject:
    """A class of the file's own, pickled the ordinary way (copyreg / NEWOBJ + BUILD)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __setstate__(self, state):
        Path(state["marker"]).write_text("ran")


PAYLOADS = {
    "os.system": lambda m: Call(os.system, f"touch {m}"),
    "builtins.eval": lambda m: Call(builtins.eval, f"open({str(m)!r}, 'w').close()"),
    "builtins.exec": lambda m: Call(builtins.exec, f"open({str(m)!r}, 'w').close()"),
    "subprocess": lambda m: Call(subprocess.call, ["touch", str(m)]),
    "class __reduce__": lambda m: ReduceToOpen(m),
    "class instance": lambda m: PlainObject(m),
}


def _vocab_like(evil) -> dict:
    """A vocabulary dict that hides the payload under a key an importer might ignore."""
    return {"idx2sym": ["<eos>", "<unk>", "a"], "sym2idx": {"<eos>": 0, "<unk>": 1, "a": 2}, "lower_case": False,
            "extra": evil}


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
@pytest.mark.parametrize("where", ["top-level", "nested"])
def test_hostile_vocab_pkl_is_refused_and_never_runs(tmp_path, capsys, payload, where):
    control = tmp_path / "control"  # the same payload does run when unpickled the ordinary way
    obj = PAYLOADS[payload](control)
    pickle.loads(pickle.dumps(_vocab_like(obj) if where == "nested" else obj, protocol=2))
    assert control.exists(), "the payload is not live"

    marker = tmp_path / "pwned"
    obj = PAYLOADS[payload](marker)
    src = _hf_dir_with_vocab(tmp_path, pickle.dumps(_vocab_like(obj) if where == "nested" else obj, protocol=2))
    code = main(["import-hf", str(src), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "refused" in err and "Traceback" not in err, err
    assert not marker.exists(), "the payload ran"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bomb", ["nested lists", "billion laughs"])
def test_pickle_bombs_as_vocab_pkl_are_refused(tmp_path, capsys, bomb):
    depth = 100_000
    data = (b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"." if bomb == "nested lists"
            else _laughs(60))
    src = _hf_dir_with_vocab(tmp_path, data)
    code = main(["import-hf", str(src), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "pickle bomb" in err, err
    assert not (tmp_path / "out").exists()


def _laughs(levels: int) -> bytes:
    """{'idx2sym': ['a'], 'x': L} where L_0 = ['lol'], L_i = [L_{i-1}] * 4 by memo reference."""
    # memo: 0 dict, 1 'idx2sym', 2 its list, 3 'a', 4 'x', 5 L_0, 6 'lol', then 7, 8, ... L_1, L_2, ...
    out = bytearray(b"\x80\x04}\x94(\x8c\x07idx2sym\x94]\x94\x8c\x01a\x94a\x8c\x01x\x94]\x94\x8c\x03lol\x94a")
    previous = 5
    for level in range(levels):
        out += b"0]\x94(" + (b"j" + previous.to_bytes(4, "little")) * 4 + b"e"  # POP L_{i-1}, build L_i
        previous = 7 + level
    return bytes(out) + b"u."


def _hf_dir_with_vocab(tmp_path: Path, vocab_bytes: bytes) -> Path:
    """A tiny valid HF checkpoint (safetensors, no pickle) next to the given vocab.pkl."""
    import json

    from safetensors.torch import save_file

    src = tmp_path / "hf"
    src.mkdir()
    cfg = {"vocab_size": 3, "cutoffs": [], "d_model": 8, "d_embed": 8, "n_head": 2, "d_head": 4, "d_inner": 16,
           "div_val": 1, "n_layer": 1, "mem_len": 4, "clamp_len": 0, "same_length": False, "untie_r": False}
    (src / "config.json").write_text(json.dumps(cfg))
    t = {"transformer.word_emb.emb_layers.0.weight": torch.zeros(3, 8), "transformer.r_w_bias": torch.zeros(2, 4),
         "transformer.r_r_bias": torch.zeros(2, 4), "crit.out_layers.0.bias": torch.zeros(3)}
    p = "transformer.layers.0."
    t.update({p + "dec_attn.qkv_net.weight": torch.zeros(24, 8), p + "dec_attn.o_net.weight": torch.zeros(8, 8),
              p + "dec_attn.r_net.weight": torch.zeros(8, 8), p + "pos_ff.CoreNet.0.weight": torch.zeros(16, 8),
              p + "pos_ff.CoreNet.0.bias": torch.zeros(16), p + "pos_ff.CoreNet.3.weight": torch.zeros(8, 16),
              p + "pos_ff.CoreNet.3.bias": torch.zeros(8)})
    for ln in ("dec_attn.layer_norm", "pos_ff.layer_norm"):
        t[p + ln + ".weight"], t[p + ln + ".bias"] = torch.ones(8), torch.zeros(8)
    save_file(t, str(src / "model.safetensors"))
    (src / "vocab.pkl").write_bytes(vocab_bytes)
    return src


def test_a_harmless_vocab_pkl_with_the_same_checkpoint_imports(tmp_path):
    """The control for the hostile cases: the checkpoint itself is fine."""
    src = _hf_dir_with_vocab(tmp_path, pickle.dumps(_vocab_like("harmless"), protocol=2))
    assert main(["import-hf", str(src), str(tmp_path / "out")]) == 0
    assert Vocab.load(tmp_path / "out" / "vocab.json").symbols == ("<eos>", "<unk>", "a")


@pytest.mark.parametrize(
    ("state", "why"),
    [
        ({"idx2sym": ["a", "b"], "sym2idx": {"a": 1, "b": 0}}, "disagree"),
        ({"counter": collections.Counter("ab")}, "neither 'idx2sym' nor 'sym2idx'"),
        ({"idx2sym": ["a", "a", "<unk>"]}, "duplicate"),
        ({"idx2sym": ["a", "b", 3]}, "other than strings"),
        ({"idx2sym": ["a", "b", "c"], "lower_case": "yes"}, "'lower_case' is 'yes'"),
        ({"idx2sym": ["a", "b", "c"], "delimiter": ""}, "character-level"),
        (["a", "b", "c"], "holds a list"),
        (119547037146038801333356, "truncated"),  # a legacy torch.save magic number and nothing after it
    ],
)
def test_vocab_pkl_that_is_not_a_vocabulary_is_one_line(tmp_path, capsys, state, why):
    src = _hf_dir_with_vocab(tmp_path, pickle.dumps(state, protocol=2))
    assert main(["import-hf", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert why in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_a_vocab_pkl_written_by_legacy_torch_save_is_read(tmp_path):
    """Before torch 1.6, torch.save wrote several pickles in a row (magic number, version, sys_info,
    the object); transformers falls back to torch.load for such a vocab file. Its object is plain data."""
    state = _vocab_like("plain")
    with open(tmp_path / "legacy.pkl", "wb") as f:
        torch.save(state, f, _use_new_zipfile_serialization=False)
    src = _hf_dir_with_vocab(tmp_path, (tmp_path / "legacy.pkl").read_bytes())
    assert main(["import-hf", str(src), str(tmp_path / "out")]) == 0
    assert Vocab.load(tmp_path / "out" / "vocab.json").symbols == ("<eos>", "<unk>", "a")


def test_vocab_json_text_rules_are_checked(tmp_path):
    base = {"format": "txl-vocab", "version": 1, "kind": "words", "symbols": ["<eos>", "a"], "eos": "<eos>"}
    assert Vocab.from_dict({**base, "text": {"lower_case": True}}).text_rules["lower_case"] is True
    for text, why in [({"lower_case": "no"}, "lower_case"), ({"tokenizer": "spacy"}, "tokenizer"),
                      ({"speed": 1}, "unknown keys"), ([], "JSON object"), ({"protected": [""]}, "protected")]:
        with pytest.raises(DataError, match=why):
            Vocab.from_dict({**base, "text": text})
    with pytest.raises(DataError, match="words vocabularies"):
        Vocab.from_dict({"format": "txl-vocab", "version": 1, "kind": "chars", "symbols": ["a"], "text": {}})


# ---------------------------------------------------------------------------------------------
# Parity with transformers 4.35.2's TransfoXLTokenizer, and the imported directory in use

def _need_hf() -> None:
    """Skip (not fail) without the dev extra: the tests above need neither library."""
    pytest.importorskip("transformers", reason="parity needs transformers==4.35.2 (dev extra)")
    pytest.importorskip("sacremoses", reason="WikiText-103 tokenisation needs sacremoses (dev/hf extra)")


@pytest.fixture(scope="module", params=["transformers-4.35", "pytorch-pretrained-bert", "lower-case"])
def imported(request, tmp_path_factory):
    """(HF tokenizer, imported txl directory) for each vocab.pkl layout."""
    _need_hf()
    tmp = tmp_path_factory.mktemp(request.param)
    tok = F.build_tokenizer(lower_case=request.param == "lower-case")
    src = tmp / "hf"
    src.mkdir()
    if request.param == "pytorch-pretrained-bert":
        F.write_old_layout(src / "vocab.pkl", tok)
    else:
        tok.save_vocabulary(str(src))
    F.save_hf_model(src, len(tok.idx2sym))
    assert main(["import-hf", str(src), str(tmp / "txl")]) == 0
    return tok, tmp / "txl"


@pytest.mark.hf
def test_the_4_35_vocab_pkl_holds_code_objects_that_stay_inert():
    """What makes the new layout hard: compiled regexes and sacremoses objects next to the data."""
    _need_hf()
    tok = F.build_tokenizer()
    state = read_plain_pickle(pickle.dumps(tok.__dict__, protocol=4))
    names = {type(v).__name__ for v in state.values()}
    assert "Opaque" in names
    assert repr(state["moses_tokenizer"]).startswith("<opaque")
    assert state["idx2sym"] == tok.idx2sym and state["sym2idx"] == tok.sym2idx and state["counter"] == tok.counter


@pytest.mark.hf
@pytest.mark.parametrize("sentence", F.SENTENCES)
def test_token_ids_and_decoded_text_match_transfoxl_tokenizer(imported, sentence):
    tok, out = imported
    vocab = Vocab.load(out / "vocab.json")  # the rules travel in vocab.json: nothing else is consulted
    ids = vocab.encode(sentence).tolist()
    assert ids == tok.encode(sentence), (tok.tokenize(sentence), [vocab.symbols[i] for i in ids])
    assert vocab.unk_id in ids or "<unk>" not in sentence
    assert vocab.decode(ids) == tok.decode(ids)


@pytest.mark.hf
def test_decoding_undoes_wikitext_splits(imported):
    tok, out = imported
    vocab = Vocab.load(out / "vocab.json")
    text = "The year 1990 was 23,000 people's state-of-the-art time."
    text = text.lower() if tok.lower_case else text
    assert "@,@" in [vocab.symbols[i] for i in vocab.encode(text)]
    assert vocab.decode(vocab.encode(text)) == text


@pytest.mark.hf
def test_lines_of_a_prompt_end_in_eos_and_decode_back(imported):
    _tok, out = imported
    vocab = Vocab.load(out / "vocab.json")
    ids = vocab.encode("It was 1,000 km.\nThe city")
    assert vocab.symbols[ids[6]] == "." and ids[7] == vocab.eos_id
    assert vocab.decode(ids).split("\n")[0].lower() == "it was 1,000 km."


@pytest.mark.hf
def test_generate_on_the_imported_directory_prints_detokenised_text(imported, capsys):
    from txl.generate.decoder import generate
    from txl.models.transformer_xl.model import TransformerXL

    _tok, out = imported
    prompt = "The year 1990 was 23,000 people's state"
    assert main(["generate", str(out), "--prompt", prompt, "--greedy", "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out
    vocab = Vocab.load(out / "vocab.json")
    ids = vocab.encode(prompt).tolist()
    new = generate(TransformerXL.from_pretrained(out), ids, max_new_tokens=12, temperature=0.0)
    full = vocab.decode(ids + new)
    assert printed == prompt + full[len(vocab.decode(ids)):] + "\n"
    assert "@,@" not in printed


@pytest.mark.hf
def test_streamed_text_equals_the_decoded_text(imported):
    """TextStream holds back joiners (@-@, @,@) until the next word: no half-joined text is written."""
    from txl.generate.text import TextStream

    _tok, out = imported
    vocab = Vocab.load(out / "vocab.json")
    prompt = vocab.encode("The year").tolist()
    new = vocab.encode(" 23,000 people's state-of-the-art time, \"hello\" (twice) 1.80 m.").tolist()
    pieces: list[str] = []
    stream = TextStream(vocab, pieces.append, prefix=prompt)
    for token in new:
        stream.push(token)
        assert vocab.decode(prompt + new).startswith(vocab.decode(prompt) + "".join(pieces))
    stream.close()
    assert vocab.decode(prompt) + "".join(pieces) == vocab.decode(prompt + new)
    assert "-of-" in "".join(pieces) and "23,000" in "".join(pieces)


def test_streamed_text_of_a_long_generation_equals_the_decoded_text(imported):
    """Past the stream's bounded decoding window (hundreds of tokens) joiners are still held back."""
    from txl.generate.text import TextStream

    _tok, out = imported
    vocab = Vocab.load(out / "vocab.json")
    prompt = vocab.encode("The year").tolist()
    new = vocab.encode(" 23,000 people's state-of-the-art time, \"hello\" (twice) 1.80 m." * 12).tolist()
    assert len(new) > 2 * TextStream.WINDOW
    pieces: list[str] = []
    stream = TextStream(vocab, pieces.append, prefix=prompt)
    for token in new:
        stream.push(token)
    stream.close()
    assert vocab.decode(prompt) + "".join(pieces) == vocab.decode(prompt + new)


# ---------------------------------------------------------------------------------------------
# The paper's evaluation command on a small file in WikiText-103's format

WIKI_LINES = [
    " = Valkyria Chronicles = ",
    "",
    " The year 1990 was a time of 23 @,@ 000 people . It was 1 @.@ 80 m tall , he said . ",
    " The state @-@ of @-@ the @-@ art city of New York is 5 @,@ 000 km long ; I do n't know . ",
    "",
    " = = Zyzzyva = = ",
    " Hello world ! The <unk> was 10 % of 100 $ . Frobnication is unknown here . ",
]


@pytest.mark.hf
def test_paper_evaluation_command_on_a_wikitext103_format_directory(imported, tmp_path, capsys):
    """README: `txl eval OUT --data wikitext103:DIR --split test --tgt-len 128 --mem-len 1600 --clamp-len 1000
    --same-length --batch-size 10 --no-warm-memory`: the corpus file is read as it is (whitespace symbols,
    <eos> per line, unknown words <unk>) with the imported vocabulary, as the reference code reads it."""
    import json

    import numpy as np

    from txl.eval.segments import evaluate
    from txl.models.transformer_xl.model import TransformerXL

    tok, out = imported
    data = tmp_path / "wikitext-103"
    data.mkdir()
    for split, repeat in (("train", 3), ("valid", 2), ("test", 40)):
        (data / f"wiki.{split}.tokens").write_text("\n".join(WIKI_LINES * repeat) + "\n", encoding="utf-8")
    cmd = ["eval", str(out), "--data", f"wikitext103:{data}", "--split", "test", "--tgt-len", "128", "--mem-len",
           "1600", "--clamp-len", "1000", "--same-length", "--batch-size", "10", "--no-warm-memory"]
    assert main([*cmd, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)

    # the stream the reference builds: line.split() + <eos>, ids from the HF tokenizer's own table
    lines = (data / "wiki.test.tokens").read_text(encoding="utf-8").split("\n")[:-1]
    symbols = [s for line in lines for s in line.split() + ["<eos>"]]
    ids = np.asarray([tok.sym2idx.get(s, tok.sym2idx["<unk>"]) for s in symbols])
    model = TransformerXL.from_pretrained(out)
    expected = evaluate(model, ids, metric="ppl", batch_size=10, tgt_len=128, mem_len=1600, warm_memory=False,
                        clamp_len=1000, same_length=True)
    assert (result["tokens"], result["mem_len"], result["tgt_len"], result["clamp_len"], result["same_length"]) == (
        expected.tokens, 1600, 128, 1000, True)
    assert result["ppl"] == pytest.approx(expected.value, rel=1e-6)
    assert main(cmd) == 0  # the table form prints the perplexity
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("ppl "))
    assert float(row.split()[1]) == pytest.approx(expected.value, abs=1e-4)


@pytest.mark.hf
def test_evaluating_an_imported_model_on_a_byte_corpus_is_one_line(imported, tmp_path, capsys):
    _tok, out = imported
    (tmp_path / "t.txt").write_text("some text\n" * 50)
    assert main(["eval", str(out), "--data", f"text:{tmp_path / 't.txt'}"]) == 2
    err = capsys.readouterr().err
    assert "word-level corpus" in err and err.count("\n") == 1, err


@pytest.mark.hf
def test_without_sacremoses_raw_text_names_the_extra(imported, monkeypatch, capsys):
    import sys

    _tok, out = imported
    monkeypatch.setitem(sys.modules, "sacremoses", None)  # import fails as if not installed
    with pytest.raises(DataError, match=r"pip install 'txl\[hf\]'"):
        Vocab.load(out / "vocab.json").encode("Hello, world")
    assert main(["generate", str(out), "--prompt", "Hello, world", "--max-new-tokens", "2"]) == 2
    captured = capsys.readouterr()
    assert "sacremoses" in captured.err and captured.err.count("\n") == 1, captured.err


# ---------------------------------------------------------------------------------------------
# Tokens added beyond vocab.pkl (issue 50): a folder saved by transformers 4.35.2, checked in
# (tests/data/hf_added_tokens, written by tests/data/make_hf_added_tokens.py)

ADDED = Path(__file__).parent / "data" / "hf_added_tokens"


def _expected_ids() -> dict[str, list[int]]:
    import json

    return json.loads((ADDED / "expected.json").read_text(encoding="utf-8"))["ids"]


def _added_copy(tmp_path: Path, *, legacy: bool = False, **files: str) -> Path:
    """A copy of the folder; `legacy` drops tokenizer_config.json's added_tokens_decoder (what transformers
    < 4.34 wrote), so added_tokens.json is what names the added token; `files` replace files' text."""
    import json
    import shutil

    src = tmp_path / "hf"
    shutil.copytree(ADDED, src)
    if legacy:
        config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
        del config["added_tokens_decoder"]
        (src / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    for name, text in files.items():
        (src / name.replace("__", ".")).write_text(text, encoding="utf-8")
    return src


@pytest.mark.parametrize("legacy", [False, True], ids=["added_tokens_decoder", "added_tokens.json"])
def test_a_folder_with_an_added_token_imports_and_tokenises_as_transformers(tmp_path, legacy):
    """vocab.pkl holds 67 symbols; `<formula>` was added as id 67 and config.json counts 68. Before issue
    50 import-hf refused the folder ("vocab.pkl has 67 symbols but config.json has vocab_size=68")."""
    pytest.importorskip("sacremoses", reason="WikiText-103 tokenisation needs sacremoses (dev/hf extra)")
    src = _added_copy(tmp_path, legacy=legacy)
    assert main(["import-hf", str(src), str(tmp_path / "out")]) == 0
    vocab = Vocab.load(tmp_path / "out" / "vocab.json")
    assert vocab.size == 68 and vocab.symbols[67] == "<formula>" and vocab.symbols[:2] == ("<eos>", "<unk>")
    for sentence, ids in _expected_ids().items():  # what TransfoXLTokenizer.from_pretrained(folder) gave
        assert vocab.encode(sentence).tolist() == ids, sentence
    assert "<formula>" in vocab.decode(vocab.encode("a <formula> b"))


@pytest.mark.hf
@pytest.mark.parametrize("legacy", [False, True], ids=["added_tokens_decoder", "added_tokens.json"])
def test_added_tokens_tokenise_as_the_live_transfoxl_tokenizer(tmp_path, legacy):
    """The same against transformers itself, on the checked-in sentences and the parity sentences."""
    _need_hf()
    from transformers import TransfoXLTokenizer

    src = _added_copy(tmp_path, legacy=legacy)
    assert main(["import-hf", str(src), str(tmp_path / "out")]) == 0
    vocab = Vocab.load(tmp_path / "out" / "vocab.json")
    tok = TransfoXLTokenizer.from_pretrained(str(src))
    assert tok.added_tokens_encoder["<formula>"] == 67 and len(tok) == vocab.size
    for sentence in [*_expected_ids(), *F.SENTENCES]:
        assert vocab.encode(sentence).tolist() == tok.encode(sentence), sentence


@pytest.mark.parametrize(
    ("files", "why"),
    [
        ({"added_tokens__json": '{"<formula>": 2}'}, "gives '<formula>' id 2, which vocab.pkl gives to 'the'"),
        ({"added_tokens__json": '{"<formula>": 70}'}, "next free id is 67"),
        ({"added_tokens__json": '{"<formula>": "67"}'}, "not a non-negative integer"),
        ({"added_tokens__json": '{"<formula>": 67, "<f2>": 67}'}, "gives id 67 to both"),
        ({"added_tokens__json": '{"the": 67}'}, "has id 2 already"),
        ({"added_tokens__json": '{" ": 67}'}, "not a token"),
        ({"added_tokens__json": '["<formula>"]'}, "not a JSON object"),
        ({"added_tokens__json": '{"<formula>": 67, "<formula>": 68}'}, "appears twice"),
        ({"added_tokens__json": "[" * 100_000 + "]" * 100_000}, "nests too deeply"),
        ({"added_tokens__json": '{"<formula>": 67, "<extra>": 68}'}, "69 symbols (with the tokens of "
                                                                     "added_tokens.json) but config.json has "
                                                                     "vocab_size=68"),
    ],
    ids=["taken-id", "gap", "string-id", "two-tokens-one-id", "existing-symbol", "blank", "list", "duplicate-key",
         "100k-deep", "one-more-than-the-model"],
)
def test_a_damaged_added_tokens_json_is_one_line(tmp_path, capsys, files, why):
    src = _added_copy(tmp_path, legacy=True, **files)
    assert main(["import-hf", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert why in err and err.count("\n") == 1 and "added_tokens.json" in err, err
    assert not (tmp_path / "out").exists()


def test_a_damaged_added_tokens_decoder_is_one_line(tmp_path, capsys):
    import json

    src = _added_copy(tmp_path)
    config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["added_tokens_decoder"]["67"] = {"special": True}
    (src / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    assert main(["import-hf", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "'added_tokens_decoder' entry '67' has no 'content' string" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("name", ["tokenizer_config.json", "added_tokens.json"])
def test_a_100k_deep_json_file_in_the_folder_is_one_line(tmp_path, capsys, name):
    """json.loads raised RecursionError (a traceback) on a 100k-deep tokenizer_config.json."""
    src = _added_copy(tmp_path, legacy=name == "added_tokens.json")
    (src / name).write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    assert main(["import-hf", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "nests too deeply" in err and name in err and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("name", ["tokenizer_config.json", "added_tokens.json", "vocab.pkl"])
def test_a_fifo_in_the_folder_is_refused_not_waited_on(tmp_path, capsys, name):
    src = _added_copy(tmp_path, legacy=True)
    (src / name).unlink()
    os.mkfifo(src / name)
    assert main(["import-hf", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "not a regular file" in err and name in err and err.count("\n") == 1, err
