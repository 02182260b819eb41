"""Bucketed shared-QK attention, the machinery of `lsh` (Reformer) and `routing` (Routing Transformer).

Both kernels share one vector per position for queries and keys (Kitaev et al. 2020 §3 "shared-QK";
Roy et al. 2021 use shared QK for their causal LMs): the layer's key projection k. A position's
query is k_p, its key is k_p / |k_p| (so a query's score with a key is bounded by |k_p|). Each
position falls in one bucket per round (a random-rotation hash, or the nearest k-means centroid).

Pattern (per round): query p sees the keys j of its own bucket with j ≤ p (causal) whose rank
among that bucket's positions is within `window` (c) of p's — the c most recent keys of its bucket,
itself included; bidirectionally, the keys of its bucket within c ranks on either side. The
pattern of a query depends on positions ≤ p only, so it is causal in the strict sense (a future
token never changes a past output, even through the sort) and a memory extends it exactly.
With several rounds a query sees the union of its rounds' keys, each counted once.

Like Reformer, a position does not attend to itself unless it sees nothing else (with shared QK the
self score would dominate every row): self pairs are masked, and a query left with no key returns
its own value (Reformer adds -1e5 to the self score instead, which is the same up to float32
rounding of scores near 1e5).

Fast (`bucketed_attention`): per round, sort positions by (bucket, position) — within a bucket the
order is by position, so the pattern is a band of width c in the sorted order — cut the sorted
order into chunks of c, and let each chunk attend to itself and the previous chunk (bidirectional:
and the next), masked to its bucket and band. O(n·c) time and memory per round. Rounds merge by
their log-sum-exp; a pair seen in m rounds has log m subtracted from its score in each, so the
result is exactly softmax over the union (Kitaev et al. 2020 §3 "multi-round LSH", the same
correction). Reference (`bucketed_reference`): the union pattern as a dense (i, n) mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from txl.nn.attention.masks import NEG, AttentionMask
from txl.nn.attention.pattern import dense_masked_attention, gathered_attention, merge_by_lse, pad_to
from txl.nn.positional import LayerPositions


def bucket_ranks(buckets: Tensor) -> tuple[Tensor, Tensor]:
    """buckets (.., n) -> (order, rank): the positions sorted by (bucket, position), and each
    position's rank among the positions of its bucket."""
    n = buckets.shape[-1]
    pos = torch.arange(n, device=buckets.device)
    order = (buckets * n + pos).argsort(-1)
    sorted_buckets = buckets.gather(-1, order)
    start = torch.ones_like(sorted_buckets, dtype=torch.bool)
    start[..., 1:] = sorted_buckets[..., 1:] != sorted_buckets[..., :-1]
    first = torch.where(start, pos.expand_as(order), torch.zeros_like(order)).cummax(-1).values
    rank = torch.empty_like(order).scatter_(-1, order, pos - first)
    return order, rank


def round_visible(b_q: Tensor, r_q: Tensor, b_k: Tensor, r_k: Tensor, window: int, causal: bool) -> Tensor:
    """Whether (query, key) pairs are in one round's pattern, from their buckets and ranks (broadcast)."""
    diff = r_q - r_k
    near = (diff >= 0) & (diff < window) if causal else diff.abs() < window
    return (b_q == b_k) & near


def shared_qk(positions: LayerPositions, k: Tensor) -> tuple[Tensor, Tensor]:
    """Queries (every position's k, as the content score sees them) and unit keys, (b, h, n, d) each."""
    queries, keys = positions.content(k, k)
    return queries, F.normalize(keys, dim=-1)


def bucketed_reference(
    k: Tensor, v: Tensor, buckets: Tensor, *, q_len: int, window: int, positions: LayerPositions,
    mask: AttentionMask, dropatt: float, training: bool,
) -> tuple[Tensor, Tensor]:
    """The union of the rounds' patterns as a dense mask. k, v (b, h, n, d); buckets (b, h, R, n)."""
    n = k.shape[-2]
    _, rank = bucket_ranks(buckets)
    q_b, q_r = buckets[..., n - q_len:, None], rank[..., n - q_len:, None]  # (b, h, R, i, 1)
    k_b, k_r = buckets[..., None, :], rank[..., None, :]  # (b, h, R, 1, n)
    pattern = round_visible(q_b, q_r, k_b, k_r, window, mask.causal).any(2)  # (b, h, i, n)
    is_self = torch.eye(n, dtype=torch.bool, device=k.device)[n - q_len:]
    visible = pattern & mask.visible(q_len, n, k.device) & ~is_self
    queries, keys = shared_qk(positions, k)
    out, probs = dense_masked_attention(queries[:, :, n - q_len:], keys, v, visible, dropatt=dropatt,
                                        training=training)
    alone = ~visible.any(-1)  # (b, h, i): the query sees only itself
    out = torch.where(alone[..., None], v[:, :, n - q_len:], out)
    probs = torch.where(alone[..., None], is_self.to(probs.dtype), probs)
    return out, probs


