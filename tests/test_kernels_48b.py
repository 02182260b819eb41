"""Issue 48's kernels B: axial attention (Ho et al. 2019) and ETC's global-local attention (Ainslie et al.
2020). Each against a reference written pair by pair from the paper's rules (Python loops, independent
of the kernels' vectorised patterns), fast = eager with gradients, and in a model with small options:
causality, segment invariance with memory, generation with memory, padding, a three-step training run.
(tests/test_kernels.py runs the registry-wide invariants on both with their default options.)"""

from __future__ import annotations

import pytest
import torch

from txl import ConfigError, TransformerXLConfig
from txl.models.transformer_xl.model import TransformerXL
from txl.nn.attention.axial import AxialAttention, AxialReference, axial_pattern, head_axes
from txl.nn.attention.etc import ETCAttention, ETCReference, etc_labels
from txl.nn.attention.masks import CAUSAL, AttentionMask
from txl.nn.positional import CONTENT_ONLY

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(vocab_size=61, n_layer=2, d_model=32, n_head=4, d_head=8, d_inner=48, mem_len=32, dropout=0.0,
            dropatt=0.0, pos_encoding="rope")
SMALL = {"axial": dict(row=4, axes=["row", "column", "previous-row"]), "etc": dict(radius=2, chunk=4)}


def config(name: str, *, causal: bool = True, **options) -> TransformerXLConfig:
    extra = {} if causal else dict(causal=False, mem_len=0)
    return TransformerXLConfig(**{**BASE, **extra, "attention": name, "attention_options": {**SMALL[name], **options}})


def qkv(n: int, i: int, *, seed: int = 0, grad: bool = False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, length, 8, generator=g, dtype=dtype).requires_grad_(grad) for length in (i, n, n)]


def attend(kernel, q, k, v, mask=CAUSAL):
    return kernel(q, k, v, positions=CONTENT_ONLY, mask=mask, dropatt=0.0, training=False)[0]


def loop_attention(q, k, v, sees, score):
    """softmax over the keys `sees(head, query_pos, key_pos)` holds of q·k/sqrt(d) + score(...), row by
    row in float64; a row that sees nothing is 0."""
    b, h, i, d = q.shape
    n = k.shape[2]
    out = torch.zeros(b, h, i, d, dtype=torch.float64)
    for head in range(h):
        for row in range(i):
            p = row + n - i
            keys = [j for j in range(n) if sees(head, p, j)]
            if not keys:
                continue
            s = torch.stack([(q[:, head, row].double() * k[:, head, j].double()).sum(-1) / d**0.5
                             + score(head, p, j) for j in keys], dim=-1)
            w = s.softmax(-1)
            out[:, head, row] = sum(w[:, t:t + 1] * v[:, head, j].double() for t, j in enumerate(keys))
    return out


def build(cfg: TransformerXLConfig, seed: int = 0) -> TransformerXL:
    torch.manual_seed(seed)
    model = TransformerXL(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


# ---------------------------------------------------------------------------------------------
# axial


def axial_sees(kinds, c, causal):
    def sees(head, p, j):
        if causal and j > p:
            return False
        kind = kinds[head]
        if kind == "row":
            return j // c == p // c
        if kind == "column":
            return j % c == p % c
        return j // c == p // c - 1  # previous-row

    return sees


@pytest.mark.parametrize("axes", [("row", "column"), ("row", "column", "previous-row"), ("column", "row", "row", "column")])
@pytest.mark.parametrize(("causal", "n", "i"), [(True, 23, 23), (True, 31, 17), (True, 9, 1), (False, 22, 22)])
@pytest.mark.parametrize("kernel", [AxialAttention, AxialReference])
def test_axial_equals_its_pair_by_pair_definition(axes, causal, n, i, kernel):
    if not causal and "previous-row" in axes:
        pytest.skip("previous-row is causal only")
    cfg = config("axial", causal=causal, row=4, axes=list(axes))
    q, k, v = qkv(n, i)
    kinds = head_axes(4, axes)
    expected = loop_attention(q, k, v, axial_sees(kinds, 4, causal), lambda *_: 0.0)
    got = attend(kernel(cfg), q, k, v, AttentionMask(causal=causal))
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("causal", "n", "i"), [(True, 26, 26), (True, 30, 11), (False, 21, 21)])
def test_axial_fast_equals_eager_with_gradients_and_padding(causal, n, i):
    cfg = config("axial", causal=causal, row=5, axes=["row", "column"] if not causal else ["row", "column", "previous-row"])
    padding = torch.ones(2, n, dtype=torch.bool)
    padding[1, :3] = False  # a left-padded row
    mask = AttentionMask(causal=causal, key_padding=padding)
    outs, grads = [], []
    for kernel in (AxialAttention(cfg), AxialReference(cfg)):
        q, k, v = qkv(n, i, grad=True)
        out = attend(kernel, q, k, v, mask)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append(out)
        grads.append((q.grad, k.grad, v.grad))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_axial_degenerate_grids_are_full_attention():
    """One row holding every key (row >= n, row heads) or one column holding every key (row = 1,
    column heads): plain causal attention."""
    q, k, v = qkv(20, 12)
    full = loop_attention(q, k, v, lambda h, p, j: j <= p, lambda *_: 0.0)
    for options in (dict(row=32, axes=["row"]), dict(row=1, axes=["column"])):
        got = attend(AxialAttention(config("axial", **options)), q, k, v)
        torch.testing.assert_close(got.double(), full, atol=1e-5, rtol=1e-5)


