"""Adaptive input embeddings (Baevski & Auli 2019) and adaptive softmax (Grave et al. 2017).

With `cutoffs = (c1, c2, ...)`, the vocabulary is split into a shortlist [0, c1) and tail clusters
[c1, c2), ...; cluster i gets `d_embed // div_val**i` dimensions plus a projection to d_model. The
softmax head scores the shortlist plus one logit per tail cluster; a tail token's log-probability is
log p(cluster) + log p(token | cluster). Output weights can be tied to the input embeddings
(`tie_weight`) and each cluster's projection can be shared with the input side (`tie_projs`), as in
the reference's WikiText-103 and lm1b models.

With no cutoffs both modules reduce to a plain embedding and a plain (biased) softmax layer, with an
optional projection when d_embed != d_model. Unlike the reference, per-token losses come back in
input order, not grouped by cluster. With `sample_softmax = n` (no cutoffs), a model in training mode scores
its labels against shared sampled negatives instead (txl.models.transformer_xl.sampled).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.models.transformer_xl.config import TransformerXLConfig
from txl.models.transformer_xl.sampled import log_uniform_candidates, sampled_nll


def cluster_bounds(config: TransformerXLConfig) -> list[tuple[int, int]]:
    edges = [0, *config.cutoffs, config.vocab_size]
    return list(zip(edges[:-1], edges[1:]))


def cluster_dims(config: TransformerXLConfig) -> list[int]:
    if config.div_val == 1:
        return [config.embed_dim] * (len(config.cutoffs) + 1)
    return [config.embed_dim // config.div_val**i for i in range(len(config.cutoffs) + 1)]


class AdaptiveEmbedding(nn.Module):
    """Token ids (b, t) -> (b, t, d_model), scaled by sqrt(d_model) as the reference does."""

    def __init__(self, config: TransformerXLConfig, *, linear: Callable[..., Tensor] = F.linear):
        super().__init__()
        self.config = config
        self.linear_fn = linear  # the projections' product (F.linear, or the fast backend's)
        self.bounds = cluster_bounds(config)
        self.scale = config.d_model**0.5
        dims = cluster_dims(config)
        if config.div_val == 1:
            self.layers = nn.ModuleList([nn.Embedding(config.vocab_size, config.embed_dim)])
            needs_proj = [config.embed_dim != config.d_model]
        else:
            self.layers = nn.ModuleList(nn.Embedding(hi - lo, d) for (lo, hi), d in zip(self.bounds, dims))
            needs_proj = [True] * len(dims)
        # Projection i maps cluster i's d_i dims to d_model: (d_model, d_i), used as F.linear(emb, P).
        self.projs = nn.ParameterDict(
            {str(i): nn.Parameter(torch.zeros(config.d_model, dims[i])) for i, p in enumerate(needs_proj) if p}
        )

    def proj(self, i: int) -> Tensor | None:
        return self.projs.get(str(i))

    def forward(self, input_ids: Tensor) -> Tensor:
        if len(self.layers) == 1:
            emb = self.layers[0](input_ids)
            proj = self.proj(0)
            if proj is not None:
                emb = self.linear_fn(emb, proj)
            return emb * self.scale
        # Every cluster embeds every token with a clamped index and the rows outside the cluster are
        # zeroed: static shapes (compile-friendly, no host sync) and an exact sum, since only one
        # cluster contributes a non-zero row per token.
        out = None
        for i, (lo, hi) in enumerate(self.bounds):
            inside = (input_ids >= lo) & (input_ids < hi)
            emb = self.layers[i]((input_ids - lo).clamp(0, hi - lo - 1))
            emb = self.linear_fn(emb, self.projs[str(i)]) * inside.unsqueeze(-1).to(emb.dtype)
            out = emb if out is None else out + emb
        return out * self.scale


class AdaptiveLogSoftmax(nn.Module):
    """Hidden states (n, d_model) -> logits / log-probabilities and per-token NLL in input order."""

    def __init__(self, config: TransformerXLConfig, embedding: AdaptiveEmbedding, *,
                 linear: Callable[..., Tensor] = F.linear):
        super().__init__()
        self.config = config
        self.linear_fn = linear  # the output layer's product (F.linear, or the fast backend's)
        self.bounds = cluster_bounds(config)
        self.n_clusters = len(config.cutoffs)
        self.shortlist = self.bounds[0][1]
        dims = cluster_dims(config)
        self._embedding = [embedding]  # a plain list: do not register the embedding twice
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        if config.tie_weight:
            self.weights = nn.ParameterDict()
        elif config.div_val == 1:
            self.weights = nn.ParameterDict({"0": nn.Parameter(torch.zeros(config.vocab_size, dims[0]))})
        else:
            self.weights = nn.ParameterDict(
                {str(i): nn.Parameter(torch.zeros(hi - lo, d)) for i, ((lo, hi), d) in enumerate(zip(self.bounds, dims))}
            )
        tie_projs = config.resolved_tie_projs
        own = {}
        for i in range(len(self.bounds)):
            shared = embedding.proj(0 if config.div_val == 1 else i)
            if shared is not None and not tie_projs[i]:
                own[str(i)] = nn.Parameter(torch.zeros_like(shared))
        self.projs = nn.ParameterDict(own)
        if self.n_clusters:
            self.cluster_weight = nn.Parameter(torch.zeros(self.n_clusters, dims[0]))
            self.cluster_bias = nn.Parameter(torch.zeros(self.n_clusters))

    # -- parameters of cluster i, wherever they live ------------------------------------------------
    def weight(self, i: int) -> Tensor:
        lo, hi = self.bounds[i]
        if self.config.div_val == 1:
            full = self._embedding[0].layers[0].weight if self.config.tie_weight else self.weights["0"]
            return full[lo:hi]
        return self._embedding[0].layers[i].weight if self.config.tie_weight else self.weights[str(i)]

    def proj(self, i: int) -> Tensor | None:
        if str(i) in self.projs:
            return self.projs[str(i)]
        if self.config.resolved_tie_projs[i]:
            return self._embedding[0].proj(0 if self.config.div_val == 1 else i)
        return None

    def _logits(self, hidden: Tensor, weight: Tensor, bias: Tensor, proj: Tensor | None) -> Tensor:
        if proj is not None:
            hidden = self.linear_fn(hidden, proj.t())  # (n, d_model) @ (d_model, d_i)
        return self.linear_fn(hidden, weight, bias)

    def _head(self, hidden: Tensor) -> Tensor:
        lo, hi = self.bounds[0]
        weight, bias = self.weight(0), self.bias[lo:hi]
        if self.n_clusters:
            weight = torch.cat([weight, self.cluster_weight], dim=0)
            bias = torch.cat([bias, self.cluster_bias], dim=0)
        return self._logits(hidden, weight, bias, self.proj(0))

    def _tail_logprobs(self, hidden: Tensor, i: int) -> Tensor:
        lo, hi = self.bounds[i]
        return self._logits(hidden, self.weight(i), self.bias[lo:hi], self.proj(i)).float().log_softmax(-1)

    def _sampled_nll(self, hidden: Tensor, labels: Tensor) -> Tensor:
        """Training's sampled-softmax NLL (config.sample_softmax): 2·n log-uniform draws shared by the batch."""
        vocab, num_tries = self.config.vocab_size, 2 * self.config.sample_softmax
        proj = self.proj(0)
        if proj is not None:
            hidden = self.linear_fn(hidden, proj.t())  # (n, d_model) @ (d_model, d_embed)
        negatives = log_uniform_candidates(vocab, num_tries, device=hidden.device)
        return sampled_nll(hidden, self.weight(0), self.bias, labels, negatives,
                           vocab_size=vocab, num_tries=num_tries, linear=self.linear_fn)

    # -- public ----------------------------------------------------------------------------------
    def forward(self, hidden: Tensor, labels: Tensor | None = None, *, want_scores: bool = True):
        """Return (scores, nll).

        scores: (n, V) raw logits for a full softmax, log-probabilities for an adaptive one, or None
        when `want_scores` is False. nll: (n,) float32 in input order (0 where label == -100), or None
        without labels.
        """
        if self.n_clusters == 0:
            if labels is not None and self.training and self.config.sample_softmax:
                return (self._head(hidden) if want_scores else None), self._sampled_nll(hidden, labels)
            logits = self._head(hidden)
            nll = None
            if labels is not None:
                nll = F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="none")
            return (logits if want_scores else None), nll

        head_logprobs = self._head(hidden).float().log_softmax(-1)  # (n, shortlist + clusters)
        scores = None
        if want_scores:
            parts = [head_logprobs[:, : self.shortlist]]
            for i in range(1, len(self.bounds)):
                cluster = head_logprobs[:, self.shortlist + i - 1, None]
                parts.append(cluster + self._tail_logprobs(hidden, i))
            scores = torch.cat(parts, dim=-1)
        nll = None
        if labels is not None:
            nll = torch.zeros(labels.shape, dtype=torch.float32, device=hidden.device)
            in_head = (labels >= 0) & (labels < self.shortlist)
            head_target = labels.clamp(0, self.shortlist - 1)
            nll = torch.where(in_head, -head_logprobs.gather(1, head_target[:, None]).squeeze(1), nll)
            for i in range(1, len(self.bounds)):
                lo, hi = self.bounds[i]
                rows = ((labels >= lo) & (labels < hi)).nonzero().squeeze(1)
                if rows.numel() == 0:
                    continue
                tail = self._tail_logprobs(hidden.index_select(0, rows), i)
                logprob = head_logprobs[rows, self.shortlist + i - 1] + tail.gather(
                    1, (labels[rows] - lo)[:, None]
                ).squeeze(1)
                nll = nll.index_copy(0, rows, -logprob)
        return scores, nll
