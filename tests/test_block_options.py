"""Recurrence variants and block options of the Transformer-XL family (issue 47 items 4 and 5): ERNIE-Doc's
same-layer memory, GTrXL's gated residual, RMSNorm, GELU / SwiGLU / GeGLU, grouped- and multi-query
attention, qk-norm. Each option's defining property, segment invariance with memory (where the option
keeps it), fast = eager, a short training run through the trainer, and generation with memory.

Tolerances: logits 1e-5, gradients 1e-4 (fp32, dropout off)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import helpers
from helpers import train_losses, write_config
from tiny_models import build, tiny, two_segments_vs_one_pass
from txl.errors import ConfigError
from txl.generate.decoder import generate, generate_rerun
from txl.models.transformer_xl.config import TransformerXLConfig
from txl.models.transformer_xl.model import TransformerXL
from txl.nn.attention.eager import eager_attention
from txl.nn.attention.layer import split_kv
from txl.nn.attention.masks import AttentionMask
from txl.nn.gating import GATE_BIAS, GRUGate
from txl.nn.memory import Memory
from txl.nn.positional import CONTENT_ONLY

corpus, cache_dir = helpers.corpus, helpers.cache_dir  # fixtures

# name -> config overrides; every option alone, a few together
OPTIONS = {
    "same-layer": dict(memory_source="same-layer"),
    "gru-gate": dict(pre_lnorm=True, residual="gru-gate"),
    "rmsnorm": dict(norm="rmsnorm"),
    "rmsnorm-pre-ln": dict(norm="rmsnorm", pre_lnorm=True),
    "gelu": dict(ffn="gelu"),
    "swiglu": dict(ffn="swiglu"),
    "geglu": dict(ffn="geglu"),
    "gqa": dict(n_kv_head=2),
    "mqa": dict(n_kv_head=1),
    "qk-norm": dict(qk_norm=True),
    "gqa-qk-norm-memory-tokens": dict(n_kv_head=2, qk_norm=True, memory_tokens=2),
    "gtrxl-modern": dict(pre_lnorm=True, residual="gru-gate", norm="rmsnorm", ffn="swiglu", n_kv_head=1, qk_norm=True),
}
# ERNIE-Doc's recurrence gives up segment invariance by design (its memory is a layer above the segment's own states)
INVARIANT = [name for name, options in OPTIONS.items() if options.get("memory_source") != "same-layer"]
ERNIE = {**OPTIONS["gtrxl-modern"], "memory_source": "same-layer"}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _ids(model, batch=2, length=16, seed=3):
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# defaults and config checks


def test_defaults_are_the_papers_and_build_the_papers_modules():
    config = TransformerXLConfig()
    assert (config.memory_source, config.residual, config.norm, config.ffn, config.n_kv_head, config.qk_norm) == (
        "previous-layer", "add", "layernorm", "relu", None, False)
    model = build()
    names = set(model.state_dict())
    assert not any(("gate" in n or "q_norm" in n or "k_norm" in n) for n in names)
    block = model.blocks[0]
    assert type(block.attn_norm) is torch.nn.LayerNorm and block.attn_gate is None
    assert block.attn.kv_proj.weight.shape == (2 * 4 * 8, 32) and block.ff.fc1.weight.shape == (48, 32)
    assert model.memory_kind is not None and not block.keeps_output
    # a config.json written before these fields (no such keys) loads with the paper's block
    old = {k: v for k, v in tiny().to_dict().items() if k not in ("memory_source", "residual", "norm", "ffn",
                                                                   "n_kv_head", "qk_norm")}
    assert TransformerXLConfig.from_dict(old) == tiny()


@pytest.mark.parametrize("overrides, message", [
    (dict(n_kv_head=3), "config.n_kv_head=3 must divide n_head=4"),
    (dict(n_kv_head=0), "config.n_kv_head=0 must divide n_head=4"),
    (dict(n_kv_head=8), "config.n_kv_head=8 must divide n_head=4"),
    (dict(residual="gru-gate"), "config.residual='gru-gate' is GTrXL's gate on the identity-map (pre-LN) block: "
                                "set pre_lnorm=true"),
    (dict(cmem_len=4, memory_source="same-layer"), "memory_source='same-layer'"),
    (dict(cmem_len=4, n_kv_head=2), "n_kv_head=2"),
    (dict(cmem_len=4, qk_norm=True, norm="rmsnorm"), "norm='rmsnorm', qk_norm=True"),
    (dict(ffn="swish"), "config.ffn"),
    (dict(norm="batchnorm"), "config.norm"),
    (dict(memory_source="same_layer"), "config.memory_source"),
])
def test_impossible_combinations_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        tiny(**overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_parameter_estimate_stays_a_lower_bound():
    for options in OPTIONS.values():
        model = build(**options)
        blocks = sum(p.numel() for p in model.blocks.parameters())
        assert model.config.num_parameters_estimate() <= blocks


# ---------------------------------------------------------------------------------------------
# ERNIE-Doc: same-layer memory


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("mem_len", [16, 5])
def test_same_layer_memory_is_each_layers_output_of_the_previous_segment(backend, mem_len):
    same = build(memory_source="same-layer", backend=backend)
    previous = build(backend=backend)  # same seed: the same weights
    assert all(torch.equal(a, b) for a, b in zip(same.state_dict().values(), previous.state_dict().values()))
    ids = _ids(same)
    with torch.no_grad():
        first = same(ids[:, :8], mem_len=mem_len, output_hidden_states=True)
        outputs = first.hidden_states[1:]  # layer i's output = layer i+1's input; the last = the top block's
        for i, states in enumerate(outputs):
            assert torch.equal(first.memory.hidden[i], states[:, -mem_len:])
        # the previous-layer memory keeps each layer's input instead
        assert torch.equal(previous(ids[:, :8], mem_len=mem_len).memory.hidden[0], first.hidden_states[0][:, -mem_len:])
        # next segment: attending over the outputs = the paper's layer given those outputs as its memory
        second = same(ids[:, 8:], memory=first.memory, mem_len=mem_len, output_hidden_states=True)
        given = Memory(tuple(s[:, -mem_len:] for s in outputs))
        reference = previous(ids[:, 8:], memory=given, mem_len=mem_len)
    assert (second.logits - reference.logits).abs().max().item() < 1e-5
    for i, states in enumerate(second.hidden_states[1:]):  # and its memory: the tail of [outputs ; outputs]
        expected = torch.cat([first.memory.hidden[i], states], dim=1)[:, -mem_len:]
        assert (second.memory.hidden[i] - expected).abs().max().item() < 1e-6


def test_same_layer_memory_gives_up_segment_invariance_by_design():
    """Within a segment a position sees its neighbours' layer l-1 states, across segments their layer l
    states: one pass over [s1 ; s2] is not two passes (ERNIE-Doc trades this for a longer context)."""
    assert two_segments_vs_one_pass(build(memory_source="same-layer")) > 1e-3
    assert two_segments_vs_one_pass(build()) < 1e-5


def test_same_layer_memory_in_the_universal_transformer_keeps_each_steps_output():
    model = build(memory_source="same-layer", universal=True, n_layer=3)
    ids = _ids(model)
    with torch.no_grad():
        out = model(ids[:, :8], mem_len=8)
        nxt = model(ids[:, 8:], memory=out.memory, mem_len=8)
    assert len(out.memory.hidden) == 3 and torch.isfinite(nxt.logits).all()
    # step t's memory is step t's output, which is step t+1's input before its step signal
    signal = model.universal.step_signal(1, ids.float())
    inputs = []
    model.blocks[0].register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    with torch.no_grad():
        model(ids[:, :8], mem_len=8)
    assert (out.memory.hidden[0] - (inputs[1] - signal)).abs().max().item() < 1e-6


# ---------------------------------------------------------------------------------------------
# GTrXL: the gated residual


def _gate_by_hand(gate: GRUGate, x, y):
    d = x.shape[-1]
    w_r, w_z, w_g = gate.w.weight.split(d)
    u_r, u_z = gate.u.weight.split(d)
    r = torch.sigmoid(y @ w_r.T + x @ u_r.T)
    z = torch.sigmoid(y @ w_z.T + x @ u_z.T - gate.gate_bias)
    candidate = torch.tanh(y @ w_g.T + (r * x) @ gate.u_g.weight.T)
    return (1 - z) * x + z * candidate, z


def test_the_gru_gate_is_the_papers_formula():
    torch.manual_seed(0)
    gate = GRUGate(8)
    for p in gate.parameters():
        torch.nn.init.normal_(p, 0.0, 0.5)
    x, y = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    expected, _ = _gate_by_hand(gate, x, y)
    assert (gate(x, y) - expected).abs().max().item() < 1e-6


def test_the_gated_block_is_gtrxls_identity_map_reordering():
    """Y = g(x, ReLU(MHA(LN(x)))), E = g(Y, ReLU(FFN(LN(Y)))) (Parisotto et al. 2019, eq. 7-10)."""
    block = build(pre_lnorm=True, residual="gru-gate").blocks[0]
    x, mask = torch.randn(2, 6, 32), AttentionMask(causal=True)
    with torch.no_grad():
        out, _ = block(x, memory=None, positions=CONTENT_ONLY, mask=mask)
        attended, _ = block.attn(block.attn_norm(x), positions=CONTENT_ONLY, mask=mask)
        y = block.attn_gate(x, F.relu(attended))
        expected = block.ff_gate(y, F.relu(block.ff(block.ff_norm(y))))
    assert (out - expected).abs().max().item() < 1e-6


def test_the_gate_starts_near_the_identity():
    """At initialisation z ≈ σ(-b_g) = σ(-2) ≈ 0.12 (b_g = 2, the paper's), so g(x, y) = x + z·(ĥ - x) stays
    within z·(|x| + 1) of x; with the gate closed (large b_g) a whole block is the identity map."""
    torch.manual_seed(0)
    model = TransformerXL(tiny(pre_lnorm=True, residual="gru-gate", d_model=64, n_head=4, d_head=16)).eval()
    gates = [m for m in model.modules() if isinstance(m, GRUGate)]
    assert len(gates) == 4 and all(torch.equal(g.gate_bias, torch.full((64,), GATE_BIAS)) for g in gates)
    x, y = torch.randn(4, 8, 64), F.relu(torch.randn(4, 8, 64))
    with torch.no_grad():
        for gate in gates:
            out, z = _gate_by_hand(gate, x, y)
            assert abs(z.mean().item() - 1 / (1 + math.exp(GATE_BIAS))) < 0.01 and z.max().item() < 0.3
            assert ((out - x).abs() <= z * (x.abs() + 1) + 1e-6).all()
        block = model.blocks[0]
        for gate in (block.attn_gate, block.ff_gate):
            gate.gate_bias.fill_(40.0)
        out, _ = block(x, memory=None, positions=CONTENT_ONLY, mask=AttentionMask(causal=True))
    assert (out - x).abs().max().item() < 1e-6


# ---------------------------------------------------------------------------------------------
# RMSNorm, the feed-forward variants


def test_rmsnorm_is_x_over_its_root_mean_square_times_a_gain():
    model = build(norm="rmsnorm", pre_lnorm=True)
    eps = model.config.layer_norm_eps
    x = torch.randn(2, 5, 32)
    for norm in (model.blocks[0].attn_norm, model.blocks[1].ff_norm, model.norm):
        assert isinstance(norm, torch.nn.RMSNorm) and [n for n, _ in norm.named_parameters()] == ["weight"]
        expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm.weight
        assert (norm(x) - expected).abs().max().item() < 1e-6


@pytest.mark.parametrize("ffn, act", [("swiglu", F.silu), ("geglu", F.gelu), ("gelu", None)])
def test_feed_forward_variants_are_shazeers_formulas(ffn, act):
    """GLU variants (Shazeer 2020): (act(x W + b) ⊙ (x V + c)) W2 + b2, with d_inner the gated width:
    fc1 is 2·d_inner wide ([value ; gate]), 3·d_model·d_inner weights in all."""
    ff = build(ffn=ffn).blocks[0].ff
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        hidden = x @ ff.fc1.weight.T + ff.fc1.bias
        if act is None:
            assert ff.fc1.weight.shape == (48, 32)
            inner = F.gelu(hidden)
        else:
            assert ff.fc1.weight.shape == (2 * 48, 32) and ff.fc2.weight.shape == (32, 48)
            value, gate = hidden.split(48, dim=-1)
            inner = act(gate) * value
        expected = inner @ ff.fc2.weight.T + ff.fc2.bias
        assert (ff(x) - expected).abs().max().item() < 1e-6


# ---------------------------------------------------------------------------------------------
# grouped-query and multi-query attention


def _as_multi_head(gqa: TransformerXL) -> TransformerXL:
    """The n_head-head model whose key/value heads repeat the GQA model's (each serving its query group)."""
    config = gqa.config
    mha = TransformerXL(config.replace(n_kv_head=None)).eval()
    groups = config.n_head // config.kv_heads
    state = {}
    for name, tensor in gqa.state_dict().items():
        if name.endswith("attn.kv_proj.weight"):  # (2·kv_h·d, d_model) -> (2·h·d, d_model)
            tensor = tensor.view(2, config.kv_heads, config.d_head, -1).repeat_interleave(groups, dim=1).flatten(0, 2)
        elif name.endswith("attn.memory_tokens"):  # (2, kv_h, m, d) -> (2, h, m, d)
            tensor = tensor.repeat_interleave(groups, dim=1)
        state[name] = tensor
    mha.load_state_dict(state)
    return mha


@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_grouped_query_attention_is_multi_head_attention_with_shared_key_value_heads(n_kv_head, backend):
    gqa = build(n_kv_head=n_kv_head, memory_tokens=2, qk_norm=True, backend=backend)
    mha = _as_multi_head(gqa)
    assert gqa.blocks[0].attn.kv_proj.weight.shape == (2 * n_kv_head * 8, 32)
    assert gqa.blocks[0].attn.memory_tokens.shape == (2, n_kv_head, 2, 8)
    ids = _ids(gqa)
    memories = {}
    for name, model in (("gqa", gqa), ("mha", mha)):
        memory, logits = None, []
        with torch.no_grad():
            for segment in ids.split(8, dim=1):
                out = model(segment, memory=memory)
                memory = out.memory
                logits.append(out.logits)
        memories[name] = (torch.cat(logits, dim=1), memory)
    assert (memories["gqa"][0] - memories["mha"][0]).abs().max().item() < 1e-5
    # the memory keeps the layer inputs, d_model wide whatever the heads: GQA changes nothing there
    assert all(torch.equal(a, b) for a, b in zip(memories["gqa"][1].hidden, memories["mha"][1].hidden))
    if n_kv_head == 4:  # n_kv_head = n_head is multi-head attention itself
        assert all(torch.equal(a, b) for a, b in zip(gqa.state_dict().values(), build(backend=backend, memory_tokens=2,
                                                                                         qk_norm=True).state_dict().values()))


def test_the_projection_cache_holds_only_the_key_value_heads():
    """The fast backend's generation cache keeps projected keys and values: 2·n_kv_head·d_head wide."""
    model = build(n_kv_head=1, mem_len=16)
    ids = _ids(model, batch=1)
    with torch.no_grad():
        memory = model(ids[:, :8]).memory
        for token in ids[0, 8:11]:
            memory = model(token.view(1, 1), memory=memory).memory
    assert type(memory).__name__ == "ProjectionCache"
    assert all(p.shape == (1, 11, 2 * 1 * 8) for p in memory.projected)
    assert all(h.shape == (1, 11, 32) for h in memory.hidden)


# ---------------------------------------------------------------------------------------------
# qk-norm


def test_qk_norm_normalises_q_and_k_per_head_before_the_scores():
    attn = build(qk_norm=True).blocks[0].attn
    eps = 1e-5
    x, mask = 10 * torch.randn(2, 6, 32), AttentionMask(causal=True)  # (q·q and k·k >> eps: scale-free below)

    def rms(t, gain):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps) * gain

    with torch.no_grad():
        q = attn.q_proj(x).view(2, 6, 4, 8).transpose(1, 2)  # (b, h, i, d)
        k, v = split_kv(attn.kv_proj(x), 4)
        out, _ = eager_attention(rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight), v, positions=CONTENT_ONLY,
                                 mask=mask, dropatt=0.0, training=False)
        expected = attn.o_proj(out.transpose(1, 2).reshape(2, 6, 32))
        assert (attn(x, mask=mask)[0] - expected).abs().max().item() < 1e-6
        # so the scores no longer grow with the scale of W_q and W_k (up to eps)
        attn.q_proj.weight.mul_(10.0)
        attn.kv_proj.weight[:32].mul_(10.0)
        assert (attn(x, mask=mask)[0] - expected).abs().max().item() < 1e-5
    assert attn.q_norm.weight.shape == (8,) and attn.k_norm.weight.shape == (8,)


