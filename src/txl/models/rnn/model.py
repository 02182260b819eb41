"""Recurrent language models on txl's trainer: AWD-LSTM and SHA-RNN (issue 19).

`arch = "lstm"`: AWD-LSTM (Merity, Keskar & Socher 2018, arXiv 1708.02182). Embedding with
whole-word embedding dropout (`dropout_embed`), locked (variational) dropout on the embeddings
(`dropout_input`), between layers (`dropout_hidden`) and on the output (`dropout`), n_layer LSTMs
whose hidden-to-hidden matrices are DropConnect-ed (`weight_drop`), tied embedding and softmax (the
last layer's size is d_model, the others' d_inner).

`arch = "sha-rnn"`: the Single Headed Attention RNN (Merity 2019, arXiv 1911.11423). n_layer blocks
of LayerNorm -> LSTM (d_model wide) -> single-head attention over [memory ; segment] (on the
penultimate block as the paper, or on every block with `rnn_attention = "all"`) -> Boom feed-forward
(d_model -> d_inner, GELU, the d_inner / d_model chunks summed back to d_model), with the paper's
LayerNorms (lnstart, lnmem, lnmid, lnff, lnxff) and residuals around attention and Boom. The
attention has a query projection + LayerNorm and no key/value projections: sigmoid gates on q, k
and an over-parameterised gate (σ(f)·tanh(c)) on v, as Merity's code.

Both follow `TransformerXL`'s forward contract (`out = model(input_ids, memory, labels)` with
`out.logits, .loss, .nll, .memory, .hidden`). The memory (`RecurrentMemory`) is every layer's LSTM
state (h, c) at the end of the segment and, for SHA-RNN, the attention memory: the latest `mem_len`
LayerNorm-ed states each attention layer attended over; all detached (truncated BPTT). `mem_len = 0`
carries nothing across segments (every segment starts from a zero state: the vanilla setting).
Every LSTM runs the fused `torch.lstm` op over the whole segment (no Python loop over time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.errors import UsageError
from txl.generate.decoder import generate_tokens
from txl.models.rnn.config import RNN_ARCHS, RecurrentConfig
from txl.models.transformer_xl.model import TransformerXLOutput
from txl.nn.memory import Memory, MemoryState, register_pytree
from txl.nn.regularization import embedding_dropout, locked_dropout

EMBED_INIT = 0.1  # AWD-LSTM's initrange


@dataclass(frozen=True)
class RecurrentMemory(Memory):
    """The state an RNN LM carries across segments, batch-first, detached (the `MemoryState`
    interface, txl/nn/memory.py).

    states: per LSTM layer h then c, each (b, hidden size): 2 * n_layer tensors.
    hidden: per attention layer (SHA-RNN) the attention memory (b, length, d_model); empty for lstm,
        so `length` is the attention memory's length (0 for lstm). `context(slot, fresh)` is what
        attention layer `slot` attends to, [memory ; fresh], as for a Transformer's layers.
    """

    states: tuple[Tensor, ...] = ()

    @property
    def batch_size(self) -> int:
        return self.states[0].shape[0]

    def state(self, layer: int) -> tuple[Tensor, Tensor] | None:
        """LSTM layer `layer`'s (h, c), or None (a zero state) when nothing is carried."""
        return (self.states[2 * layer], self.states[2 * layer + 1]) if self.states else None

    def update(self, contexts: Sequence[Tensor], *, mem_len: int, detach: bool = True,
               states: Sequence[Tensor] = ()) -> RecurrentMemory | None:
        """The next memory: each attention layer's latest mem_len states of `contexts`, and the LSTM
        `states` (h then c per layer) after the segment; detached (truncated BPTT). None at mem_len 0."""
        if mem_len <= 0:
            return None
        cut = (lambda t: t.detach()) if detach else (lambda t: t)
        return RecurrentMemory(tuple(cut(c[:, -mem_len:]) for c in contexts), states=tuple(cut(s) for s in states))

    def tensors(self) -> tuple[Tensor, ...]:
        return (*self.hidden, *self.states)

    def to(self, *args, **kwargs) -> RecurrentMemory:
        return RecurrentMemory(tuple(h.to(*args, **kwargs) for h in self.hidden),
                               states=tuple(s.to(*args, **kwargs) for s in self.states))

    def detach(self) -> RecurrentMemory:
        return RecurrentMemory(tuple(h.detach() for h in self.hidden), states=tuple(s.detach() for s in self.states))

    def select(self, index: Tensor | slice | int) -> RecurrentMemory:
        if isinstance(index, int):
            index = slice(index, index + 1)
        return RecurrentMemory(tuple(h[index] for h in self.hidden), states=tuple(s[index] for s in self.states))

    @classmethod
    def cat(cls, parts: Sequence[RecurrentMemory]) -> RecurrentMemory:
        return cls(tuple(torch.cat(layer) for layer in zip(*(p.hidden for p in parts), strict=True)),
                   states=tuple(torch.cat(layer) for layer in zip(*(p.states for p in parts), strict=True)))

    def truncate(self, mem_len: int) -> RecurrentMemory | None:
        """The latest mem_len attention states (the LSTM states are kept); None at mem_len 0."""
        if mem_len <= 0:
            return None
        return RecurrentMemory(tuple(h[:, -mem_len:] for h in self.hidden), states=self.states)

    def state_dict(self, prefix: str = "memory") -> dict[str, Tensor]:
        out = {f"{prefix}.{i}": h.detach().contiguous() for i, h in enumerate(self.hidden)}
        out.update({f"{prefix}_state.{i}": s.detach().contiguous() for i, s in enumerate(self.states)})
        return out

    @classmethod
    def from_state_dict(cls, tensors: dict[str, Tensor], prefix: str = "memory") -> RecurrentMemory | None:
        def layers(name_prefix: str) -> tuple[Tensor, ...]:
            found = sorted((int(name[len(name_prefix) + 1:]), t) for name, t in tensors.items()
                           if name.startswith(name_prefix + ".") and name[len(name_prefix) + 1:].isdigit())
            return tuple(t for _, t in found)

        states = layers(f"{prefix}_state")
        return cls(layers(prefix), states=states) if states else None


