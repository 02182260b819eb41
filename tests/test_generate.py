"""Generation: memory reuse = re-running the whole context (greedy, token for token), sampling
controls, the mem_len = 0 sliding window, text streaming, `txl generate`, and bad inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from txl import TransformerXLConfig
from txl.cli.main import main
from txl.data import Vocab
from txl.errors import DataError, UsageError
from txl.generate.decoder import generate, generate_rerun, generate_tokens, sample, stream_tokens
from txl.generate.text import TextStream, generate_text, sample_text
from txl.models.transformer_xl.model import TransformerXL


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from threads, and on a shared 2-core machine they lose 10× to contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_model(seed: int = 0, *, mem_len: int = 400, vocab_size: int = 256,
               pos_encoding: str = "xl") -> TransformerXL:
    """A random model whose logits are far from uniform (init_std 0.3), so greedy choices are never
    near-ties that float rounding could flip."""
    torch.manual_seed(seed)
    config = TransformerXLConfig(vocab_size=vocab_size, n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64,
                                 mem_len=mem_len, dropout=0.0, init_std=0.3, pos_encoding=pos_encoding)
    return TransformerXL(config).eval()


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> Path:
    """A random byte-level model saved the way the trainer saves one: config + weights + vocab.json."""
    path = tmp_path_factory.mktemp("gen") / "ckpt"
    tiny_model(mem_len=64).save_pretrained(path)
    Vocab("bytes").save(path / "vocab.json")
    return path


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_greedy_with_memory_reuse_equals_rerunning_the_whole_context():
    model = tiny_model()
    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    reused = generate(model, prompt, max_new_tokens=200, temperature=0.0, mem_len=400, segment_len=64)
    rerun = generate_rerun(model, prompt, max_new_tokens=200)
    assert len(reused) == 200
    assert reused == rerun
    assert len(set(reused)) > 5  # not a degenerate constant stream


def test_memory_never_exceeds_mem_len_while_generating():
    model = tiny_model(mem_len=24)
    seen = []
    forward = model.forward

    def spy(*args, **kwargs):
        memory = kwargs.get("memory")
        seen.append(0 if memory is None else memory.length)
        return forward(*args, **kwargs)

    model.forward = spy
    list(stream_tokens(model, list(range(100)), max_new_tokens=30, temperature=0.0, segment_len=16))
    assert max(seen) == 24  # per-step cost bounded by the attention length, not the text length


def test_sampling_is_reproducible_and_top_k_1_is_greedy():
    model = tiny_model()
    prompt = [5, 6, 7, 8]

    def sample(seed, **kw):
        return generate(model, prompt, max_new_tokens=40, generator=torch.Generator().manual_seed(seed), **kw)

    assert sample(3, temperature=1.0, top_k=10) == sample(3, temperature=1.0, top_k=10)
    assert sample(3, temperature=1.0) != sample(4, temperature=1.0)
    greedy = generate(model, prompt, max_new_tokens=40, temperature=0.0)
    assert sample(9, temperature=1.0, top_k=1) == greedy
    assert sample(9, temperature=0.7, top_p=1e-6) == greedy  # the nucleus keeps the top token only


def test_mem_len_zero_reruns_a_sliding_window():
    model = tiny_model(mem_len=0)
    prompt = list(range(10, 40))
    # a window holding the whole text: identical to re-running the full context every step
    windowed = generate(model, prompt, max_new_tokens=25, temperature=0.0, segment_len=100)
    assert windowed == generate_rerun(model, prompt, max_new_tokens=25)


def test_text_stream_spaces_words_and_joins_split_utf8():
    words = Vocab("words", ["<eos>", "<unk>", "the", "cat", "sat"], eos="<eos>", unk="<unk>")
    pieces = []
    stream = TextStream(words, pieces.append, prefix=words.encode("the cat"))
    for token in words.encode("sat\nthe"):
        stream.push(int(token))
    stream.close()
    assert "".join(pieces) == " sat\nthe"
    pieces = []
    stream = TextStream(Vocab("bytes"), pieces.append)
    for byte in "é!".encode():
        stream.push(byte)
    stream.close()
    assert "".join(pieces) == "é!" and pieces[0] == ""  # the first byte alone is not a character yet


def test_generate_text_streams_what_it_returns(ckpt_dir):
    model = TransformerXL.from_pretrained(ckpt_dir)
    pieces = []
    text = generate_text(model, Vocab("bytes"), "def f(", max_new_tokens=30, write=pieces.append, temperature=0.0)
    assert "".join(pieces) == text and len(pieces) >= 10


def test_cli_streams_the_same_text_as_the_api(ckpt_dir, capsys):
    code, out, err = run_cli(capsys, "generate", ckpt_dir, "--prompt", "import ", "--max-new-tokens", 40, "--greedy")
    assert code == 0, err
    model = TransformerXL.from_pretrained(ckpt_dir)
    expected = generate_text(model, Vocab("bytes"), "import ", max_new_tokens=40, temperature=0.0)
    assert out == "import " + expected + "\n"
    code, again, _ = run_cli(capsys, "generate", ckpt_dir, "--prompt", "import ", "--max-new-tokens", 40, "--seed",
                             "7", "--no-echo", "--top-p", "0.9")
    code2, same, _ = run_cli(capsys, "generate", ckpt_dir, "--prompt", "import ", "--max-new-tokens", 40, "--seed",
                             "7", "--no-echo", "--top-p", "0.9")
    assert code == code2 == 0 and again == same and not again.startswith("import ")


def test_prompt_file_and_word_vocabulary(tmp_path, capsys):
    path = tmp_path / "words"
    words = Vocab("words", ["<eos>", "<unk>", "the", "cat", "sat"], eos="<eos>", unk="<unk>")
    tiny_model(vocab_size=5, mem_len=32).save_pretrained(path)
    words.save(path / "vocab.json")
    (tmp_path / "prompt.txt").write_text("the dog sat")  # "dog" is unknown: <unk>
    code, out, err = run_cli(capsys, "generate", path, "--prompt-file", tmp_path / "prompt.txt",
                             "--max-new-tokens", 5, "--greedy")
    assert code == 0, err
    assert out.startswith("the dog sat") and len(out.split()) >= 5


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
        (["--greedy", "--temperature", "0.7"], "does not combine with --temperature"),
        (["--greedy", "--top-k", "5"], "does not combine with --top-k"),
        (["--greedy", "--num-samples", "3"], "identical samples"),
        (["--temperature", "0", "--num-samples", "2"], "identical samples"),
        (["--num-samples", "0"], "--num-samples must be >= 1"),
        (["--stop", ""], "--stop needs a non-empty string"),
        (["--stop-at-eos"], "no <eos> symbol"),
        (["--prompt", "x", "--prompt-file", "p.txt"], "not both"),
        (["--prompt-file", "/nonexistent/prompt.txt"], "prompt file not found"),
        (["--prompt", "x", "--mem-len", "-3"], "--mem-len must be >= 0"),
        (["--prompt", "x", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["--prompt", "x", "--temperature", "-1"], "temperature must be >= 0"),
    ],
)
def test_bad_inputs_end_in_one_line(ckpt_dir, capsys, argv, expected):
    code, out, err = run_cli(capsys, "generate", ckpt_dir, *argv)
    assert code == 2, (out, err)
    assert expected in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_character_word_vocabulary_explains_the_prompt_format():
    chars = Vocab("words", ["<eos>", "_", "a", "c", "t"], eos="<eos>")  # PTB-char: symbols are characters
    model = tiny_model(vocab_size=5)
    assert generate_text(model, chars, "c a t _", max_new_tokens=2, temperature=0.0)
    with pytest.raises(DataError, match="space-separated characters"):
        generate_text(model, chars, "cat", max_new_tokens=2)


def test_missing_vocab_and_unknown_checkpoint(tmp_path, capsys):
    tiny_model().save_pretrained(tmp_path / "novocab")
    code, _, err = run_cli(capsys, "generate", tmp_path / "novocab", "--prompt", "x")
    assert code == 2 and "no vocab.json" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(capsys, "generate", tmp_path / "nowhere", "--prompt", "x")
    assert code == 2 and "checkpoint not found" in err


def test_api_rejects_empty_prompts_and_zero_tokens():
    model = tiny_model()
    with pytest.raises(UsageError, match="empty"):
        generate(model, [], max_new_tokens=3)
    with pytest.raises(UsageError, match="max_new_tokens"):
        generate(model, [1], max_new_tokens=0)
    words = Vocab("words", ["<eos>", "<unk>", "a"], eos="<eos>", unk="<unk>")
    with pytest.raises(UsageError, match="encodes to no tokens"):
        generate_text(tiny_model(vocab_size=3), words, "   ", max_new_tokens=3)


def test_append_rows_is_cat_and_keeps_every_earlier_view_intact():
    from txl.fast.memory import append_rows

    torch.manual_seed(0)
    with torch.no_grad():
        past = torch.randn(2, 5, 3)
        history = [(past, past.clone())]
        buffers = set()
        for step in range(40):
            new = torch.randn(2, 1 + step % 2, 3)
            expected = torch.cat([history[-1][1], new], dim=1)
            grown = append_rows(history[-1][0], new)
            assert torch.equal(grown, expected)
            buffers.add(grown._base.data_ptr())
            tail = grown[:, -7:]  # a memory keeps its latest rows, as a view
            history.append((tail, tail.clone()))
        assert len(buffers) <= 3  # appends land in spare rows: a new buffer only when one is full
        # a second append from an old view (a fork) must not overwrite what a later view shows
        fork = append_rows(history[10][0], torch.full((2, 1, 3), 7.0))
        assert torch.equal(fork[:, -1], torch.full((2, 3), 7.0))
        for view, value in history:
            assert torch.equal(view, value)
    # a buffer made under inference_mode is not written outside it (torch forbids that): a new buffer
    with torch.inference_mode():
        made = append_rows(torch.zeros(1, 3, 2), torch.ones(1, 1, 2))
    with torch.no_grad():
        assert append_rows(made, torch.full((1, 1, 2), 2.0))[0, :, 0].tolist() == [0, 0, 0, 1, 2]
    # with autograd it is plain cat, gradient included
    a = torch.randn(1, 2, 3, requires_grad=True)
    append_rows(a, torch.randn(1, 1, 3)).sum().backward()
    assert torch.equal(a.grad, torch.ones_like(a))


def test_token_steps_with_a_full_memory_and_forks_match_the_uncached_model():
    """The projection cache and in-place appends (token-level inference) against plain forwards with
    the cache off, through memory truncation, buffer growth, and two continuations of one memory."""
    model = tiny_model(mem_len=24)
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cached = model(ids[:, :30])
        plain = cached
        for t in range(30, 90):
            cached = model(ids[:, t : t + 1], memory=cached.memory)
            # the reference: the same memory values, but a fresh Memory without cache or spare rows
            fresh = type(plain.memory)(tuple(h.clone() for h in plain.memory.hidden))
            plain = model(ids[:, t : t + 1], memory=fresh)
            torch.testing.assert_close(cached.logits, plain.logits, rtol=0, atol=1e-5)
            assert cached.memory.length == 24
        fork_a = model(torch.tensor([[1]]), memory=cached.memory)
        fork_b = model(torch.tensor([[2]]), memory=cached.memory)
        again_a = model(torch.tensor([[1]]), memory=cached.memory)
        torch.testing.assert_close(fork_a.logits, again_a.logits, rtol=0, atol=0)
        next_a = model(torch.tensor([[3]]), memory=fork_a.memory)
        next_b = model(torch.tensor([[3]]), memory=fork_b.memory)
        for memory in (fork_a.memory, fork_b.memory):
            assert torch.equal(memory.hidden[0][:, :-1], cached.memory.hidden[0][:, 1:])
        assert not torch.equal(next_a.logits, next_b.logits)
        ref = model(torch.tensor([[3]]), memory=type(plain.memory)(tuple(h.clone() for h in fork_a.memory.hidden)))
        torch.testing.assert_close(next_a.logits, ref.logits, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Issue 16: generation as users expect (several samples, batches, stops, log-probabilities)


def _json(capsys, *argv) -> dict:
    import json

    code, out, err = run_cli(capsys, "generate", *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_num_samples_are_different_and_reproducible(ckpt_dir, capsys):
    first = _json(capsys, ckpt_dir, "--prompt", "def ", "--num-samples", 3, "--seed", 0, "--max-new-tokens", 20)
    again = _json(capsys, ckpt_dir, "--prompt", "def ", "--num-samples", 3, "--seed", 0, "--max-new-tokens", 20)
    texts = [s["ids"] for s in first["samples"]]
    assert len(texts) == 3 and len({tuple(t) for t in texts}) == 3
    assert first["samples"] == again["samples"]


def test_json_log_probabilities_are_the_models_own_nll(ckpt_dir, capsys):
    result = _json(capsys, ckpt_dir, "--prompt", "import os", "--seed", 1, "--max-new-tokens", 30, "--top-k", 5)
    s = result["samples"][0]
    model = TransformerXL.from_pretrained(ckpt_dir)
    ids = torch.tensor([s["prompt_ids"] + s["ids"]])
    with torch.no_grad():
        nll = model(ids[:, :-1], labels=ids[:, 1:], mem_len=0).nll[0, len(s["prompt_ids"]) - 1 :]
    assert torch.allclose(-torch.tensor(s["logprobs"]), nll.float(), atol=1e-4)
    assert s["nll"] == pytest.approx(float(nll.sum()), abs=1e-3)


def test_stop_strings_end_a_sample_before_the_string(ckpt_dir, capsys):
    free = _json(capsys, ckpt_dir, "--prompt", "x", "--seed", 3, "--max-new-tokens", 60)["samples"][0]["text"]
    stop = free[10:12]  # two characters the free-running sample produces after its 10th
    cut = _json(capsys, ckpt_dir, "--prompt", "x", "--seed", 3, "--max-new-tokens", 60, "--stop", stop)["samples"][0]
    assert cut["stopped_by"] == "stop" and cut["text"] == free[: free.index(stop)]
    assert len(cut["ids"]) < 60
    code, out, _ = run_cli(capsys, "generate", ckpt_dir, "--prompt", "x", "--seed", 3, "--max-new-tokens", 60,
                           "--stop", stop, "--no-echo")
    assert code == 0 and out == free[: free.index(stop)] + "\n"  # streamed text holds back a partial stop string


def test_a_batch_of_prompts_from_a_file_and_unconditional_generation(ckpt_dir, capsys, tmp_path):
    (tmp_path / "prompts.txt").write_text("def f(\n\nimport os\n")
    result = _json(capsys, ckpt_dir, "--prompt-file", tmp_path / "prompts.txt", "--num-samples", 2, "--seed", 0,
                   "--max-new-tokens", 5)
    assert [s["prompt"] for s in result["samples"]] == ["def f(", "def f(", "import os", "import os"]
    unconditional = _json(capsys, ckpt_dir, "--prompt", "", "--seed", 0, "--max-new-tokens", 5)["samples"][0]
    assert unconditional["prompt_ids"] == [10] and len(unconditional["ids"]) == 5  # from a newline (bytes)
    code, out, err = run_cli(capsys, "generate", ckpt_dir, "--max-new-tokens", 5, "--seed", 0)
    assert code == 0 and out.strip(), err


def test_stop_at_eos_and_word_prompts_checked_before_anything_is_printed(tmp_path, capsys):
    path = tmp_path / "words"
    words = Vocab("words", ["<eos>", "the", "cat", "sat"], eos="<eos>")  # no <unk>
    tiny_model(vocab_size=4, mem_len=32).save_pretrained(path)
    words.save(path / "vocab.json")
    code, out, err = run_cli(capsys, "generate", path, "--prompt", "the dog", "--max-new-tokens", 3)
    assert code == 2 and out == "" and "'dog'" in err  # before: the prompt was printed, then the error
    greedy = sample(tiny_model(vocab_size=4, mem_len=32), [[1, 2]], max_new_tokens=50, temperature=0.0)
    eos_at = greedy.ids[0].index(0) if 0 in greedy.ids[0] else None
    stopped = sample(tiny_model(vocab_size=4, mem_len=32), [[1, 2]], max_new_tokens=50, temperature=0.0,
                     eos_token_id=0)
    assert eos_at is not None  # this model does produce <eos>
    assert stopped.ids[0] == greedy.ids[0][: eos_at + 1] and stopped.stopped_by == ["eos"]
    texts = sample_text(tiny_model(vocab_size=4, mem_len=32), words, ["the cat"], max_new_tokens=30,
                        stop_at_eos=True, temperature=0.0)
    assert texts[0].stopped_by == "eos" and texts[0].ids[-1] == 0 and "\n" not in texts[0].text


def test_model_generate_batches_rows_like_one_prompt_each():
    model = tiny_model(mem_len=64)
    prompts = torch.tensor([[1, 2, 3, 4], [9, 8, 7, 6]])
    out = generate_tokens(model, prompts, 12, temperature=0.0)
    assert torch.equal(model.generate(prompts, 12, temperature=0.0), out)  # the method is this function
    assert out.shape == (2, 16) and torch.equal(out[:, :4], prompts)
    for row in range(2):
        assert out[row, 4:].tolist() == generate(model, prompts[row].tolist(), max_new_tokens=12, temperature=0.0)
    assert generate_tokens(model, prompts[0], 3, temperature=0.0).shape == (7,)


def test_text_stream_decodes_in_bounded_windows_and_matches_whole_decoding():
    words = Vocab("words", ["<eos>", "<unk>", "the", "cat", "sat"], eos="<eos>", unk="<unk>")
    ids = [2, 3, 4, 0] * 300 + [2, 3]
    pieces = []
    stream = TextStream(words, pieces.append, prefix=[2])
    for token in ids:
        stream.push(token)
        assert len(stream.window) < 2 * TextStream.WINDOW + 1  # bounded work per token
    stream.close()
    assert "".join(pieces) == words.decode([2] + ids)[len("the"):]
    chars = Vocab("chars", sorted("abc \n"))
    text = "abc cab\nbca " * 100
    pieces = []
    stream = TextStream(chars, pieces.append)
    for token in chars.encode(text):
        stream.push(int(token))
    stream.close()
    assert "".join(pieces) == text


@pytest.mark.parametrize("entry", ["stream_tokens", "sample", "generate_rerun"])
def test_generation_records_no_autograd_graph(entry):
    """Every generation entry point runs its forwards under no_grad: with autograd on, token-level
    inference would build a graph per token and skip the fast backend's projection cache (3x slower)."""
    import txl.generate.decoder as gen

    model = tiny_model(mem_len=16)
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(torch.is_grad_enabled()))
    prompt = [1, 2, 3, 4]
    if entry == "sample":
        gen.sample(model, [prompt], max_new_tokens=3, temperature=0.0)
    elif entry == "generate_rerun":
        gen.generate_rerun(model, prompt, max_new_tokens=3)
    else:
        list(gen.stream_tokens(model, prompt, max_new_tokens=3, temperature=0.0))
    assert seen and not any(seen)


