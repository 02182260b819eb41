"""The Universal Transformer (`universal = true`): one shared block for up to n_layer steps with ACT
halting (Dehghani et al. 2019; Graves 2016)."""

from __future__ import annotations

import math

import pytest
import torch

from tiny_models import build, two_segments_vs_one_pass
from txl import ConfigError
from txl.models.transformer_xl.model import TransformerXL
from txl.nn.positional import sinusoid_table

pytestmark = pytest.mark.usefixtures("one_thread")


def force_halting(model, logit: float) -> None:
    with torch.no_grad():
        model.universal.halt.weight.zero_()
        model.universal.halt.bias.fill_(logit)


@pytest.mark.parametrize("act_type", ["basic", "accumulated"])
@pytest.mark.parametrize("pos", ["xl", "rope"])
def test_universal_halting_at_one_step_equals_a_one_layer_model_with_the_same_weights(pos, act_type):
    """With universal_signals='after-first' (txl before issue 48) step 0 adds nothing, so a model halting
    after one step is a one-layer model; with either act_type the output is then that step's (o = 1·y_0)."""
    universal = build(universal=True, n_layer=4, pos_encoding=pos, universal_signals="after-first", act_type=act_type)
    force_halting(universal, 30.0)  # p = 1 at step 0: every position halts after one application
    one = build(n_layer=1, pos_encoding=pos, seed=5)
    state = {k: v for k, v in universal.state_dict().items() if not k.startswith("universal.")}
    state = {k: v for k, v in state.items() if k in one.state_dict()}  # xl: W_kR of step 0 only
    missing, _ = one.load_state_dict(state, strict=False)
    assert not missing
    x = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first_u, first_1 = universal(x[:, :8]), one(x[:, :8])
        torch.testing.assert_close(first_u.logits, first_1.logits, atol=1e-5, rtol=1e-5)
        second_u = universal(x[:, 8:], memory=first_u.memory)  # step 0 reads the memory of step 0
        second_1 = one(x[:, 8:], memory=first_1.memory)
        torch.testing.assert_close(second_u.logits, second_1.logits, atol=1e-5, rtol=1e-5)
    assert first_u.ponder_depth.item() == pytest.approx(2.0)  # N = 1 step + remainder R = 1


def test_universal_with_memory_is_segment_invariant_and_causal():
    model = build(universal=True, n_layer=3, pos_encoding="xl")
    assert two_segments_vs_one_pass(model) < 1e-5
    x = torch.randint(0, 61, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 61
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits[:, :8], model(y).logits[:, :8])


def test_act_weights_sum_to_one_and_ponder_counts_steps_plus_remainder():
    model = build(universal=True, n_layer=3, act_type="accumulated", universal_signals="after-first")
    block, depth = model.blocks[0], model.universal
    h = torch.randn(2, 5, 32)
    from txl.nn.attention.masks import CAUSAL

    def run():
        with torch.no_grad():
            return depth(block, h, memory=None, positions=lambda i: model.pos.layer(i, model.pos.prepare(
                k_len=5, clamp_len=0, device=h.device, dtype=h.dtype)), mask=CAUSAL)

    force_halting(model, -30.0)  # never halts on its own: all 3 steps, the last gets the remainder ≈ 1
    out, ponder, inputs, _ = run()
    assert len(inputs) == 3
    torch.testing.assert_close(ponder, torch.full((2, 5), 4.0))
    # The output is then the last step's output (weights p ≈ 0, 0, remainder ≈ 1).
    force_halting(model, 0.0)  # p = 1/2 each step: halts at step 1 (1/2 + 1/2 >= 0.99), remainder 1/2
    out, ponder, inputs, _ = run()
    torch.testing.assert_close(ponder, torch.full((2, 5), 2.5))
    positions = model.pos.layer(0, model.pos.prepare(k_len=5, clamp_len=0, device=h.device, dtype=h.dtype))
    with torch.no_grad():
        step0, _ = block(inputs[0], memory=None, positions=positions, mask=CAUSAL)
        block.attn.layer_idx = 1
        step1, _ = block(step0 + depth.step_signal(1, step0), memory=None,
                         positions=model.pos.layer(1, model.pos.prepare(k_len=5, clamp_len=0, device=h.device,
                                                                        dtype=h.dtype)), mask=CAUSAL)
        block.attn.layer_idx = 0
    torch.testing.assert_close(out, 0.5 * step0 + 0.5 * step1, atol=1e-5, rtol=1e-5)