# ---------------------------------------------------------------------------------------------
# every option: segment invariance, fast = eager, training, generation


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("name", INVARIANT)
def test_two_segments_with_memory_equal_one_pass(name, backend):
    assert two_segments_vs_one_pass(build(backend=backend, **OPTIONS[name])) < 1e-5


@pytest.mark.parametrize("name", [*OPTIONS, "ernie-gtrxl-modern"])
def test_the_fast_backend_equals_the_eager_reference(name):
    """backend auto + the fast kernel against backend reference + the eager kernel, same weights: logits
    over three segments with memory (training mode, dropout off, so the fast training paths run) and
    every parameter's gradient."""
    options = ERNIE if name == "ernie-gtrxl-modern" else OPTIONS[name]
    fast = build(backend="auto", attention_impl="fast", **options).train()
    eager = build(backend="reference", attention_impl="eager", **options).train()
    ids = _ids(fast, length=24)
    logits = []
    for model in (fast, eager):
        memory, total, outs = None, 0.0, []
        for segment in ids.split(8, dim=1):
            out = model(segment, memory=memory, labels=segment.roll(-1, dims=1))
            memory, total = out.memory, total + out.loss
            outs.append(out.logits)
        total.backward()
        logits.append(torch.cat(outs, dim=1))
    assert (logits[0] - logits[1]).abs().max().item() < 1e-5
    for (name_f, p_f), (_, p_e) in zip(fast.named_parameters(), eager.named_parameters()):
        assert (p_f.grad - p_e.grad).abs().max().item() < 1e-4, name_f


