"""The one decoder and the one token picker: `txl.nn.sampling.pick_tokens` (greedy, top-k, top-p,
seeded draws), `txl.generate.decoder.Decoder` (stepping = feeding the text at once, with memory and with
the mem_len 0 window), the encoder-decoder's sampling drawing as its own loop did, and `txl.generate`
importing nothing above it (the models, the CLI, eval, train, serve, bench), at any depth."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from txl import EncoderDecoderConfig, TransformerXLConfig
from txl.generate.decoder import Decoder
from txl.generate.seq2seq import sample as seq2seq_sample
from txl.models.seq2seq import EncoderDecoder
from txl.models.transformer_xl.model import TransformerXL
from txl.nn.sampling import filter_logits, pick_tokens

SRC = Path(__file__).resolve().parents[1] / "src" / "txl"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def scores(rows: int = 3, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_the_argmax_and_top_k_1_is_greedy():
    logits = scores()
    assert torch.equal(pick_tokens(logits, temperature=0.0), logits.argmax(-1))
    for seed in range(5):
        drawn = pick_tokens(logits, temperature=1.0, top_k=1, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(drawn, logits.argmax(-1))


def test_a_seed_gives_the_same_tokens_and_another_seed_others():
    logits = scores(rows=64)

    def draw(seed):
        return pick_tokens(logits, temperature=1.0, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(draw(7), draw(7))
    assert not torch.equal(draw(7), draw(8))


def test_top_p_keeps_the_smallest_nucleus_and_never_drops_the_top_token():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(filter_logits(logits, top_p=0.75))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.75 <= 0.5 + 0.3
    assert torch.isfinite(filter_logits(logits, top_p=1e-6)).tolist() == [[True, False, False, False]]
    for seed in range(20):
        token = pick_tokens(logits, top_p=0.75, generator=torch.Generator().manual_seed(seed))
        assert int(token[0]) in (0, 1)


def test_non_finite_scores_are_one_line_naming_the_checkpoint():
    from txl.errors import CheckpointError

    logits = scores()
    logits[1, 3] = float("nan")
    with pytest.raises(CheckpointError, match="not finite.*another checkpoint"):
        pick_tokens(logits, temperature=0.0)


def tiny_model(mem_len: int) -> TransformerXL:
    torch.manual_seed(0)
    config = TransformerXLConfig(vocab_size=40, n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64,
                                 mem_len=mem_len, dropout=0.0, init_std=0.3)
    return TransformerXL(config).eval()


@pytest.mark.parametrize("mem_len", [64, 0])
def test_stepping_token_by_token_equals_feeding_the_text_at_once(mem_len):
    """The decoder's next-token logits after feeding a prompt and stepping tokens one at a time equal
    those after feeding the whole text at once (memory carried; or the mem_len 0 window, re-run)."""
    model = tiny_model(mem_len)
    text = torch.randint(0, 40, (2, 30), generator=torch.Generator().manual_seed(1))
    whole = Decoder(model, segment_len=64).feed(text)
    stepped = Decoder(model, segment_len=64)
    logits = stepped.feed(text[:, :12])
    for t in range(12, 30):
        logits = stepped.step(text[:, t])
    torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-5)
    assert (stepped.memory is None) == (mem_len == 0)


def test_the_window_holds_the_last_segment_len_tokens():
    model = tiny_model(0)
    text = torch.randint(0, 40, (1, 30), generator=torch.Generator().manual_seed(2))
    decoder = Decoder(model, segment_len=8)
    decoder.feed(text[:, :20])
    for t in range(20, 30):
        logits = decoder.step(text[:, t])
    assert torch.equal(decoder.context, text[:, -8:])
    with torch.no_grad():
        torch.testing.assert_close(logits, model(text[:, -8:], mem_len=0).logits[:, -1], rtol=1e-6, atol=1e-6)


def test_encoder_decoder_sampling_draws_as_its_own_loop_did():
    """seq2seq `sample` goes through the one picker; with a seed its tokens are those of the loop it
    replaced (softmax of the top-k-filtered log-probabilities / temperature, one multinomial per step)."""
    torch.manual_seed(0)
    model = EncoderDecoder(EncoderDecoderConfig(vocab_size=23, n_layer=2, n_encoder_layer=2, d_model=32,
                                                n_head=4, d_head=8, d_inner=48, pos_encoding="sinusoidal",
                                                dropout=0.0)).eval()
    source = torch.randint(3, 23, (3, 7), generator=torch.Generator().manual_seed(3))
    bos, eos, max_len, temperature, top_k = 1, 2, 12, 0.9, 5
    new = seq2seq_sample(model, source, bos=bos, eos=eos, max_len=max_len, temperature=temperature, top_k=top_k,
                         generator=torch.Generator().manual_seed(4), use_cache=False)
    generator = torch.Generator().manual_seed(4)
    prefix = torch.full((3, 1), bos)
    done = torch.zeros(3, dtype=torch.bool)
    with torch.no_grad():
        encoded = model.encode(source)
        for _ in range(max_len):
            log_probs = model.output_logits(model.decode(prefix, encoded)[:, -1]).float().log_softmax(-1)
            scaled = log_probs / temperature
            kth = scaled.topk(top_k, dim=-1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            token = torch.multinomial(scaled.softmax(-1), 1, generator=generator).squeeze(1)
            token = torch.where(done, torch.full_like(token, eos), token)
            prefix = torch.cat([prefix, token[:, None]], dim=1)
            done |= token == eos
            if bool(done.all()):
                break
    old = [row[: row.index(eos)] if eos in row else row for row in prefix[:, 1:].tolist()]
    assert new.tokens == old


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def test_generation_imports_nothing_above_it_at_any_depth():
    """txl.generate sits below txl.models (it knows the model contract, never the classes), and the
    picker in txl.nn below both: no import of a higher package anywhere in them, function-level included."""
    above = ("txl.models", "txl.eval", "txl.train", "txl.serve", "txl.bench", "txl.cli")
    files = sorted((SRC / "generate").glob("*.py")) + [SRC / "nn" / "sampling.py"]
    assert len(files) >= 4
    for path in files:
        upward = sorted(m for m in _imports(path) if m.startswith(above))
        assert not upward, f"{path.relative_to(SRC)} imports {upward}"
