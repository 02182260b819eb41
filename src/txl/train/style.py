"""The Style Transformer's training (Dai et al. 2019) as a `txl train` objective: a `style:` corpus trains
`arch = "style-transformer"` (`txl.models.style`).

The schedule is the reference implementation's (fastnlp/style-transformer `train.py`): `pretrain_steps` steps
of f on self-reconstruction alone, then rounds of `discriminator_steps` steps of d followed by
`generator_steps` steps of f. Each trainer step is one of them, on its own batch (half of each style, as
the reference concatenates a batch of each):

- a step of d: f (in eval mode, without gradients) rewrites the batch softly into its own style (x -> f(x, s))
  and into the other (x -> f(x, s')); d learns real sentences against those rewrites (`multi`: the real
  sentence and f(x, s) are of their style, f(x, s') is "generated"; `conditional`: (x, s) and (f(x, s), s)
  are real, (x, s') and (f(x, s'), s') are not). Loss: the summed NLL over the rows / batch size.
- a step of f (d in eval mode, its parameters untouched): self_factor · L_self + cycle_factor · L_cyc +
  adversarial_factor · L_adv, each summed over a sentence's tokens and averaged over the batch (the
  reference's scale), with soft decoding (`temperature`) for f(x, s').

One optimiser holds both networks; a step fills only its own network's gradients and leaves the other's
None, which Adam and the gradient clipping skip, so each network is updated and clipped (train.clip, the
reference's 5) exactly as with two optimisers. The records' loss is the self-reconstruction NLL per token of
f's steps (d's steps score nothing there); validation scores the same on the valid split.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from txl.errors import ConfigError
from txl.eval.precision import autocast
from txl.eval.result import EvalResult


def phase(index: int, config) -> str:
    """Which network batch `index` of a run trains: "pretrain" (f, self-reconstruction only), "d" or "f"."""
    if index < config.pretrain_steps:
        return "pretrain"
    k = (index - config.pretrain_steps) % (config.discriminator_steps + config.generator_steps)
    return "d" if k < config.discriminator_steps else "f"


def word_drop(tokens: torch.Tensor, lengths: torch.Tensor, p: float, *, eos_id: int, pad_id: int):
    """The self-reconstruction's noisy input: each word (not <eos>) dropped with probability p, the rest
    moved left (the reference's `word_drop`). Returns (tokens, lengths)."""
    if p <= 0:
        return tokens, lengths
    keep = (torch.rand(tokens.shape, device=tokens.device) >= p) | (tokens == eos_id)
    keep &= torch.arange(tokens.shape[1], device=tokens.device)[None] < lengths[:, None]
    rows = [row[k] for row, k in zip(tokens, keep)]
    width = max(len(r) for r in rows)
    out = torch.full((tokens.shape[0], width), pad_id, dtype=tokens.dtype, device=tokens.device)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out, torch.tensor([len(r) for r in rows], device=tokens.device)


def token_nll(log_probs: torch.Tensor, targets: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(b, t, V), (b, t) -> (b,) NLL summed over each row's real target tokens."""
    nll = F.nll_loss(log_probs.transpose(1, 2), targets, reduction="none")
    return (nll * (targets != pad_id)).sum(dim=1)


class StyleTransfer:
    """`txl train` on a `style:` corpus: the Style Transformer's alternating updates (module docstring). The
    trainer's objective contract (`txl.train.objectives`), without memory."""

    name = "style"
    writes_sample = False  # the end of the run transfers valid sentences instead (final_extras)

    def __init__(self, cfg, corpus, dist, *, vocab_size: int, precision: str, scaler, ddp):
        self.cfg, self.corpus, self.dist = cfg, corpus, dist
        self.vocab_size, self.precision, self.scaler, self.ddp = vocab_size, precision, scaler, ddp
        self.memories = [None]  # nothing carried between steps (the checkpoint's memory component reads it)
        self.ponder_depth = None
        if dist.world > 1:
            raise ConfigError("a style-transfer run trains in one process (its steps alternate two networks "
                              "outside DDP); drop --nproc")
        if cfg.grad_accum != 1:
            raise ConfigError("train.grad_accum must be 1 for a style-transfer run (a step is one batch of one "
                              "network)")
        self.model = getattr(self.ddp, "module", self.ddp)
        self.last_losses: dict[str, float] = {}

    @staticmethod
    def open_corpus(spec: str, *, vocab=None):
        from txl.data.style import open_style_corpus

        return open_style_corpus(spec, vocab=vocab)

    @staticmethod
    def model_config(config, corpus, data: str):
        if config.arch != "style-transformer":
            raise ConfigError(f"{data} is a style corpus: it trains model.arch='style-transformer' (e.g. --preset "
                              f"style-transfer), not {config.arch!r}")
        from txl.data.style import BOS_ID, EOS_ID, PAD_ID

        return config.replace(n_styles=len(corpus.styles), style_names=tuple(corpus.styles), pad_id=PAD_ID,
                              bos_id=BOS_ID, eos_id=EOS_ID, max_length=corpus.max_len + 1)

    def batches(self):
        from txl.data.style import StyleBatches

        return StyleBatches(self.corpus, batch_size=self.cfg.batch_size, seed=self.cfg.seed)

    def forget(self) -> None:
        pass  # no memory

    def check_batch(self, batch) -> None:
        pass  # sentences are encoded in memory by this run's own vocabulary

    def tokens(self, batch, scored: int) -> int:
        return int(batch.lengths.sum())

    # -- one step ----------------------------------------------------------------------------------
    def step(self, forward: Callable, batch) -> tuple[float, int]:
        model, config, device = self.model, self.model.config, self.dist.device
        tokens, lengths, styles = (t.to(device) for t in (batch.tokens, batch.lengths, batch.styles))
        which = phase(batch.index, config)
        with autocast(device, self.precision):
            if which == "d":
                loss = self._discriminator_loss(tokens, lengths, styles)
                self.scaler.scale(loss).backward()
                self.last_losses = {"d": float(loss.detach())}
                return 0.0 * float(loss.detach()), 0  # nothing scored in the records (a NaN still reads as NaN)
            nll, count, loss = self._generator_loss(tokens, lengths, styles, cycle=which == "f")
            self.scaler.scale(loss).backward()
        for p in model.discriminator.parameters():  # d is only read in f's step
            p.grad = None
        return nll + 0.0 * float(loss.detach()), count

    def _rewrite(self, tokens, lengths, styles):
        """f(x, styles) decoded softly: (distributions (b, L, V), lengths up to the first argmax <eos>)."""
        from txl.models.style.model import lengths_from_tokens

        model, config = self.model, self.model.config
        log_probs = model.decode_free(tokens, lengths, styles, soft=True, temperature=config.temperature)
        probs = log_probs.exp()
        return probs, lengths_from_tokens(probs.argmax(-1), config.eos_id).detach()

    def _discriminator_loss(self, tokens, lengths, styles):
        model, config = self.model, self.model.config
        other = self.other_styles(styles)
        model.generator.eval()
        with torch.no_grad():
            own_soft, own_len = self._rewrite(tokens, lengths, styles)
            other_soft, other_len = self._rewrite(tokens, lengths, other)
        model.generator.train()
        d = model.discriminator
        if config.discriminator == "multi":
            log_probs = torch.cat([d(tokens, lengths), d(own_soft, own_len), d(other_soft, other_len)])
            labels = torch.cat([styles + 1, styles + 1, torch.zeros_like(styles)])
        else:
            log_probs = torch.cat([d(tokens, lengths, styles), d(tokens, lengths, other),
                                   d(own_soft, own_len, styles), d(other_soft, other_len, other)])
            one, zero = torch.ones_like(styles), torch.zeros_like(styles)
            labels = torch.cat([one, zero, one, zero])
        return F.nll_loss(log_probs, labels, reduction="sum") / tokens.shape[0]

    def _generator_loss(self, tokens, lengths, styles, *, cycle: bool):
        """(self-reconstruction NLL summed over tokens, their count, the loss to minimise)."""
        model, config = self.model, self.model.config
        batch = tokens.shape[0]
        noisy, noisy_len = word_drop(tokens, lengths, config.word_drop, eos_id=config.eos_id, pad_id=config.pad_id)
        self_nll = token_nll(model.reconstruct(noisy, noisy_len, styles, tokens, temperature=config.temperature),
                             tokens, config.pad_id)  # the reference's temperature reaches every pass of f
        loss = config.self_factor * self_nll.sum() / batch
        losses = {"self": float(self_nll.detach().sum()) / batch}
        if cycle:
            other = self.other_styles(styles)
            d = model.discriminator
            d.eval()
            soft, soft_len = self._rewrite(tokens, lengths, other)
            cycle_nll = token_nll(model.reconstruct(soft, soft_len, styles, tokens, temperature=config.temperature),
                                  tokens, config.pad_id)
            if config.discriminator == "multi":
                adv = F.nll_loss(d(soft, soft_len), other + 1, reduction="sum") / batch
            else:
                adv = F.nll_loss(d(soft, soft_len, other), torch.ones_like(other), reduction="sum") / batch
            d.train()
            loss = loss + config.cycle_factor * cycle_nll.sum() / batch + config.adversarial_factor * adv
            losses.update(cycle=float(cycle_nll.detach().sum()) / batch, adversarial=float(adv.detach()))
        self.last_losses = losses
        return float(self_nll.detach().double().sum()), int(lengths.sum()), loss

    def other_styles(self, styles: torch.Tensor) -> torch.Tensor:
        """Another style for each row: the next one (with two styles, the other), as the reference's 1 - s."""
        return (styles + 1) % self.model.config.n_styles

    # -- evaluation --------------------------------------------------------------------------------
    def evaluate(self, model, split: str, *, max_tokens: int = 0, progress: bool = False) -> EvalResult:
        """Self-reconstruction NLL per token of `split` (teacher forcing, no noise), every style; `max_tokens`
        caps the tokens of each style (0 = all)."""
        from txl.data.style import eval_batches

        config, device = model.config, self.dist.device
        was_training = model.training
        model.eval()
        start, total, count = time.perf_counter(), 0.0, 0
        counted = [0] * config.n_styles
        with torch.no_grad():
            for style, batch in eval_batches(self.corpus, split, batch_size=self.cfg.eval_batch_size):
                if max_tokens and counted[style] >= max_tokens:
                    continue
                tokens, lengths, styles = (t.to(device) for t in (batch.tokens, batch.lengths, batch.styles))
                with autocast(device, self.precision):
                    nll = token_nll(model.reconstruct(tokens, lengths, styles, tokens), tokens, config.pad_id)
                total += float(nll.double().sum())
                count += int(lengths.sum())
                counted[style] += int(lengths.sum())
        model.train(was_training)
        return EvalResult(loss=total / max(count, 1), tokens=count, seconds=time.perf_counter() - start,
                          metric=self.corpus.metric, mem_len=0, tgt_len=config.max_length,
                          batch_size=self.cfg.eval_batch_size, warm_memory=False, mode="style", split=split)

    def final_extras(self, model, split: str) -> dict:
        """A few sentences of each style of `split` rewritten into the other style (greedy)."""
        from txl.data.style import eval_batches

        config, vocab = model.config, self.corpus.vocab
        samples = []
        model.eval()
        for style, batch in eval_batches(self.corpus, split, batch_size=5, max_sentences=5):
            target = self.other_styles(batch.styles)
            outputs = model.transfer(batch.tokens.to(self.dist.device), batch.lengths.to(self.dist.device),
                                     target.to(self.dist.device))
            for row, out, t in zip(batch.tokens.tolist(), outputs, target.tolist()):
                source = [i for i in row if i not in (config.pad_id, config.eos_id)]
                samples.append({"from": config.style_names[style] if config.style_names else style,
                                "to": config.style_names[t] if config.style_names else t,
                                "source": vocab.decode(source), "transfer": vocab.decode(out)})
        return {"transfers": samples}

    def next_commands(self, run: str) -> list[tuple[str, str]]:
        names = self.model.config.style_names
        style = names[0] if names else "0"
        test = " --split test" if "test" in self.corpus.splits else ""
        return [(f"txl eval {run}{test}", "style accuracy, self-BLEU and target-style perplexity of its transfers"),
                (f"txl generate {run} --style {style} --prompt TEXT", "rewrite a sentence in a style (--input FILE: "
                                                                     "one per line)"),
                (f"txl plot {run}", "training curves as a PNG"),
                (f"txl train --resume {run} --max-steps N", "train longer")]


__all__ = ["StyleTransfer", "phase", "token_nll", "word_drop"]