@pytest.mark.parametrize("name", [*OPTIONS, "ernie-gtrxl-modern"])
def test_generation_with_memory(name):
    """Greedy decoding token by token with the memory equals feeding the model one token at a time by hand
    (and, for the options that keep segment invariance, re-running the whole context every step)."""
    options = ERNIE if name == "ernie-gtrxl-modern" else OPTIONS[name]
    model = build(mem_len=64, **options)
    prompt = _ids(model, batch=1, length=12)[0].tolist()
    tokens = generate(model, prompt, max_new_tokens=10, temperature=0.0, mem_len=64, segment_len=12)
    by_hand = []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), mem_len=64)
        for _ in range(10):
            token = int(out.logits[0, -1].argmax())
            by_hand.append(token)
            out = model(torch.tensor([[token]]), memory=out.memory, mem_len=64)
    assert tokens == by_hand
    if name in INVARIANT:
        assert tokens == generate_rerun(model, prompt, max_new_tokens=10)


@pytest.mark.parametrize("name", ["same-layer", "gru-gate", "rmsnorm", "swiglu", "geglu", "gelu", "mqa", "qk-norm"])
def test_three_training_steps_through_the_trainer(tmp_path, corpus, name):
    """`txl train --set ...` with each option: three steps, finite losses, and the checkpoint loads back
    as the same model."""
    from txl.train import LAST, Trainer
    from txl.train.config import build_run_config

    sets = [f"model.{key}={str(value).lower() if isinstance(value, bool) else value}"
            for key, value in OPTIONS[name].items()]
    config = write_config(tmp_path, corpus, steps=3, dropout=0.1)
    run = build_run_config(config_file=config, sets=[*sets, "save_interval=3"])
    trainer = Trainer(run, tmp_path / "run", quiet=True)
    trainer.fit()
    losses = train_losses(tmp_path / "run")
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(v) for v in losses.values())
    loaded = TransformerXL.from_pretrained(tmp_path / "run" / LAST)
    for key, value in OPTIONS[name].items():
        assert getattr(loaded.config, key) == value
    trained = trainer.model.state_dict()
    assert all(torch.equal(tensor, trained[key].cpu()) for key, tensor in loaded.state_dict().items())


@pytest.mark.parametrize("impl", ["sdpa", "flex"])
@pytest.mark.parametrize("name", ["gqa-qk-norm-memory-tokens", "mqa", "ernie-gtrxl-modern"])
def test_the_fused_impls_take_the_options(impl, name):
    """The fused kernels get the layer's (b, n_head, n, d) q, k, v like every kernel: with the options they
    equal the eager reference over three segments with memory (inference)."""
    options = ERNIE if name == "ernie-gtrxl-modern" else OPTIONS[name]
    if options.get("memory_tokens"):  # the fused kernels hand memory tokens to the fast kernel
        options = {**options, "memory_tokens": 0}
    fused, eager = build(attention_impl=impl, **options), build(backend="reference", attention_impl="eager", **options)
    ids = _ids(fused, length=24)
    logits = []
    for model in (fused, eager):
        memory, outs = None, []
        with torch.no_grad():
            for segment in ids.split(8, dim=1):
                out = model(segment, memory=memory)
                memory = out.memory
                outs.append(out.logits)
        logits.append(torch.cat(outs, dim=1))
    assert (logits[0] - logits[1]).abs().max().item() < 1e-5
