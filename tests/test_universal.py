"""The Universal Transformer (`universal = true`): one shared block for up to n_layer steps with ACT
halting (Dehghani et al. 2019; Graves 2016)."""

from __future__ import annotations

import pytest
import torch

from tiny_models import build, two_segments_vs_one_pass
from txl import ConfigError
from txl.models.transformer_xl.model import TransformerXL

pytestmark = pytest.mark.usefixtures("one_thread")


def force_halting(model, logit: float) -> None:
    with torch.no_grad():
        model.universal.halt.weight.zero_()
        model.universal.halt.bias.fill_(logit)


@pytest.mark.parametrize("pos", ["xl", "rope"])
def test_universal_halting_at_one_step_equals_a_one_layer_model_with_the_same_weights(pos):
    universal = build(universal=True, n_layer=4, pos_encoding=pos)
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
    model = build(universal=True, n_layer=3)
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
