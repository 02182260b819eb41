"""`train.compile = true` is a supported option (issue 46, item 5): the trainer's torch.compile'd model
trains like the uncompiled one, step for step, on both backends.

Three optimizer steps of the tiny run (tgt_len 16, mem_len 16: steps 2 and 3 attend to the memory of the
step before), dropout 0 (a compiled graph draws its own random numbers), one thread; the whole training
command, in process, twice: `train.compile=false`, then `true`.

Tolerances. inductor fuses the forward and backward into its own kernels, so fp32 sums (softmax, layer
norm, the loss's mean) are taken in another order: the same arithmetic up to rounding, not bit for bit.
Losses within 1e-6 (a few ulps of a loss of ~5.5; measured 7.5e-9). Weights within 1e-5 after three
Adam steps: Adam divides each gradient by its own running magnitude, so a component that is ~0 and
rounded differently can move by up to lr (2e-3) instead of not at all; measured 9.7e-7.

Graph breaks: none, on either backend (counted by dynamo). The fast backend (backend "auto") takes its
traceable forms inside a compiled graph (`torch.compiler.is_compiling()`): F.linear instead of the
oneDNN linear and its hand-written backward (inductor cannot lower `mkldnn._linear_pointwise` in a
training graph), torch's dropout, no projection cache or memoised position tables; so the compiled fast
and reference backends run the same graph.

Slow tier: compiling takes 20-60 s on one core, and inductor may start its compile workers.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import TOML, cache_dir, make_corpus  # noqa: F401 (cache_dir: the autouse prepared-corpus cache)
from txl.cli.main import main
from txl.models.pretrained import load_tensors

LOSS_TOLERANCE = 1e-6
WEIGHT_TOLERANCE = 1e-5


def train(root, config, *, compile: bool) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    """(train losses per step, final weights, dynamo's graph breaks) of a 3-step run."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    out = root / f"run-compile-{compile}"
    code = main(["train", "--config", str(config), "--out", str(out), "--quiet", "--threads", "1",
                 "--set", f"train.compile={str(compile).lower()}"])
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r.get("split") == "train"]
    breaks = dict(counters["graph_break"])
    return losses, load_tensors(out / "last" / "model.safetensors")[0], breaks


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_compiled_training_equals_the_uncompiled_model_for_three_steps(backend, tmp_path):
    corpus = make_corpus(tmp_path / "corpus.txt", lines=800)
    toml = TOML.format(corpus=corpus, steps=3, dropout=0.0, varlen="false", eval_interval=1000)
    toml = toml.replace("[train]", f'backend = "{backend}"\n\n[train]')
    config = tmp_path / "run.toml"
    config.write_text(toml)

    eager_losses, eager_weights, _ = train(tmp_path, config, compile=False)
    losses, weights, breaks = train(tmp_path, config, compile=True)

    assert json.loads((tmp_path / "run-compile-True" / "run.json").read_text())["model"]["backend"] == backend
    assert len(losses) == len(eager_losses) == 3
    for step, (got, want) in enumerate(zip(losses, eager_losses, strict=True), 1):
        assert abs(got - want) <= LOSS_TOLERANCE, (step, got, want)
    assert eager_weights.keys() == weights.keys()
    for name, want in eager_weights.items():
        torch.testing.assert_close(weights[name], want, atol=WEIGHT_TOLERANCE, rtol=0, msg=name)
    assert breaks == {}, breaks  # one graph per compiled call: nothing falls back to Python