def test_axial_previous_row_heads_give_the_first_row_zero():
    cfg = config("axial", row=4, axes=["previous-row"])
    q, k, v = qkv(12, 12)
    out = attend(AxialAttention(cfg), q, k, v)
    assert out[:, :, :4].abs().max() == 0
    assert out[:, :, 4:].abs().min(dim=-1).values.gt(0).all()


def test_axial_two_layers_reach_every_earlier_position_with_the_row_above_only():
    """Ho et al.: masked row + masked column attention reach, in two layers, only the earlier positions
    of columns up to the query's; with the outer decoder's row above (previous-row) every earlier one."""
    n = 24
    for axes, complete in ((("row", "column"), False), (("row", "column", "previous-row"), True)):
        seen = axial_pattern(list(axes), n, n, 4, True, torch.device("cpu")).any(0) & torch.ones(n, n, dtype=torch.bool).tril()
        two = (seen.float() @ seen.float()) > 0
        assert bool(two.equal(torch.ones(n, n, dtype=torch.bool).tril())) == complete


# ---------------------------------------------------------------------------------------------
# ETC


def etc_rules(r: int, K: int, causal: bool):
    """ETC's pieces and labels written pair by pair (the module docstring's list)."""
    def is_global(p):
        return p % K == K - 1

    def sees(head, p, j):
        if causal and j > p:
            return False
        return is_global(p) or is_global(j) or abs(p - j) <= r

    def label(p, j):
        own = p // K == j // K
        if is_global(p) and is_global(j):
            return 2 * r + 1 + max(-r, min(r, p // K - j // K)) + r  # g2g: chunk distance, clipped
        if is_global(p):
            return 4 * r + 4 + (0 if own else 1)  # g2l
        if is_global(j):
            return 4 * r + 2 + (0 if own else 1)  # l2g
        return p - j + r  # l2l

    return sees, label


def test_etc_labels_and_pattern_follow_the_rules():
    r, K = 2, 4
    sees, label = etc_rules(r, K, causal=True)
    p, j = torch.arange(17)[:, None], torch.arange(17)[None, :]
    labels, pattern = etc_labels(p, j, radius=r, chunk=K, causal=True)
    for a in range(17):
        for b in range(17):
            assert bool(pattern[a, b]) == sees(0, a, b)
            if pattern[a, b]:
                assert int(labels[a, b]) == label(a, b), (a, b)
    assert int(labels.max()) < 4 * r + 6  # the table's size


@pytest.mark.parametrize(("causal", "n", "i"), [(True, 23, 23), (True, 31, 17), (True, 9, 1), (False, 22, 22)])
@pytest.mark.parametrize("kernel", [ETCAttention, ETCReference])
def test_etc_equals_its_pair_by_pair_definition(causal, n, i, kernel):
    r, K = 2, 4
    attention = kernel(config("etc", causal=causal, radius=r, chunk=K))
    q, k, v = qkv(n, i)
    sees, label = etc_rules(r, K, causal)
    table = attention.rel_keys.detach().double()
    expected = loop_attention(q, k, v, sees,
                              lambda h, p, j: (q[:, h, p - (n - i)].double() * table[label(p, j)]).sum(-1) / 8**0.5)
    torch.testing.assert_close(attend(attention, q, k, v, AttentionMask(causal=causal)).double(), expected,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("causal", "n", "i"), [(True, 26, 26), (True, 30, 11), (False, 21, 21)])
def test_etc_fast_equals_eager_with_gradients_and_padding(causal, n, i):
    cfg = config("etc", causal=causal, radius=3, chunk=5)
    fast, eager = ETCAttention(cfg), ETCReference(cfg)
    eager.load_state_dict(fast.state_dict())
    padding = torch.ones(2, n, dtype=torch.bool)
    padding[1, :4] = False
    mask = AttentionMask(causal=causal, key_padding=padding)
    outs, grads = [], []
    for kernel in (fast, eager):
        q, k, v = qkv(n, i, grad=True)
        out = attend(kernel, q, k, v, mask)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append(out)
        grads.append((q.grad, k.grad, v.grad, kernel.rel_keys.grad))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_etc_global_rows_are_full_attention_when_the_table_is_zero():
    cfg = config("etc", radius=1, chunk=4)
    attention = ETCAttention(cfg)
    with torch.no_grad():
        attention.rel_keys.zero_()
    q, k, v = qkv(16, 16)
    full = loop_attention(q, k, v, lambda h, p, j: j <= p, lambda *_: 0.0)
    out = attend(attention, q, k, v).double()
    rows = [3, 7, 11, 15]  # the chunks' last positions: global queries
    torch.testing.assert_close(out[:, :, rows], full[:, :, rows], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out[:, :, 5], full[:, :, 5])  # a long query does not see everything


# ---------------------------------------------------------------------------------------------
# both, in a model with small options


@pytest.mark.parametrize("name", ["axial", "etc"])
@pytest.mark.parametrize("impl", ["eager", "fast"])
def test_small_kernels_are_causal_and_segment_invariant_with_memory(name, impl):
    model = build(TransformerXLConfig(**{**config(name).to_dict(), "attention_impl": impl}))
    x = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(x, mem_len=0).logits
        for t in (5, 13, 19):
            y = x.clone()
            y[:, t:] = (y[:, t:] * 7 + 3) % 61
            changed = model(y, mem_len=0).logits
            torch.testing.assert_close(changed[:, :t], base[:, :t], atol=1e-5, rtol=1e-5)
            assert not torch.allclose(changed[:, t], base[:, t])
        full = model(x, mem_len=24).logits
        memory, pieces = None, []
        for part in x.split([7, 8, 9], dim=1):  # segments that cross rows and chunks
            out = model(part, memory=memory, mem_len=24)
            memory = out.memory
            pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["axial", "etc"])
def test_small_kernels_generate_with_memory_as_a_rerun_does(name):
    from txl.generate.decoder import generate_rerun, stream_tokens

    model = build(config(name))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    prompt = [1, 2, 3, 4, 5]
    assert list(stream_tokens(model, prompt, max_new_tokens=12, temperature=0)) == \
        list(generate_rerun(model, prompt, max_new_tokens=12))


@pytest.mark.parametrize("name", ["axial", "etc"])
@pytest.mark.parametrize("causal", [True, False])
def test_small_kernels_pad_exactly(name, causal):
    cfg = config(name, causal=causal, **({"axes": ["row", "column"]} if name == "axial" and not causal else {}))
    model = build(cfg)
    sequences = [torch.randint(1, 61, (n,), generator=torch.Generator().manual_seed(n)) for n in (11, 6, 9)]
    ids = torch.zeros(3, 11, dtype=torch.long)
    attention_mask = torch.zeros(3, 11, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = seq
        attention_mask[row, : len(seq)] = 1
    with torch.no_grad():
        batch = model(ids, attention_mask=attention_mask, mem_len=0).logits
        for row, seq in enumerate(sequences):
            torch.testing.assert_close(batch[row, : len(seq)], model(seq[None], mem_len=0).logits[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["axial", "etc"])
def test_small_kernels_train_three_steps(name):
    model = build(TransformerXLConfig(**{**config(name).to_dict(), "dropout": 0.1, "dropatt": 0.1})).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    x = torch.randint(0, 61, (4, 16), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        out = model(x[:, :-1], labels=x[:, 1:], mem_len=0)
        out.loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        optimizer.step()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0]
    if name == "etc":  # the relative-position table learns
        assert all(block.attn.kernel.rel_keys.grad.abs().sum() > 0 for block in model.blocks)


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(attention="axial", attention_options=dict(row=0)), "config.attention_options.row must be >= 1"),
    (dict(attention="axial", attention_options=dict(axes=["diagonal"])), "config.attention_options.axes takes"),
    (dict(attention="axial", attention_options=dict(axes=[])), "config.attention_options.axes needs at least one"),
    (dict(attention="axial", causal=False, mem_len=0), "axes 'previous-row' is the causal grid's past row"),
    (dict(attention="axial", n_head=2, d_head=16), "needs n_head >= 3"),
    (dict(attention="axial", same_length=True), None),
    (dict(attention="etc", attention_options=dict(chunk=1)), "config.attention_options.chunk must be >= 2"),
    (dict(attention="etc", attention_options=dict(radius=-1)), "config.attention_options.radius must be >= 0"),
    (dict(attention="etc", pos_encoding="xl"), "config.pos_encoding=.xl. adds a term"),
])
def test_bad_options_are_refused_by_name(overrides, message):
    options = {"attention_options": dict(row=4, axes=["row", "column", "previous-row"])} if overrides["attention"] == "axial" else {}
    if message is None:  # same_length: refused when the kernel runs (one line naming it)
        from txl import UsageError

        model = build(TransformerXLConfig(**{**BASE, **options, **overrides}))
        with pytest.raises(UsageError, match="same_length is not available with attention='axial'"):
            model(torch.randint(0, 61, (1, 6)))
        return
    with pytest.raises(ConfigError, match=message):
        TransformerXLConfig(**{**BASE, **options, **overrides})


