"""A kernel with an option, defined in this file alone, works by name (issue 44, item 1): its options
dataclass is registered with it, the config takes them as `attention_options`, refuses them for another
kernel, and a model with it trains with memory, saves and loads."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from txl import ConfigError, TransformerXLConfig, build_model, load_model
from txl.nn.attention import registry
from txl.nn.attention.eager import eager_attention
from txl.nn.options import Options

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "test-local-window"


@dataclass(frozen=True)
class LocalWindowOptions(Options):
    window: int = 4  # keys each query sees: itself and the window - 1 before it

    def validate(self) -> None:
        self.at_least(1, "window")


class LocalWindow(torch.nn.Module):
    """Causal attention over the `window` most recent keys: the eager reference with a windowed mask."""

    def __init__(self, config):
        super().__init__()
        self.window = config.attention_options.window

    def forward(self, q, k, v, *, positions, mask, dropatt, training, need_weights=False):
        window = self.window if mask.window is None else min(self.window, mask.window)
        return eager_attention(q, k, v, positions=positions, mask=dataclasses.replace(mask, window=window),
                               dropatt=dropatt, training=training, need_weights=need_weights)


@pytest.fixture
def local_window():
    """Register the kernel for one test (and leave the registry as it was)."""
    registry.load_builtin_kernels()
    registry.register(NAME, "eager", options=LocalWindowOptions)(LocalWindow)
    yield
    registry.KERNELS.pop((NAME, "eager"))
    registry.SPECS.pop(NAME)


def config(**overrides) -> TransformerXLConfig:
    base = dict(vocab_size=31, n_layer=2, d_model=32, n_head=4, d_head=8, d_inner=48, mem_len=6, dropout=0.0,
                attention=NAME, attention_options={"window": 3})
    return TransformerXLConfig(**{**base, **overrides})


def test_a_kernel_with_an_option_from_a_test_file_trains_three_steps_with_memory(local_window, tmp_path):
    torch.manual_seed(0)
    model = build_model(config())
    assert model.config.attention_options == LocalWindowOptions(window=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 31, (2, 3 * 8 + 1), generator=torch.Generator().manual_seed(1))
    memory, losses = None, []
    for step in range(3):
        segment = data[:, step * 8:(step + 1) * 8 + 1]
        out = model(segment[:, :-1], labels=segment[:, 1:], memory=memory)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        memory, _ = out.memory, losses.append(out.loss.item())
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert memory is not None
    model.save_pretrained(tmp_path / "m")  # config.json holds {"window": 3}; loading finds the kernel by name
    loaded = load_model(tmp_path / "m")
    assert loaded.config == model.config
    x = data[:, :8]
    torch.testing.assert_close(loaded(x).logits, model.eval()(x).logits)


def test_its_window_is_applied_and_a_wide_one_is_full_attention(local_window):
    torch.manual_seed(0)
    wide = build_model(config(attention_options={"window": 64})).eval()
    full = build_model(config(attention="full", attention_options=None)).eval()
    full.load_state_dict(wide.state_dict())
    narrow = build_model(config(attention_options={"window": 2})).eval()
    narrow.load_state_dict(wide.state_dict())
    x = torch.randint(0, 31, (2, 10))
    torch.testing.assert_close(wide(x).logits, full(x).logits)
    assert not torch.allclose(narrow(x).logits, full(x).logits, atol=1e-4)


def test_its_options_are_checked_by_name(local_window):
    with pytest.raises(ConfigError, match="config.attention_options.window must be >= 1, got 0"):
        config(attention_options={"window": 0})
    with pytest.raises(ConfigError, match="unknown option config.attention_options.windw; did you mean 'window'"):
        config(attention_options={"windw": 3})
    with pytest.raises(ConfigError, match=f"config.attention_options.global_tokens is an option of "
                                          f"attention='sliding', not of attention='{NAME}'"):
        config(attention_options={"window": 3, "global_tokens": 1})
    with pytest.raises(ConfigError, match=f"config.attention_options.window is an option of attention=.*'{NAME}', not of attention='full'"):
        config(attention="full")
    assert config().to_dict()["attention_options"] == {"window": 3}