def test_ponder_cost_joins_the_loss_in_training_only_and_trains_the_halting_unit():
    model = build(universal=True, n_layer=3, ponder_cost=0.1).train()
    x = torch.randint(0, 61, (2, 8))
    out = model(x, labels=x)
    torch.testing.assert_close(out.aux_loss, 0.1 * out.ponder_depth)
    (out.loss + out.aux_loss).backward()
    assert model.universal.halt.weight.grad.abs().sum() > 0
    assert len(model.blocks) == 1  # one shared block
    model.eval()
    assert model(x, labels=x).aux_loss is None


def test_universal_round_trips_through_save_pretrained(tmp_path):
    model = build(universal=True, n_layer=3)
    model.save_pretrained(tmp_path / "u")
    loaded = TransformerXL.from_pretrained(tmp_path / "u").eval()
    x = torch.randint(0, 61, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits)


@pytest.mark.parametrize(("overrides", "field"), [
    ({"act_threshold": 0.0}, "act_threshold"),
    ({"ponder_cost": -1.0}, "ponder_cost"),
    ({"cmem_len": 4}, "cmem_len"),
    ({"d_model": 33, "d_inner": 48}, "d_model"),
])
def test_universal_options_are_checked_by_name(overrides, field):
    with pytest.raises(ConfigError, match=f"config.{field}"):
        build(universal=True, **overrides)


# --- issue 48: tensor2tensor's act_type and step signals, the encoder-decoder ---------------------------------

def reference_act(block_fn, halt, h, *, depth, threshold, act_type, signals, pos_rows=None):
    """tensor2tensor's ACT loop written out position by position (universal_transformer_act_basic /
    _accumulated with step_preprocess), with txl's forced halt at the last step: the states x_t, y_t do not
    depend on halting (every step runs on every position), so they come first, then each position's weights."""
    d = h.shape[-1]
    xs, ys, state = [], [], h
    for t in range(depth):
        step = sinusoid_table(torch.tensor([t]), d)[0]
        if signals == "after-first" and t == 0:
            step = torch.zeros(d)
        x = state + step
        if signals == "every-step" and t > 0 and pos_rows is not None:
            x = x + pos_rows
        xs.append(x)
        state = block_fn(x, t)
        ys.append(state)
    out = torch.zeros_like(h)
    ponder = torch.zeros(h.shape[:2])
    for b in range(h.shape[0]):
        for i in range(h.shape[1]):
            total, o = 0.0, torch.zeros(d)
            for t in range(depth):
                p = float(torch.sigmoid(halt(xs[t][b, i]))[0])
                if t == depth - 1 or total + p >= threshold:
                    w = 1.0 - total
                    ponder[b, i] = t + 1 + w
                    o = w * ys[t][b, i] + (1 - w) * o if act_type == "basic" else o + w * ys[t][b, i]
                    break
                o = p * ys[t][b, i] + (1 - p) * o if act_type == "basic" else o + p * ys[t][b, i]
                total += p
            out[b, i] = o
    return out, ponder, xs