@pytest.mark.parametrize("sets", [
    ["model.attention=axial", "model.attention_options.row=4", 'model.attention_options.axes=["row", "column", "previous-row"]'],
    ["model.attention=etc", "model.attention_options.radius=2", "model.attention_options.chunk=4"],
])
def test_txl_train_runs_three_steps(tmp_path, sets):
    import json

    from txl.cli.main import main

    text = tmp_path / "plain.txt"
    text.write_text("rows and columns of the grid, chunks and their global tokens\n" * 40)
    small = ["model.n_layer=2", "model.d_model=32", "model.n_head=4", "model.d_head=8", "model.d_inner=64",
             "model.mem_len=16", "model.pos_encoding=rope", "tgt_len=16", "eval_tgt_len=16", "batch_size=4",
             "eval_batch_size=2", "eval_max_tokens=300", "max_steps=3", "eval_interval=3", "log_interval=1",
             "max_minutes=0", "sample_tokens=0", "warmup_steps=0", *sets]
    run = tmp_path / "run"
    argv = ["train", "--preset", "tiny", "--data", f"text:{text}", "--out", str(run), "--threads", "1", "--quiet"]
    assert main([*argv, *[arg for s in small for arg in ("--set", s)]]) == 0
    assert json.loads((run / "result.json").read_text())["steps"] == 3