register_pytree(RecurrentMemory, ("hidden", "compressed", "states"), ("donated",))


class DropConnectLSTM(nn.Module):
    """One LSTM layer whose hidden-to-hidden matrix is DropConnect-ed in training (AWD-LSTM's
    WeightDrop), run by the fused `torch.lstm` op over the whole segment. The weights keep
    nn.LSTM's names (weight_ih_l0, weight_hh_l0, bias_ih_l0, bias_hh_l0) and init."""

    def __init__(self, input_size: int, hidden_size: int, *, weight_drop: float):
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size, batch_first=True)
        self.hidden_size = hidden_size
        self.weight_drop = weight_drop

    def weights(self) -> list[Tensor]:
        lstm = self.lstm
        w_hh = F.dropout(lstm.weight_hh_l0, self.weight_drop, training=self.training) if self.weight_drop else lstm.weight_hh_l0
        return [lstm.weight_ih_l0, w_hh, lstm.bias_ih_l0, lstm.bias_hh_l0]

    def forward(self, x: Tensor, state: tuple[Tensor, Tensor] | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x (b, t, input) -> (b, t, hidden), and (h, c) each (b, hidden) after the last step."""
        if state is None:
            zeros = x.new_zeros(1, x.shape[0], self.hidden_size)
            hx = [zeros, zeros]
        else:
            hx = [s.to(x.dtype)[None] for s in state]  # (1, b, hidden)
        out, h, c = torch.lstm(x, hx, self.weights(), True, 1, 0.0, self.training, False, True)
        return out, (h[0], c[0])


# ---------------------------------------------------------------------------------------------
# SHA-RNN's pieces (Merity 2019, §3; github.com/Smerity/sha-rnn model.py)


class Boom(nn.Module):
    """Linear(d_model -> d_inner), GELU, dropout, then the d_inner / d_model chunks summed back to d_model
    (no second matrix: the paper's saving over a Transformer FFN)."""

    def __init__(self, d_model: int, d_inner: int, dropout: float):
        super().__init__()
        self.fc = nn.Linear(d_model, d_inner)
        self.drop = nn.Dropout(dropout)
        self.d_model = d_model

    def forward(self, x: Tensor) -> Tensor:
        up = self.drop(F.gelu(self.fc(x)))  # (b, t, d_inner)
        return up.view(*up.shape[:-1], -1, self.d_model).sum(dim=-2)  # (b, t, chunks, d_model) -> (b, t, d_model)


class SingleHeadAttention(nn.Module):
    """One head over [memory ; segment]: q = σ(g_q)·LN(W_q h), k = σ(g_k)·key, v = σ(f)·tanh(c)·value
    with (c, f) = W_v g_v (the over-parameterised value gate); scaled dot product, causal."""

    def __init__(self, d_model: int, *, dropatt: float, eps: float):
        super().__init__()
        self.q = nn.Linear(d_model, d_model)
        self.q_norm = nn.LayerNorm(d_model, eps=eps)
        self.q_gate = nn.Parameter(torch.zeros(d_model))
        self.k_gate = nn.Parameter(torch.zeros(d_model))
        self.v_gate = nn.Parameter(torch.zeros(d_model))
        self.v_overparam = nn.Linear(d_model, 2 * d_model)
        self.dropatt = dropatt
        self.d_model = d_model

    def forward(self, h: Tensor, context: Tensor) -> Tensor:
        """h (b, t, d) queries; context (b, m + t, d) keys = values, the last t being the segment."""
        c, f = self.v_overparam(self.v_gate).split(self.d_model)
        q = torch.sigmoid(self.q_gate) * self.q_norm(self.q(h))  # (b, t, d)
        k = torch.sigmoid(self.k_gate) * context  # (b, m + t, d)
        v = torch.sigmoid(f) * torch.tanh(c) * context
        t, keys = h.shape[1], context.shape[1]
        # query i sits at key position keys - t + i and sees every key up to it
        allowed = torch.ones(t, keys, dtype=torch.bool, device=h.device).tril(diagonal=keys - t)  # (t, m + t)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed,
                                              dropout_p=self.dropatt if self.training else 0.0)


class SHABlock(nn.Module):
    """LN -> LSTM -> (LN'd attention over [memory ; segment], residual) -> Boom (residual)."""

    def __init__(self, config: RecurrentConfig, *, attention: bool):
        super().__init__()
        d, eps = config.d_model, config.layer_norm_eps
        self.ln_start = nn.LayerNorm(d, eps=eps)
        self.rnn = DropConnectLSTM(d, d, weight_drop=config.weight_drop)
        self.attn = SingleHeadAttention(d, dropatt=config.dropatt, eps=eps) if attention else None
        self.ln_mem = nn.LayerNorm(d, eps=eps) if attention else None
        self.ln_mid = nn.LayerNorm(d, eps=eps) if attention else None
        self.ln_ff = nn.LayerNorm(d, eps=eps)
        self.ln_xff = nn.LayerNorm(d, eps=eps)
        self.ff = Boom(d, config.d_inner, config.dropout_hidden)
        self.drop = nn.Dropout(config.dropout_hidden)

    def forward(self, h: Tensor, *, state: tuple[Tensor, Tensor] | None, memory: MemoryState,
                slot: int | None) -> tuple[Tensor, tuple[Tensor, Tensor], Tensor | None]:
        """h (b, t, d) -> (b, t, d), the LSTM state, and what this block's attention attended over,
        [memory ; segment] (`memory.context(slot, ...)`; None without attention)."""
        h, state = self.rnn(self.ln_start(h), state)
        h = self.drop(h)
        context = None
        if self.attn is not None:
            context = memory.context(slot, self.ln_mem(h))  # (b, m + t, d)
            h = self.ln_mid(h)
            h = h + self.drop(self.attn(h, context))
        h, x = self.ln_ff(h), self.ln_xff(h)
        return h + self.drop(self.ff(x)), state, context


# ---------------------------------------------------------------------------------------------
# The language model


class RecurrentLM(nn.Module):
    """AWD-LSTM (`arch = "lstm"`) or SHA-RNN (`arch = "sha-rnn"`) with `TransformerXL`'s contract:
    `out = model(input_ids, memory=None, labels=None, *, mem_len=None)`; labels already shifted,
    -100 unscored. `mem_len` (per call, default `model.mem_len`): SHA-RNN's attention memory length;
    for both, 0 = carry nothing across segments."""

    def __init__(self, config: RecurrentConfig):
        super().__init__()
        if config.arch not in RNN_ARCHS:
            raise UsageError(f"RecurrentLM builds arch 'lstm' or 'sha-rnn', not {config.arch!r}")
        self.config = config
        self.mem_len = config.mem_len
        self.clamp_len = 0  # transformer runtime settings, fixed (evaluation reads them)
        self.same_length = False
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        if config.arch == "lstm":
            sizes = [config.d_inner] * (config.n_layer - 1) + [config.d_model]  # the last one feeds the tied softmax
            inputs = [config.d_model] + sizes[:-1]
            self.layers = nn.ModuleList(DropConnectLSTM(i, o, weight_drop=config.weight_drop) for i, o in zip(inputs, sizes))
            self.attention_layers: tuple[int, ...] = ()
        else:
            every = config.rnn_attention == "all"
            self.attention_layers = tuple(range(config.n_layer)) if every else (max(config.n_layer - 2, 0),)
            self.layers = nn.ModuleList(SHABlock(config, attention=i in self.attention_layers)
                                        for i in range(config.n_layer))
        # the softmax: tied = the embedding matrix itself (read, not registered twice: safetensors stores
        # each tensor once), else its own matrix
        self.head_weight = None if config.tie_weight else nn.Parameter(torch.empty(config.vocab_size, config.d_model))
        self.head_bias = nn.Parameter(torch.zeros(config.vocab_size))
        # AWD-LSTM's init: U(-0.1, 0.1) embeddings (N(0, 0.02) leaves an LSTM on the unigram plateau for
        # hundreds of steps: measured on PTB-char at 1M parameters), the LSTMs' and Linears' torch defaults
        nn.init.uniform_(self.embed.weight, -EMBED_INIT, EMBED_INIT)
        if self.head_weight is not None:
            nn.init.uniform_(self.head_weight, -EMBED_INIT, EMBED_INIT)

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:  # the input table and the softmax (its bias and, untied, its matrix)
            for p in (self.embed.weight, self.head_weight, self.head_bias):
                params.pop(id(p), None)
        return sum(p.numel() for p in params.values())

    def forward(
        self,
        input_ids: Tensor,
        memory: Memory | None = None,
        labels: Tensor | None = None,
        *,
        attention_mask: Tensor | None = None,
        mem_len: int | None = None,
        clamp_len: int | None = None,
        same_length: bool | None = None,
        return_logits: bool | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        global_mask: Tensor | None = None,
    ) -> TransformerXLOutput:
        arch = self.config.arch
        if input_ids.dim() != 2:
            raise UsageError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
        for name, used in (("clamp_len", bool(clamp_len)), ("same_length", bool(same_length)),
                           ("output_attentions", output_attentions), ("global_mask", global_mask is not None)):
            if used:
                raise UsageError(f"{name} is a Transformer setting; arch={arch!r} has no attention to apply it to")
        if attention_mask is not None and not bool((attention_mask != 0).all()):
            raise UsageError(f"attention_mask with padding is not supported by arch={arch!r} (padding would "
                             "enter the recurrent state); run unpadded sequences")
        mem_len = self.mem_len if mem_len is None else mem_len
        if mem_len < 0:
            raise UsageError(f"mem_len must be >= 0, got {mem_len}")
        if memory is not None and not isinstance(memory, RecurrentMemory):
            raise UsageError(f"arch={arch!r} takes the memory its own forward returned (a RecurrentMemory), "
                             f"not a {type(memory).__name__}")
        batch, q_len = input_ids.shape
        if memory is not None and (len(memory.states) != 2 * len(self.layers)
                                   or len(memory.hidden) not in (0, len(self.attention_layers))):
            raise UsageError(f"memory holds {len(memory.states)} LSTM states and {len(memory.hidden)} attention "
                             f"memories; this model carries {2 * len(self.layers)} and {len(self.attention_layers)} "
                             "(is it another model's memory?)")
        if memory is not None and memory.batch_size != batch:
            raise UsageError(f"memory holds batch {memory.batch_size} but input_ids has batch {batch}")
        cfg = self.config
        weight = embedding_dropout(self.embed.weight, cfg.dropout_embed, self.training)
        h = locked_dropout(F.embedding(input_ids, weight), cfg.dropout_input, self.training)  # (b, t, d_model)
        past = RecurrentMemory(()) if memory is None else memory  # nothing carried: zero states, no attention memory
        hidden_states, states, contexts = [], [], []
        for i, layer in enumerate(self.layers):
            hidden_states.append(h)
            if arch == "lstm":
                h, state = layer(h, past.state(i))
                if i < len(self.layers) - 1:
                    h = locked_dropout(h, cfg.dropout_hidden, self.training)
            else:
                slot = self.attention_layers.index(i) if i in self.attention_layers else None
                h, state, context = layer(h, state=past.state(i), memory=past, slot=slot)
                if context is not None:
                    contexts.append(context)
            states.extend(state)
        hidden_states.append(h)
        h = locked_dropout(h, cfg.dropout, self.training)
        new_memory = past.update(contexts, mem_len=mem_len, states=states)

        head = self.embed.weight if self.head_weight is None else self.head_weight
        logits = F.linear(h, head, self.head_bias)  # (b, t, V)
        loss = nll = None
        if labels is not None:
            nll = F.cross_entropy(logits.float().reshape(batch * q_len, -1), labels.reshape(-1), ignore_index=-100,
                                  reduction="none").view(batch, q_len)
            loss = nll.sum() / (labels != -100).sum().clamp(min=1)
        if return_logits is False:
            logits = None
        return TransformerXLOutput(logits=logits, loss=loss, nll=nll, memory=new_memory, hidden=h,
                                   hidden_states=tuple(hidden_states) if output_hidden_states else None)

    def generate(self, input_ids: Tensor, max_new_tokens: int, **kwargs) -> Tensor:
        """As `TransformerXL.generate`: the prompt, then up to max_new_tokens tokens, carrying the state."""
        return generate_tokens(self, input_ids, max_new_tokens, **kwargs)

    def save_pretrained(self, directory) -> None:
        """`config.json` + `model.safetensors`, as `TransformerXL.save_pretrained`."""
        from txl.models.pretrained import save_model

        save_model(self, directory)

    @classmethod
    def from_pretrained(cls, directory, *, map_location="cpu", **overrides) -> RecurrentLM:
        """Load what `save_pretrained` or `txl train` wrote (checked as `TransformerXL.from_pretrained`)."""
        from txl.models.registry import load_model

        model = load_model(directory, map_location=map_location, **overrides)
        if not isinstance(model, cls):
            raise UsageError(f"{directory} holds arch={model.config.arch!r}, not a recurrent LM; load it with "
                             "TransformerXL.from_pretrained")
        return model


__all__ = ["RecurrentLM", "RecurrentMemory", "RNN_ARCHS", "embedding_dropout", "locked_dropout"]
