"""The Style Transformer (Dai et al. 2019, "Style Transformer: Unpaired Text Style Transfer without
Disentangled Latent Representation", arXiv 1905.05621), on txl's encoder-decoder.

The style transfer network f(x, s) reads a sentence x and a style s and writes x in style s. Its encoder
reads [e_s ; x] (the style's embedding as the first position, before the words, as the reference
implementation does), its decoder writes the sentence word by word. Nothing disentangles content from
style: f is trained only through
- self-reconstruction  L_self = -log p_f(x | x, s)        (s = x's own style; optionally with noisy input),
- cycle reconstruction L_cyc  = -log p_f(x | f(x, s'), s)  (s' another style),
- the style loss       L_adv  = -log p_d(c | f(x, s'))     (fool the discriminator d),
where f(x, s') is decoded *softly*: each step feeds the next the expected embedding under the softmax
(temperature `temperature`), so gradients reach f through its own output (the reference's
`differentiable_decode`). The discriminator d is a Transformer encoder over [cls ; (e_s ;) y]:
- `conditional`: d(y, s) = is y a real sentence of style s? (class 1 for real sentences with their own
  style, 0 for real sentences with another style and for f's transfers);
- `multi`: d(y) over n_styles + 1 classes: class i + 1 for style i, class 0 for f's transfers.
Both read soft sentences (distributions over the vocabulary) by the same expected embedding.

Dimension names: b batch, s source length, t target length, d d_model, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.errors import ConfigError, UsageError
from txl.fast import backend_for
from txl.models.seq2seq.model import DecoderCache, EncoderDecoder
from txl.models.style.config import StyleTransformerConfig
from txl.models.transformer_xl.model import Block
from txl.nn.attention.masks import AttentionMask


def lengths_from_tokens(tokens: Tensor, eos_id: int) -> Tensor:
    """(b, t) ids -> (b,) tokens up to and including the first <eos> (all t when there is none)."""
    seen = torch.cumsum(tokens == eos_id, dim=1)
    return ((seen == 0).sum(dim=1) + 1).clamp(max=tokens.shape[1])


def length_mask(lengths: Tensor, width: int) -> Tensor:
    """(b,) lengths -> (b, width) bool, True at real positions."""
    return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]


def embed_tokens(table: nn.Embedding, tokens: Tensor) -> Tensor:
    """Ids (b, t) -> their rows; a soft sentence (b, t, V) of distributions -> the expected rows."""
    if tokens.dim() == 3:
        return tokens.to(table.weight.dtype) @ table.weight
    return table(tokens)


class StyleDiscriminator(nn.Module):
    """d: a learned class vector (and, conditional, the style's embedding) before the sentence, a
    bidirectional Transformer encoder, a linear classifier on the class vector's output. Returns log-probs."""

    def __init__(self, config: StyleTransformerConfig):
        super().__init__()
        view = config.discriminator_config()
        backend = backend_for(config.backend)
        self.config = config
        d = config.d_model
        self.embed = nn.Embedding(config.vocab_size, d)
        self.style_embed = nn.Embedding(config.n_styles, d) if config.discriminator == "conditional" else None
        self.cls = nn.Parameter(torch.zeros(d))
        self.pos = backend.positional(view)
        self.drop = backend.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(view, layer_idx=i, backend=backend) for i in range(view.n_layer))
        self.norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.classifier = nn.Linear(d, config.n_classes)

    def forward(self, tokens: Tensor, lengths: Tensor, styles: Tensor | None = None) -> Tensor:
        """tokens (b, t) ids or (b, t, V) distributions, lengths (b,), styles (b,) (conditional only) ->
        (b, n_classes) log-probabilities."""
        conditional = self.style_embed is not None
        if conditional != (styles is not None):
            raise UsageError(f"the {self.config.discriminator} discriminator "
                             f"{'needs' if conditional else 'takes no'} styles")
        b, t = tokens.shape[:2]
        x = self.pos.embed(embed_tokens(self.embed, tokens) * self.config.d_model**0.5)
        prefix = [self.cls.expand(b, 1, -1)]
        if conditional:
            prefix.append(self.style_embed(styles)[:, None])
        h = self.drop(torch.cat(prefix + [x], dim=1))  # (b, p + t, d)
        real = torch.cat([torch.ones(b, len(prefix), dtype=torch.bool, device=h.device),
                          length_mask(lengths, t)], dim=1)
        mask = AttentionMask(causal=False, key_padding=real)
        state = self.pos.prepare(k_len=h.shape[1], clamp_len=0, device=h.device, dtype=h.dtype)
        for i, block in enumerate(self.blocks):
            h, _ = block(h, memory=None, positions=self.pos.layer(i, state), mask=mask)
        return F.log_softmax(self.classifier(self.norm(h[:, 0])).float(), dim=-1)


