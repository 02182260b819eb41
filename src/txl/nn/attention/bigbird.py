"""BigBird (Zaheer et al. 2020, "Big Bird: Transformers for Longer Sequences", arXiv 2007.14062, §2 and
appendix D "block sparsity"): keys and queries in blocks of B (`block`); query block t sees

- **window**: blocks t-w … t+w (`window` = w; causal: t-w … t, keys after the query hidden),
- **global**: the first g blocks (`global_blocks`), which also see every key themselves (ITC),
- **random**: r blocks (`random_blocks`) chosen by a fixed hash of (t, slot) — causal: among the
  blocks before t — so the pattern is the same at training and evaluation and for every length
  (a memory extends it without changing it: segment invariance holds).

Blocks count from key position 0 of [memory ; segment], so the memory is part of the pattern (its
first blocks are the global ones until it fills). Global attention on chosen tokens (ETC, BigBird's
"global tokens" as a [CLS] or question tokens): `model(..., global_mask=)` (see
`AttentionMask.global_mask`): a chosen token sees every (earlier) key and every (later) query sees
it. The fast kernel gathers those keys per sequence (O(n·G)) and merges them with the block part by
log-sum-exp, each key counted once. Cost O(n·(2w+1+g+r)·B) time and memory, and the
g·B global rows O(g·B·n). A block listed twice (random hitting the window) is counted once.

`attention_impl="eager"` builds the same pattern as a dense (i, n) mask: the reference. Positions:
`rope`, `xpos`, `sinusoidal`, `learned` (no score terms).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from txl.nn.attention.masks import AttentionMask
from txl.nn.attention.pattern import dense_masked_attention, gathered_attention, merge_by_lse, pad_to
from txl.nn.attention.registry import register
from txl.nn.options import LayerConfig, Options
from txl.nn.positional import LayerPositions


@dataclass(frozen=True)
class BigBirdOptions(Options):
    """`attention_options` of attention='bigbird'."""

    block: int = 64  # tokens per block: the unit of the pattern
    window: int = 1  # blocks on each side of a query block (causal: before it) it sees; 0 = its own only
    global_blocks: int = 1  # the first g blocks of the keys see and are seen by all
    random_blocks: int = 2  # r random (earlier, when causal) blocks per query block, a fixed hash pattern

    def validate(self) -> None:
        self.at_least(1, "block")
        self.at_least(0, "window", "global_blocks", "random_blocks")


HASH_A, HASH_B, HASH_SEED = 2654435761, 40503, 97  # Knuth's multiplicative hash constants


def random_blocks(query_blocks: Tensor, r: int, n_blocks: int, *, causal: bool, seed: int = 0) -> Tensor:
    """(len(query_blocks), r) block ids: a fixed pseudo-random pattern, -1 = none (block 0 when causal
    has no earlier block). Causal picks among blocks < t; bidirectional among all `n_blocks`."""
    t = query_blocks[:, None].to(torch.int64)
    slot = torch.arange(r, device=t.device)[None, :]
    h = ((t + 1) * HASH_A + (slot + 1) * HASH_B + seed * HASH_SEED) % (2**31 - 1)
    if causal:
        return torch.where(t > 0, h % t.clamp(min=1), torch.full_like(h, -1))
    return h % n_blocks


def rows_visible(mask: AttentionMask, rows: Tensor, q_len: int, k_len: int) -> Tensor:
    """`mask.visible` for some query rows only, (b or 1, 1, R, n): rows (b or 1, R) are query indices.
    Never builds the (i, n) matrix (at 32k tokens its distances alone take 8 GiB)."""
    query_pos = rows + (k_len - q_len)  # (b|1, R)
    key_pos = torch.arange(k_len, device=rows.device)
    if mask.causal:
        dist = query_pos[..., None] - key_pos  # (b|1, R, n)
        visible = dist >= 0
        if mask.window is not None:
            visible = visible & (dist < mask.window)
    else:
        visible = torch.ones(*rows.shape, k_len, dtype=torch.bool, device=rows.device)
    if mask.key_padding is not None:
        visible = visible & mask.key_padding.to(rows.device)[:, None, :]
    return visible[:, None]


@register("bigbird", "fast", bidirectional=True, score_terms=False, global_mask=True, options=BigBirdOptions)
class BigBirdAttention(nn.Module):
    """`attention="bigbird"`: window + global + random blocks, gathered per query block."""

    def __init__(self, config: LayerConfig):
        super().__init__()
        options = config.attention_options
        self.block, self.window = options.block, options.window
        self.global_blocks, self.random = options.global_blocks, options.random_blocks
        self.seed = 0

    def random_table(self, query_blocks: Tensor, n_blocks: int, causal: bool) -> Tensor:
        return random_blocks(query_blocks, self.random, n_blocks, causal=causal, seed=self.seed)

    def block_lists(self, query_blocks: Tensor, n_blocks: int, causal: bool) -> tuple[Tensor, Tensor]:
        """(nq, K) key block ids per query block and whether each slot counts (in range, not a repeat)."""
        t = query_blocks[:, None]
        after = 0 if causal else self.window
        window = t + torch.arange(-self.window, after + 1, device=t.device)[None, :]
        glob = torch.arange(self.global_blocks, device=t.device)[None, :].expand(len(query_blocks), -1)
        ids = torch.cat([window, glob, self.random_table(query_blocks, n_blocks, causal)], dim=1)
        valid = (ids >= 0) & (ids < n_blocks)
        if causal:
            valid &= ids <= t
        repeat = (ids[:, :, None] == ids[:, None, :]).tril(diagonal=-1).any(-1)  # same id in an earlier slot
        return ids, valid & ~repeat

    def pattern(self, q_len: int, k_len: int, causal: bool, device: torch.device) -> Tensor:
        """(i, n) bool: which keys each query's block pattern holds (before causal/window/padding)."""
        B, n_blocks = self.block, -(-k_len // self.block)
        q_blocks = (torch.arange(q_len, device=device) + k_len - q_len) // B
        k_blocks = torch.arange(k_len, device=device) // B
        ids, valid = self.block_lists(torch.arange(n_blocks, device=device), n_blocks, causal)
        listed = torch.zeros(n_blocks, n_blocks, dtype=torch.bool, device=device)
        listed[torch.arange(n_blocks, device=device)[:, None].expand_as(ids)[valid], ids[valid]] = True
        listed |= (torch.arange(n_blocks, device=device) < self.global_blocks)[:, None]  # global rows see all
        return listed[q_blocks][:, k_blocks]

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        if need_weights:
            return BigBirdReference.forward(self, q, k, v, positions=positions, mask=mask, dropatt=dropatt,
                                            training=training, need_weights=True)
        q, k = positions.content(q, k)
        b, h, i, d = q.shape
        n, B = k.shape[-2], self.block
        memory_len, n_blocks = n - i, -(-n // B)
        lead = memory_len % B  # queries padded on the left so their blocks align with the key blocks
        q_pad = pad_to(torch.nn.functional.pad(q, (0, 0, lead, 0)), 2, B)
        n_qb = q_pad.shape[2] // B
        query_blocks = memory_len // B + torch.arange(n_qb, device=q.device)
        ids, valid = self.block_lists(query_blocks, n_blocks, mask.causal)  # (nq, K)
        K = ids.shape[1]
        safe = ids.clamp(0, n_blocks - 1)
        k_blocks = pad_to(k, 2, B).view(b, h, n_blocks, B, d)
        v_blocks = pad_to(v, 2, B).view(b, h, n_blocks, B, d)
        keys = k_blocks[:, :, safe].reshape(b, h, n_qb, K * B, d)  # (b, h, nq, K·B, d)
        values = v_blocks[:, :, safe].reshape(b, h, n_qb, K * B, d)
        key_pos = (safe[:, :, None] * B + torch.arange(B, device=q.device)).reshape(n_qb, K * B)
        query_pos = query_blocks[:, None] * B + torch.arange(B, device=q.device)  # (nq, B)
        visible = (valid[:, :, None].expand(-1, -1, B).reshape(n_qb, K * B) & (key_pos < n))[:, None, :]
        if mask.causal:
            dist = query_pos[:, :, None] - key_pos[:, None, :]
            visible = visible & (dist >= 0)
            if mask.window is not None:
                visible = visible & (dist < mask.window)
        visible = visible.expand(n_qb, B, K * B)[None, None]
        if mask.key_padding is not None:
            real = mask.key_padding.to(q.device)
            real = pad_to(real, 1, B).view(b, n_blocks, B)[:, safe].reshape(b, n_qb, K * B)  # (b, nq, K·B)
            visible = visible & real[:, None, :, None, :]
        chosen = None
        if mask.global_mask is not None:  # chosen global keys: in their own set below, not in the blocks
            chosen = torch.nn.functional.pad(mask.global_mask.to(q.device), (memory_len, 0))  # (b, n)
            listed = pad_to(chosen, 1, B).view(b, n_blocks, B)[:, safe].reshape(b, n_qb, K * B)
            visible = visible & ~listed[:, None, :, None, :]
        out, lse = gathered_attention(q_pad.view(b, h, n_qb, B, d), keys, values, visible, dropatt=dropatt,
                                      training=training, need_lse=chosen is not None)
        out = out.reshape(b, h, n_qb * B, d)[:, :, lead:lead + i]
        if chosen is not None:
            lse = lse.reshape(b, h, n_qb * B)[:, :, lead:lead + i]
            out = self._with_chosen(q, k, v, out, lse, chosen, mask, dropatt=dropatt, training=training)
        g_rows = min(max(self.global_blocks * B - memory_len, 0), i)  # global queries in this segment
        if g_rows:  # they see every (earlier) key: dense rows
            rows = rows_visible(mask, torch.arange(g_rows, device=q.device)[None], i, n)
            out_g, _ = dense_masked_attention(q[:, :, :g_rows], k, v, rows, dropatt=dropatt, training=training)
            out = torch.cat([out_g, out[:, :, g_rows:]], dim=2)
        return out, None

    @staticmethod
    def _with_chosen(q, k, v, out, lse, chosen, mask: AttentionMask, *, dropatt: float, training: bool):
        """Merge the chosen global keys into every row, then give the chosen queries dense rows."""
        b, h, i, d = q.shape
        n = k.shape[-2]
        count = int(chosen.sum(-1).max())
        if count == 0:
            return out
        order = chosen.long().argsort(dim=-1, descending=True, stable=True)[:, :count]  # (b, G) their positions
        valid = chosen.gather(1, order)  # (b, G): padding slots of shorter rows are False
        keys = k.gather(2, order[:, None, :, None].expand(b, h, count, d))
        values = v.gather(2, order[:, None, :, None].expand(b, h, count, d))
        seen = valid[:, None, None, :]  # (b, 1, 1, G)
        query_pos = torch.arange(i, device=q.device) + n - i
        if mask.causal:
            dist = query_pos[None, :, None] - order[:, None, :]  # (b, i, G)
            near = dist >= 0
            if mask.window is not None:
                near = near & (dist < mask.window)
            seen = seen & near[:, None]
        if mask.key_padding is not None:
            seen = seen & mask.key_padding.to(q.device).gather(1, order)[:, None, None, :]
        out_c, lse_c = gathered_attention(q, keys, values, seen, dropatt=dropatt, training=training)
        out = merge_by_lse([out, out_c], [lse, lse_c])
        # Chosen queries see every key they may see: dense rows, gathered and written back.
        q_rows = chosen[:, n - i:]
        rows = int(q_rows.sum(-1).max())
        if rows:
            where = q_rows.long().argsort(dim=-1, descending=True, stable=True)[:, :rows]  # (b, R)
            picked = q.gather(2, where[:, None, :, None].expand(b, h, rows, d))
            visible = rows_visible(mask, where, i, n)
            dense, _ = dense_masked_attention(picked, k, v, visible, dropatt=dropatt, training=training)
            keep = q_rows.gather(1, where)[:, None, :, None]  # padding slots write back what was there
            current = out.gather(2, where[:, None, :, None].expand(b, h, rows, d))
            out = out.scatter(2, where[:, None, :, None].expand(b, h, rows, d), torch.where(keep, dense, current))
        return out

    def extra_repr(self) -> str:
        return f"block={self.block}, window={self.window}, global={self.global_blocks}, random={self.random}"


@register("bigbird", "eager", bidirectional=True, score_terms=False, global_mask=True, options=BigBirdOptions)
class BigBirdReference(BigBirdAttention):
    """The same block pattern as a dense (i, n) mask, O(n²): the ground truth for `BigBirdAttention`."""

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        q, k = positions.content(q, k)
        i, n = q.shape[-2], k.shape[-2]
        pattern = self.pattern(i, n, mask.causal, q.device)
        if mask.global_mask is not None:  # chosen tokens: their rows and columns join the pattern
            chosen = torch.nn.functional.pad(mask.global_mask.to(q.device), (n - i, 0))  # (b, n)
            pattern = pattern | chosen[:, None, :] | chosen[:, n - i:, None]  # (b, i, n)
            pattern = pattern[:, None]
        visible = mask.visible(i, n, q.device) & pattern
        out, probs = dense_masked_attention(q, k, v, visible, dropatt=dropatt, training=training)
        return out, probs if need_weights else None