@pytest.mark.parametrize("pos", ["xl", "shaw", "alibi", "t5", "rope"])
@pytest.mark.parametrize("row", [1, 3, 5, 12, 40])  # 2c > n and c > n take the term from the full matrix
@pytest.mark.parametrize(("causal", "n", "i"), [(True, 23, 23), (True, 31, 17), (True, 9, 1), (False, 22, 22)])
def test_axial_takes_every_encodings_score_term_as_its_dense_reference(pos, row, causal, n, i):
    if not causal and pos in ("xl", "alibi"):
        pytest.skip(f"{pos} is defined for causal distances only")
    axes = ["row", "column", "previous-row"] if causal else ["row", "column"]
    cfg = TransformerXLConfig(**{**BASE, **({} if causal else dict(causal=False, mem_len=0)), "pos_encoding": pos,
                                 "attention": "axial", "attention_options": dict(row=row, axes=axes)})
    model = build(cfg)
    positions = model.pos.layer(1, model.pos.prepare(k_len=n, clamp_len=0, device=torch.device("cpu"),
                                                     dtype=torch.float32))
    mask = AttentionMask(causal=causal)
    outs, grads = [], []
    for kernel in (AxialAttention(cfg), AxialReference(cfg)):
        q, k, v = qkv(n, i, grad=True)
        out = kernel(q, k, v, positions=positions, mask=mask, dropatt=0.0, training=False)[0]
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append(out)
        grads.append((q.grad, k.grad, v.grad))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_axial_refuses_value_terms():
    with pytest.raises(ConfigError, match="adds a value term over every key"):
        TransformerXLConfig(**{**BASE, "pos_encoding": "shaw", "position_options": {"values": True},
                               "attention": "axial", "attention_options": SMALL["axial"]})


@pytest.mark.parametrize("pos", ["xl", "alibi", "t5"])
def test_axial_with_score_terms_is_segment_invariant_with_memory_and_generates(pos):
    """Transformer-XL's own positions on the grid: one long pass = segments with memory; decoding with
    memory picks what re-running the context picks."""
    from txl.generate.decoder import generate_rerun, stream_tokens

    model = build(TransformerXLConfig(**{**config("axial").to_dict(), "pos_encoding": pos}))
    x = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x, mem_len=24).logits
        memory, pieces = None, []
        for part in x.split([7, 8, 9], dim=1):
            out = model(part, memory=memory, mem_len=24)
            memory = out.memory
            pieces.append(out.logits)
        torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    assert list(stream_tokens(model, [1, 2, 3, 4, 5], max_new_tokens=12, temperature=0)) == \
        list(generate_rerun(model, [1, 2, 3, 4, 5], max_new_tokens=12))