def absolute_model(pos: str, *, mem_len: int) -> TransformerXL:
    return tiny_model(2, mem_len=mem_len, pos_encoding=pos)  # seed 2: greedy streams of 7-8 distinct tokens


@pytest.mark.parametrize("pos", ["sinusoidal", "learned"])
def test_absolute_encodings_continue_their_positions_while_generating(pos):
    """A token fed alone is numbered where it stands in its segment, not 0: with the text inside one
    segment and the memory, token steps equal re-running the whole text (positions 0 … n-1)."""
    model = absolute_model(pos, mem_len=64)
    assert model.takes_position_ids and not tiny_model().takes_position_ids
    prompt = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    reused = generate(model, prompt, max_new_tokens=40, temperature=0.0, segment_len=64)
    assert reused == generate_rerun(model, prompt, max_new_tokens=40)
    assert len(set(reused)) > 5


def test_absolute_positions_skip_padding_restart_every_segment_and_after_a_reset():
    """The positions the decoder passes: each row's real tokens counted from its first (left padding not
    counted), mod segment_len, and from 0 again for a row that was reset."""
    from txl.generate.decoder import Decoder

    model = absolute_model("learned", mem_len=8)
    seen = []
    forward = model.forward
    model.forward = lambda ids, **kw: seen.append(kw["position_ids"].tolist()) or forward(ids, **kw)
    decoder = Decoder(model, segment_len=4)
    ids = torch.tensor([[0, 0, 11, 12, 13], [21, 22, 23, 24, 25]])
    decoder.feed(ids, attention_mask=torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]))
    for _ in range(3):
        decoder.step(torch.tensor([5, 6]))
    decoder.reset([1])
    decoder.step(torch.tensor([5, 6]))
    assert seen == [[[0, 0, 0, 1], [0, 1, 2, 3]],  # the prompt's first chunk of 4 columns
                    [[2], [0]],  # its last column
                    [[3], [1]], [[0], [2]], [[1], [3]],  # three steps
                    [[2], [0]]]  # row 1 was reset


@pytest.mark.parametrize("mem_len", [0, 16])
@pytest.mark.parametrize("pos", ["sinusoidal", "learned"])
def test_left_padded_rows_of_an_absolute_model_generate_what_they_generate_alone(pos, mem_len):
    model = absolute_model(pos, mem_len=mem_len)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1]]
    padded = torch.tensor([prompts[0], [0] * 5 + prompts[1]])
    mask = torch.tensor([[1] * 8, [0] * 5 + [1] * 3])
    together = sample(model, padded, attention_mask=mask, max_new_tokens=12, temperature=0.0, segment_len=16)
    for row, prompt in enumerate(prompts):
        alone = sample(model, [prompt], max_new_tokens=12, temperature=0.0, segment_len=16)
        assert together.ids[row] == alone.ids[0]