def bucketed_attention(
    k: Tensor, v: Tensor, buckets: Tensor, *, q_len: int, window: int, positions: LayerPositions,
    mask: AttentionMask, dropatt: float, training: bool,
) -> Tensor:
    """The same attention in sorted chunks of `window`: O(n·window) per round."""
    b, h, n, d = k.shape
    rounds, c = buckets.shape[2], window
    order, rank = bucket_ranks(buckets)  # (b, h, R, n)
    queries, keys = shared_qk(positions, k)
    pos = torch.arange(n, device=k.device)
    real = None if mask.key_padding is None else mask.key_padding.to(k.device)  # (b, n)
    ahead = 0 if mask.causal else 1  # chunks after the query's chunk it also attends to
    outs, lses = [], []
    for r in range(rounds):
        idx = pad_to(order[:, :, r], -1, c, value=0)  # (b, h, N): padding rows repeat position 0
        pad_row = torch.arange(idx.shape[-1], device=k.device) >= n  # (N,)
        n_chunks = idx.shape[-1] // c

        def sort(x: Tensor, idx: Tensor = idx) -> Tensor:  # (b, h, n, d) -> (b, h, N, d) in this round's order
            return x.gather(2, idx[..., None].expand(-1, -1, -1, x.shape[-1]))

        def around(x: Tensor) -> Tensor:  # (b, h, nc, c, ...) -> (b, h, nc, (2+ahead)·c, ...): prev, own, next
            prev = F.pad(x[:, :, :-1], [0, 0] * (x.dim() - 3) + [1, 0])
            parts = [prev, x]
            if ahead:
                parts.append(F.pad(x[:, :, 1:], [0, 0] * (x.dim() - 3) + [0, 1]))
            return torch.cat(parts, dim=3)

        q_s = sort(queries).view(b, h, n_chunks, c, d)
        k_s = around(sort(keys).view(b, h, n_chunks, c, d))
        v_s = around(sort(v).view(b, h, n_chunks, c, d))
        # Per sorted row: its position, and its bucket and rank in every round (for the count of rounds).
        p_s = idx.view(b, h, n_chunks, c).to(torch.int32)  # int32: half the traffic of the pair tensors
        sig = torch.stack([buckets, rank], dim=-1).transpose(2, 3).to(torch.int32)  # (b, h, n, R, 2)
        sig_s = sig.gather(2, idx[..., None, None].expand(-1, -1, -1, rounds, 2)).view(b, h, n_chunks, c, rounds, 2)
        # 1 for a real sorted row; 0 for padding rows and the zero-filled slots before the first chunk
        # (and after the last)
        exists = (~pad_row).to(torch.uint8).view(n_chunks, c).expand(b, h, -1, -1)
        p_k, sig_k, pad_k = around(p_s), around(sig_s), around(exists) == 0
        # (b, h, nc, c, M) pattern of each round (this one's decides; the others count duplicates)
        seen = [round_visible(sig_s[..., None, t, 0], sig_s[..., None, t, 1], sig_k[..., None, :, t, 0],
                              sig_k[..., None, :, t, 1], c, mask.causal) for t in range(rounds)]
        dist = p_s[..., :, None] - p_k[..., None, :]
        visible = seen[r] & ~pad_k[..., None, :] & (dist != 0)
        if mask.causal:
            visible &= dist >= 0
            if mask.window is not None:
                visible &= dist < mask.window
        if real is not None:
            real_k = real[:, None, :].expand(b, h, n).gather(2, p_k.flatten(2).long()).view_as(p_k)
            visible &= real_k[..., None, :]
        offset = None  # one round: every pair is seen once
        if rounds > 1:  # a pair seen in m rounds: -log m in each, so the merged softmax counts it once
            count = torch.stack(seen).sum(0, dtype=torch.int8).clamp_(min=1)
            offset = -count.float().log()
        out, lse = gathered_attention(q_s, k_s, v_s, visible, dropatt=dropatt, training=training,
                                      score_offset=offset)
        # Back to position order; the padding rows (all at the end of the sorted order) are dropped.
        inverse = torch.empty_like(order[:, :, r]).scatter_(-1, order[:, :, r], pos.expand(b, h, n))
        out = out.reshape(b, h, n_chunks * c, d)[:, :, :n].gather(2, inverse[..., None].expand(-1, -1, -1, d))
        lse = lse.reshape(b, h, n_chunks * c)[:, :, :n].gather(2, inverse)
        outs.append(out[:, :, n - q_len:])
        lses.append(lse[:, :, n - q_len:])
    out = outs[0] if rounds == 1 else merge_by_lse(outs, lses)
    alone = torch.stack(lses).amax(0) <= NEG  # (b, h, i): no key but itself in any round
    return torch.where(alone[..., None], v[:, :, n - q_len:], out)