class StyleTransformer(nn.Module):
    """`generator` (f: an `EncoderDecoder` plus `style_embed`) and `discriminator` (d). The training
    objective (`txl.train.style`) alternates their updates; `transfer` rewrites sentences in a style."""

    def __init__(self, config: StyleTransformerConfig):
        super().__init__()
        if config.arch != "style-transformer":
            raise ConfigError(f"StyleTransformer needs config.arch='style-transformer', got {config.arch!r}")
        self.config = config
        self.generator = EncoderDecoder(config.generator_config())
        self.style_embed = nn.Embedding(config.n_styles, config.d_model)
        nn.init.normal_(self.style_embed.weight, 0.0, config.d_model**-0.5)
        self.discriminator = StyleDiscriminator(config)
        nn.init.normal_(self.discriminator.embed.weight, 0.0, config.d_model**-0.5)
        if self.discriminator.style_embed is not None:
            nn.init.normal_(self.discriminator.style_embed.weight, 0.0, config.d_model**-0.5)
        nn.init.normal_(self.discriminator.cls, 0.0, config.d_model**-0.5)

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            for table in (self.generator.target_embed, self.discriminator.embed):
                params.pop(id(table.weight), None)
        return sum(p.numel() for p in params.values())

    def generator_parameters(self) -> list[nn.Parameter]:
        return list(self.generator.parameters()) + list(self.style_embed.parameters())

    # -- f: encode with the style, decode -------------------------------------------------------
    def encode(self, tokens: Tensor, lengths: Tensor, styles: Tensor) -> tuple[Tensor, Tensor]:
        """tokens (b, s) ids or (b, s, V) distributions, lengths (b,), styles (b,) -> (encoded (b, 1 + s, d),
        key padding (b, 1 + s) with the style position real)."""
        g = self.generator
        b, s = tokens.shape[:2]
        if tokens.dim() == 2 and tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            raise UsageError(f"token ids must be in [0, {self.config.vocab_size}), got {int(tokens.max())}")
        if styles.shape != (b,) or (b and (int(styles.min()) < 0 or int(styles.max()) >= self.config.n_styles)):
            raise UsageError(f"styles must be (batch,) indices below n_styles={self.config.n_styles}")
        x = g.encoder_pos.embed(embed_tokens(g.target_embed, tokens) * self.config.d_model**0.5)
        h = g.drop(torch.cat([self.style_embed(styles)[:, None].to(x.dtype) * self.config.d_model**0.5, x], dim=1))
        real = torch.cat([torch.ones(b, 1, dtype=torch.bool, device=h.device), length_mask(lengths, s)], dim=1)
        mask = AttentionMask(causal=False, key_padding=real)
        state = g.encoder_pos.prepare(k_len=s + 1, clamp_len=0, device=h.device, dtype=h.dtype)
        for i, block in enumerate(g.encoder):
            h, _ = block(h, memory=None, positions=g.encoder_pos.layer(i, state), mask=mask)
        return g.encoder_norm(h), real

    def decode(self, inputs: Tensor, encoded: Tensor, real: Tensor, *, cache: DecoderCache | None = None,
               temperature: float = 1.0) -> Tensor:
        """Decoder inputs (b, t) ids or (b, t, V) distributions (after the `cache`'s tokens) -> (b, t, V)
        log-probabilities at `temperature`."""
        g = self.generator
        past = 0 if cache is None else cache.length
        x = embed_tokens(g.target_embed, inputs) * self.config.d_model**0.5
        t = x.shape[1]
        if past:  # positions past..past+t-1: the encoding's rows of the whole prefix
            x = x + g.decoder_pos.embed(x.new_zeros(1, past + t, x.shape[-1]))[:, past:]
        else:
            x = g.decoder_pos.embed(x)
        h = g.drop(x)
        state = g.decoder_pos.prepare(k_len=past + t, clamp_len=0, device=h.device, dtype=h.dtype)
        cross = AttentionMask(causal=False, key_padding=None if bool(real.all()) else real)
        for i, block in enumerate(g.decoder):
            h = block(h, encoded, positions=g.decoder_pos.layer(i, state), cross_mask=cross, cache=cache)
        logits = g.output_logits(g.drop(g.decoder_norm(h))).float()
        return F.log_softmax(logits / temperature, dim=-1)

    def reconstruct(self, tokens: Tensor, lengths: Tensor, styles: Tensor, targets: Tensor, *,
                    temperature: float = 1.0) -> Tensor:
        """Teacher forcing: log p_f(targets | tokens, styles), (b, t, V) log-probabilities of each target
        position (targets (b, t) end in <eos>, padded with <pad>; the decoder reads <s> + targets[:, :-1])."""
        encoded, real = self.encode(tokens, lengths, styles)
        bos = torch.full_like(targets[:, :1], self.config.bos_id)
        return self.decode(torch.cat([bos, targets[:, :-1]], dim=1), encoded, real, temperature=temperature)

    def decode_free(self, tokens: Tensor, lengths: Tensor, styles: Tensor, *, soft: bool,
                    temperature: float = 1.0, max_length: int | None = None, stop_at_eos: bool = False) -> Tensor:
        """f(x, s) decoded without targets: (b, L, V) log-probabilities of each step. `soft`: each step reads
        the previous step's distribution (differentiable, the reference's `differentiable_decode`); else its
        argmax. The reference decodes all `max_length` steps; `stop_at_eos` ends once every row wrote <eos>."""
        steps = max_length or self.config.max_length
        encoded, real = self.encode(tokens, lengths, styles)
        cache = self.generator.new_cache()
        step_input = torch.full((tokens.shape[0], 1), self.config.bos_id, dtype=torch.long, device=encoded.device)
        out, done = [], torch.zeros(tokens.shape[0], dtype=torch.bool, device=encoded.device)
        for _ in range(steps):
            log_probs = self.decode(step_input, encoded, real, cache=cache, temperature=temperature)  # (b, 1, V)
            out.append(log_probs)
            step_input = log_probs.exp() if soft else log_probs.argmax(-1)
            if stop_at_eos:
                done |= log_probs[:, 0].argmax(-1) == self.config.eos_id
                if bool(done.all()):
                    break
        return torch.cat(out, dim=1)

    @torch.no_grad()
    def transfer(self, tokens: Tensor, lengths: Tensor, styles: Tensor, *, max_length: int | None = None) -> list[list[int]]:
        """Greedy transfer of each sentence to `styles`: its ids, without <eos>."""
        log_probs = self.decode_free(tokens, lengths, styles, soft=False, max_length=max_length, stop_at_eos=True)
        ids = log_probs.argmax(-1)
        out = []
        for row, n in zip(ids.tolist(), lengths_from_tokens(ids, self.config.eos_id).tolist()):
            out.append([i for i in row[:n] if i != self.config.eos_id])
        return out

    def forward(self, tokens: Tensor, lengths: Tensor, styles: Tensor, targets: Tensor | None = None):
        """Self-reconstruction log-probabilities of `targets` (default: the input) in `styles`."""
        return self.reconstruct(tokens, lengths, styles, tokens if targets is None else targets)

    # ------------------------------------------------------------------------------------------
    def save_pretrained(self, directory) -> None:
        from txl.models.pretrained import save_model

        save_model(self, directory)

    @classmethod
    def from_pretrained(cls, directory, *, map_location="cpu", **overrides) -> StyleTransformer:
        from txl.models.registry import load_model

        model = load_model(directory, map_location=map_location, **overrides)
        if not isinstance(model, cls):
            raise UsageError(f"{directory} holds a {model.config.arch} model, not a Style Transformer")
        return model


__all__ = ["StyleDiscriminator", "StyleTransformer", "embed_tokens", "length_mask", "lengths_from_tokens"]