def spread_halting(model_act, seed=0, bias=-1.0):
    """Halting weights under which positions stop at different steps."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model_act.halt.weight.copy_(torch.randn(model_act.halt.weight.shape, generator=g) * 0.2)
        model_act.halt.bias.fill_(bias)


@pytest.mark.parametrize("signals", ["every-step", "after-first"])
@pytest.mark.parametrize("act_type", ["basic", "accumulated"])
@pytest.mark.parametrize("pos", ["sinusoidal", "xl", "learned"])
def test_universal_lm_equals_tensor2tensors_act_loop(pos, act_type, signals):
    """The decoder LM's universal stack against the written-out t2t loop: the state before each step (the
    hidden states), and the combined output (basic: o = w·y + (1-w)·o; accumulated: Σ w·y), 1e-5; with a
    halting bias at which the positions stop at different steps (so every weight matters)."""
    model = build(universal=True, n_layer=4, pos_encoding=pos, act_type=act_type, universal_signals=signals,
                  mem_len=0, act_threshold=0.9)
    x = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    block = model.blocks[0]
    from txl.nn.attention.masks import CAUSAL
    for bias in (-1.0, -2.0, -3.0):
        spread_halting(model.universal, bias=bias)
        with torch.no_grad():
            out = model(x, output_hidden_states=True)
            h0 = model.pos.embed(model._embed(x))
            state = model.pos.prepare(k_len=9, clamp_len=0, device=x.device, dtype=h0.dtype)
            rows = model.pos.position_table(h0, None) if pos != "xl" else None

            def block_fn(inp, t, state=state):
                block.attn.layer_idx = t
                try:
                    return block(inp, memory=None, positions=model.pos.layer(t, state), mask=CAUSAL)[0]
                finally:
                    block.attn.layer_idx = 0

            ref, ponder, xs = reference_act(block_fn, model.universal.halt, h0, depth=4, threshold=0.9,
                                            act_type=act_type, signals=signals, pos_rows=rows)
        for got, want in zip(out.hidden_states[:-1], xs):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.hidden_states[-1], ref, atol=1e-5, rtol=1e-5)
        assert out.ponder_depth.item() == pytest.approx(ponder.mean().item(), abs=1e-5)
        if len({int(n) for n in ponder.flatten().sub(1e-6).floor()}) > 1:  # N of each position (ρ = N + R)
            break
    else:
        pytest.fail("no halting bias made the positions stop at different steps")


def test_basic_and_accumulated_differ_and_step_zero_gets_the_timestep_signal():
    x = torch.randint(0, 61, (2, 8))
    outs = {}
    for act_type in ("basic", "accumulated"):
        model = build(universal=True, n_layer=3, act_type=act_type, mem_len=0)
        spread_halting(model.universal)
        with torch.no_grad():
            outs[act_type] = model(x, output_hidden_states=True)
    assert (outs["basic"].logits - outs["accumulated"].logits).abs().max() > 1e-3
    with torch.no_grad():
        h0 = model.pos.embed(model._embed(x))
    signal0 = sinusoid_table(torch.tensor([0]), 32)[0]  # sin(0) = 0 in the first half, cos(0) = 1 in the second
    torch.testing.assert_close(outs["accumulated"].hidden_states[0], h0 + signal0)


def test_every_step_universal_with_memory_is_segment_invariant():
    model = build(universal=True, n_layer=3, pos_encoding="xl", act_type="basic")
    spread_halting(model.universal)
    assert two_segments_vs_one_pass(model) < 1e-5


@pytest.mark.parametrize("merge", ["mul", "zero"])
def test_every_step_refuses_an_absolute_encoding_not_merged_by_addition(merge):
    with pytest.raises(ConfigError, match="universal_signals"):
        build(universal=True, pos_encoding="sinusoidal", position_options={"merge": merge}, mem_len=0)
    build(universal=True, pos_encoding="sinusoidal", position_options={"merge": merge}, mem_len=0,
          universal_signals="after-first")  # positions at the embedding only: nothing to re-add


def test_universal_position_ids_are_the_ones_re_added_at_every_step():
    model = build(universal=True, n_layer=3, pos_encoding="sinusoidal", mem_len=0)
    x = torch.randint(0, 61, (1, 6))
    from txl.nn.attention.masks import CAUSAL
    table = sinusoid_table(torch.arange(16), 32)
    for ids, rows in ((torch.arange(10, 16), table[10:16]), (None, table[:6])):
        with torch.no_grad():
            out = model(x, position_ids=ids, output_hidden_states=True)
            state = model.pos.prepare(k_len=6, clamp_len=0, device=x.device, dtype=torch.float32)
            y0, _ = model.blocks[0](out.hidden_states[0], memory=None, positions=model.pos.layer(0, state), mask=CAUSAL)
        # before step 1: y_0 + timestep(1) + the rows of the given positions (10..15, else 0..5)
        torch.testing.assert_close(out.hidden_states[1], y0 + sinusoid_table(torch.tensor([1]), 32)[0] + rows,
                                   atol=1e-5, rtol=1e-5)


def test_old_universal_configs_load_as_accumulated_after_first():
    import json
    from pathlib import Path

    from txl.models.registry import config_from_dict

    data = json.loads((Path(__file__).parent / "data" / "legacy" / "decoder-universal" / "config.json").read_text())
    old = config_from_dict(data)
    assert (old.act_type, old.universal_signals) == ("accumulated", "after-first")
    new = config_from_dict({"arch": "decoder", "universal": True, "n_layer": 3})  # a preset / --set: the defaults
    assert (new.act_type, new.universal_signals) == ("basic", "every-step")
    dumped = config_from_dict(old.to_dict())  # a config written since keeps what it says
    assert (dumped.act_type, dumped.universal_signals) == ("accumulated", "after-first")


# --- the Universal Transformer encoder-decoder ------------------------------------------------------------------

def enc_dec(seed=0, **overrides):
    from txl import EncoderDecoderConfig
    from txl.models.seq2seq import EncoderDecoder

    base = dict(vocab_size=23, n_layer=3, n_encoder_layer=4, d_model=32, n_head=4, d_head=8, d_inner=48,
                pos_encoding="sinusoidal", dropout=0.0, universal=True)
    torch.manual_seed(seed)
    model = EncoderDecoder(EncoderDecoderConfig(**{**base, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    if model.encoder_act is not None:
        spread_halting(model.encoder_act, 1)
        spread_halting(model.decoder_act, 2)
    return model


def test_universal_encoder_decoder_has_one_shared_block_per_stack_and_equals_the_act_loop():
    model = enc_dec(act_type="basic")
    assert len(model.encoder) == 1 and len(model.decoder) == 1
    assert model.encoder_act.max_depth == 4 and model.decoder_act.max_depth == 3
    src = torch.randint(3, 23, (2, 7))
    from txl.nn.attention.masks import AttentionMask
    with torch.no_grad():
        encoded = model.encode(src)
        h0 = model._embed(model.source_embedding, src, model.encoder_pos)
        state = model.encoder_pos.prepare(k_len=7, clamp_len=0, device=src.device, dtype=h0.dtype)
        block = model.encoder[0]
        ref, _, _ = reference_act(
            lambda inp, t: block(inp, memory=None, positions=model.encoder_pos.layer(t, state),
                                 mask=AttentionMask(causal=False))[0],
            model.encoder_act.halt, h0, depth=4, threshold=0.99, act_type="basic", signals="every-step",
            pos_rows=model.encoder_pos.position_table(h0, None))
    torch.testing.assert_close(encoded, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides", [dict(), dict(act_type="accumulated"), dict(pos_encoding="rope"),
                                       dict(pos_encoding="learned", pre_lnorm=True),
                                       dict(universal_signals="after-first")],
                         ids=["basic", "accumulated", "rope", "learned-preln", "after-first"])
def test_universal_encoder_decoder_cached_decoding_and_padding(overrides):
    from txl.generate.seq2seq import beam_search, greedy

    model = enc_dec(**overrides)
    sources = [[5, 6, 7, 8, 9, 10], [11, 12], [3, 4, 5, 6]]
    width = max(map(len, sources))
    src = torch.tensor([s + [0] * (width - len(s)) for s in sources])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sources])
    target = torch.tensor([[1, 4, 5, 6, 7], [1, 8, 9, 10, 11], [1, 3, 3, 4, 4]])
    with torch.no_grad():
        full = model(src, mask, target).logits
        cache, encoded = model.new_cache(), model.encode(src, mask)
        steps = [model(src, mask, target[:, t: t + 1], encoded=encoded, cache=cache).logits for t in range(5)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
        for i, s in enumerate(sources):  # a padded row = the pair alone
            alone = model(torch.tensor([s]), None, target[i: i + 1]).logits
            torch.testing.assert_close(full[i: i + 1], alone, atol=1e-5, rtol=0)
    cached = greedy(model, src, mask, bos=1, eos=2, max_len=10, use_cache=True)
    assert cached.tokens == greedy(model, src, mask, bos=1, eos=2, max_len=10, use_cache=False).tokens
    beams = [beam_search(model, src, mask, bos=1, eos=2, max_len=10, beam_size=3, use_cache=f) for f in (True, False)]
    assert beams[0].tokens == beams[1].tokens


def test_universal_encoder_decoder_ponder_cost_trains_both_halting_units_and_round_trips(tmp_path):
    from txl.models.seq2seq import EncoderDecoder

    model = enc_dec(ponder_cost=0.1).train()
    src, dec = torch.randint(3, 23, (2, 6)), torch.randint(3, 23, (2, 5))
    out = model(src, None, dec, dec)
    torch.testing.assert_close(out.aux_loss, 0.1 * (out.ponder_depth + out.encoder_ponder_depth))
    torch.testing.assert_close(out.loss, out.nll.sum() / dec.numel() + out.aux_loss)
    out.loss.backward()
    assert model.encoder_act.halt.weight.grad.abs().sum() > 0
    assert model.decoder_act.halt.weight.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        evaluated = model(src, None, dec, dec)
    assert evaluated.aux_loss is None and 1.0 < float(evaluated.ponder_depth) <= 4.0
    blocks = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("encoder.", "decoder.")))
    assert model.config.num_parameters_estimate() <= blocks  # a lower bound: one block per stack
    model.save_pretrained(tmp_path / "ut")
    loaded = EncoderDecoder.from_pretrained(tmp_path / "ut").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(src, None, dec).logits, model(src, None, dec).logits)


def test_universal_encoder_decoder_three_training_steps():
    model = enc_dec().train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    src = torch.randint(3, 23, (8, 6))
    dec = torch.cat([torch.ones(8, 1, dtype=torch.long), src.flip(1)[:, :-1]], dim=1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        out = model(src, None, dec, src.flip(1))
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss.detach()))
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


# Every field of the decoder's config: the encoder-decoder either honours it (a probe of what it changes) or
# refuses it in one line naming it. Before issue 48 `universal` was refused (the issue: "silently ignored");
# the block options (norm, ffn, n_kv_head, qk_norm) and the ACT settings are honoured now.
HONOURED = {  # field -> (base overrides, the value that must change something, what changes: probe)
    "vocab_size": ({}, 29, "structure"),
    "n_layer": ({}, 2, "structure"),
    "d_model": ({}, 48, "structure"),
    "n_head": ({}, 2, "structure"),
    "d_head": ({}, 4, "structure"),
    "d_inner": ({}, 40, "structure"),
    "dropout": ({}, 0.3, "train"),
    "dropatt": ({}, 0.3, "train"),
    "pre_lnorm": ({}, True, "logits"),
    "final_norm": ({"pre_lnorm": True}, False, "structure"),
    "pos_encoding": ({}, "rope", "logits"),
    "position_options": ({"pos_encoding": "t5"}, {"buckets": 4}, "structure"),
    "attention": ({}, "linear", "logits"),
    "attention_options": ({"attention": "linear"}, {"feature": "relu"}, "logits"),
    "attention_impl": ({}, "eager", "impl"),
    "backend": ({}, "reference", "backend"),
    "norm": ({}, "rmsnorm", "structure"),
    "ffn": ({}, "swiglu", "structure"),
    "n_kv_head": ({}, 2, "structure"),
    "qk_norm": ({}, True, "structure"),
    "universal": ({}, True, "structure"),
    "act_threshold": ({"universal": True}, 0.5, "logits"),
    "ponder_cost": ({"universal": True}, 0.5, "train"),
    "act_type": ({"universal": True}, "accumulated", "logits"),
    "universal_signals": ({"universal": True}, "after-first", "logits"),
    "tie_weight": ({}, False, "structure"),
    "init_std": ({"pos_encoding": "learned"}, 0.5, "init"),
    "layer_norm_eps": ({}, 10.0, "logits"),
    # its own fields
    "n_encoder_layer": ({}, 2, "structure"),
    "source_vocab_size": ({"share_embeddings": False}, 31, "structure"),
    "share_embeddings": ({}, False, "structure"),
}


def test_the_audit_covers_every_field_of_the_decoder_config():
    import dataclasses

    from txl import EncoderDecoderConfig, TransformerXLConfig

    decoder_fields = {f.name for f in dataclasses.fields(TransformerXLConfig)} - {"arch"}
    own = {f.name for f in dataclasses.fields(EncoderDecoderConfig)} - {"arch"}
    assert set(HONOURED) == own
    assert set(REFUSED) == decoder_fields - own


def probe(model, kind):
    torch.manual_seed(11)
    src, dec = torch.randint(3, 23, (2, 6)), torch.randint(3, 23, (2, 5))
    if kind == "structure":
        return {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if kind == "impl":  # the kernel each attention layer was built with
        return [getattr(m.kernel, "__qualname__", type(m.kernel).__qualname__) for m in model.modules()
                if hasattr(m, "kernel")]
    if kind == "backend":
        return {type(m).__module__ for m in model.modules()}
    if kind == "init":
        return [float(p.detach().std()) for n, p in model.named_parameters() if n.startswith("encoder_pos.")]
    if kind == "train":
        model.train()
        torch.manual_seed(5)
        return model(src, None, dec, dec).loss.detach()
    with torch.no_grad():
        return model(src, None, dec).logits


@pytest.mark.parametrize("field", sorted(HONOURED))
def test_encoder_decoder_honours(field):
    base, value, kind = HONOURED[field]
    models = [enc_dec(universal=False, **{**base}) if "universal" not in base else enc_dec(**base),
              enc_dec(**{"universal": False, **base, field: value})]
    a, b = probe(models[0], kind), probe(models[1], kind)
    if isinstance(a, torch.Tensor) and a.shape == b.shape:
        assert (a - b).abs().max() > 1e-4, field
    else:
        assert a != b, field


REFUSED = {
    "d_embed": 16, "dropout_embed": 0.1, "dropout_input": 0.1, "mem_len": 8, "clamp_len": 4, "same_length": True,
    "untie_r": True, "causal": False, "memory_source": "same-layer", "residual": "gru-gate", "num_labels": 2,
    "classifier_pooling": "last", "classifier_segments": "first", "memory_tokens": 2, "cmem_len": 4,
    "cmem_ratio": 2, "cmem_fn": "mean", "reversible": True, "cutoffs": [10], "div_val": 2, "tie_projs": [False],
    "sample_softmax": 8, "proj_init_std": 0.1,
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_encoder_decoder_refuses_in_one_line(field):
    from txl.models.registry import config_from_dict

    with pytest.raises(ConfigError, match=f"config.{field}") as error:
        config_from_dict({"arch": "encoder-decoder", field: REFUSED[field]})
    assert "\n" not in str(error.value)


def test_txl_train_eval_generate_the_universal_encoder_decoder_preset(tmp_path, capsys):
    """`txl train --preset seq2seq-reverse-universal` for three steps on a small pair corpus, then `txl eval`
    (teacher-forced and decoded, beam 2) and `txl generate --input`: the UT encoder-decoder loads back as one."""
    import json

    from txl.cli.main import main
    from txl.models.registry import load_model

    run = tmp_path / "run"
    assert main(["train", "--preset", "seq2seq-reverse-universal", "--data", "reverse?size=100&max_len=6",
                 "--out", str(run), "--threads", "1", "--set", "batch_size=8", "--set", "eval_batch_size=8",
                 "--set", "log_interval=1", "--set", "max_minutes=0", "--set", "warmup_steps=1",
                 "--set", "beam_size=2", "--set", "max_steps=3", "--set", "eval_interval=3",
                 "--set", "final_max_tokens=40", "--quiet"]) == 0
    result = json.loads((run / "result.json").read_text())
    assert result["steps"] == 3
    model = load_model(run)
    assert model.config.universal and model.decoder_act is not None and len(model.encoder) == 1
    capsys.readouterr()
    assert main(["eval", str(run), "--split", "test", "--max-pairs", "10", "--beam-size", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pairs"] == 10 and 0 <= report["token_accuracy"] <= 1
    (tmp_path / "in.txt").write_text("abc\nxyz\n")
    assert main(["generate", str(run), "--input", str(tmp_path / "in.txt"), "--max-new-tokens", "8"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
