"""The studies in experiments/ (the arena, the recipe search; the claims study is test_claims.py):
each script end to end on a tiny budget, its plans and reports, and its numbers refused in one line
as `txl`'s are (numbers are never asserted: results live in docs/results/)."""

from __future__ import annotations

import json
import statistics

import pytest

import studies

recipes = studies.load("recipes")


def main(argv: list[str]) -> int:
    """`python experiments/NAME.py ARGS` in this process, for argv = [NAME, *ARGS]."""
    return studies.load(argv[0]).main(argv[1:])


@pytest.mark.parametrize("argv", [["arena", "--variants", "xl,shaw,xl"],
                                  ["recipes", "--sweep", "ptb-char", "--candidates", "centre,centre"]])
def test_a_run_named_twice_is_refused_before_anything_trains(argv, capsys):
    assert main(argv) == 2  # two jobs would share one run directory
    err = capsys.readouterr().err
    assert "named twice" in err and len(err.strip().splitlines()) == 1


def test_arena_variants_get_the_reference_parameter_count():
    arena = studies.load("arena")
    target = arena.parameter_count([], 50)
    for variant in arena.VARIANTS.values():
        d_inner, count = arena.match_d_inner(variant, target, 50, 512)
        sets = [f"model.{s}" for s in variant.sets] + [f"model.d_inner={d_inner}"]
        sets += [f"train.{s}" for s in variant.train_sets] + (["train.sample_tokens=0"] if variant.mlm else [])
        assert count == arena.parameter_count(sets, 50), variant.name  # the affine prediction is exact
        if variant.match:
            assert abs(count - target) / target < 0.005, variant.name
        else:  # kept at the preset's d_inner, and its row says why
            assert d_inner == 512 and "not parameter-matched" in variant.about, variant.name


@pytest.mark.slow
def test_arena_trains_side_by_side_and_reuses_finished_runs(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox {i % 7} jumps\n" for i in range(600)))
    # 10 minutes each, cut at 3 steps: what the runs do does not depend on this machine's speed (issue 50)
    argv = ["arena", "--variants", "xl,xl-mem0,mlm-full", "--minutes", "10", "--jobs", "2",
            "--data", f"text:{corpus}", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "docs"),
            "--seeds", "1"]
    for s in ("model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.d_head=16", "model.d_inner=64",
              "model.mem_len=16", "train.batch_size=2", "train.tgt_len=16", "train.eval_tgt_len=16",
              "train.warmup_steps=0", "train.max_steps=3"):
        argv += ["--set", s]
    assert main(argv) == 0
    report = json.loads((tmp_path / "docs" / "arena.json").read_text())
    rows = {row["name"]: row for row in report["rows"]}
    assert set(rows) == {"xl", "xl-mem0", "mlm-full"}
    assert rows["xl"]["parameters"] == rows["xl-mem0"]["parameters"]
    assert rows["mlm-full"]["mlm"] and 0 <= rows["mlm-full"]["accuracy"] <= 1
    assert "--objective mlm" in rows["mlm-full"]["command"]
    for row in rows.values():
        assert row["steps"] == 3 and row["valid"] > 0 and row["peak_rss_mb"] > 10 and row["tokens_per_second"] > 0
        assert "--set model.d_inner=64" in row["command"] and row["command"].startswith("OMP_NUM_THREADS=1 txl train")
    text = (tmp_path / "docs" / "arena.md").read_text()
    assert "| xl-mem0 |" in text and "Linformer" in text and (tmp_path / "docs" / "arena.png").stat().st_size > 0
    causal_table, mlm_table = text.split("## Bidirectional encoders (masked LM)")
    assert "| mlm-full |" in mlm_table and "| mlm-full |" not in causal_table.split("## Reproduce")[0]
    # a section: its variants with xl again as their anchor, kept beside the main table (which is unchanged)
    section = ["arena", "--variants", "gtrxl,mqa", *argv[3:], "--section", "blocks"]
    assert main(section) == 0
    merged = json.loads((tmp_path / "docs" / "arena.json").read_text())
    assert merged["rows"] == report["rows"] and set(merged["sections"]) == {"blocks"}
    blocks = {row["name"]: row for row in merged["sections"]["blocks"]["rows"]}
    assert set(blocks) == {"xl", "gtrxl", "mqa"} and blocks["xl"]["valid"] == rows["xl"]["valid"]  # reused
    assert "--set model.residual=gru-gate" in blocks["gtrxl"]["command"]
    assert "--set model.n_kv_head=1" in blocks["mqa"]["command"]
    text = (tmp_path / "docs" / "arena.md").read_text()
    assert "## Block options and recurrence variants" in text and "| gtrxl |" in text and "| mqa |" in text
    report = merged
    capsys.readouterr()
    assert main(argv) == 0  # finished runs with the same command are reused, not retrained
    assert capsys.readouterr().out.count("reusing") == 3
    # the best causal row again with a second seed: the first pass is reused, one run is added
    assert main([*argv, "--seeds", "2", "--top", "1"]) == 0
    assert capsys.readouterr().out.count("reusing") == 3
    report = json.loads((tmp_path / "docs" / "arena.json").read_text())
    rows = {row["name"]: row for row in report["rows"]}
    best = min(("xl", "xl-mem0"), key=lambda name: rows[name]["valid"])
    other = "xl" if best == "xl-mem0" else "xl-mem0"
    assert [seed["seed"] for seed in rows[best]["seeds"]] == [1111, 1112] and "seeds" not in rows[other]
    assert rows[best]["seeds"][0]["valid"] == rows[best]["valid"]
    assert "--seed 1112" in rows[best]["seeds"][1]["command"] and (tmp_path / "runs" / f"{best}-seed1112").is_dir()
    text = (tmp_path / "docs" / "arena.md").read_text()
    assert "## Noise: the 1 best rows over 2 seeds" in text and rows[best]["seeds"][1]["command"] in text
    assert main([*argv, "--seeds", "2", "--top", "1"]) == 0
    assert capsys.readouterr().out.count("reusing") == 4
    assert main([*argv[:2], "xl", *argv[3:], "--fresh"]) == 0  # an arena run directory is retrained in place
    assert "reusing" not in capsys.readouterr().out
    (tmp_path / "runs" / "xl" / "arena.json").unlink()  # no longer ours: left alone, one clear error
    assert main([*argv[:2], "xl", *argv[3:], "--fresh"]) != 0
    assert "is not an arena run directory" in capsys.readouterr().err


@pytest.mark.slow
def test_recipe_sweep_ranks_proxies_then_confirms_with_seeds(tmp_path, capsys):
    """experiments/recipes.py: proxies cut by their minutes (the cosine follows them), scored on the whole
    valid split; a confirmation trains one candidate with two seeds and scores valid and test whole.

    The minute runs here are cut by 8 steps long before their 10 minutes, so what they do does not
    depend on this machine's speed or load (a 0.03-minute budget did: issue 50); that the schedule
    follows the clock when the minutes run out first is test_train's fake-clock test."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox {i % 7} jumps\n" for i in range(600)))
    argv = ["recipes", "--sweep", "ptb-char", "--candidates", "centre,mem-0", "--minutes", "10",
            "--data", f"text:{corpus}", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "docs")]
    for s in ("model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.d_head=16", "model.d_inner=64",
              "train.batch_size=2", "train.tgt_len=16", "train.eval_tgt_len=16", "train.warmup_steps=0"):
        argv += ["--set", s]
    in_steps = ["--set", "train.max_steps=8", "--set", "train.log_interval=2"]  # after the sweep's own keys
    assert main([*argv, *in_steps]) == 0
    report = json.loads((tmp_path / "docs" / "recipes_ptb-char.json").read_text())
    rows = {row["name"]: row for row in report["rows"]}
    assert set(rows) == {"centre", "mem-0"} and rows["mem-0"]["changes"] == ["model.mem_len=0"]
    for row in rows.values():
        assert row["steps"] > 0 and row["valid"] > 0 and row["test"] is None and row["precision"] in ("fp32", "bf16")
        assert "--max-minutes 10" in row["command"] and "--preset ptb-char-hour" in row["command"]
        assert "train.schedule_clock=minutes" in row["command"] and row["steps"] == 8
        metrics = [json.loads(line) for line in (tmp_path / "runs" / f"ptb-char-{row['name']}" / "metrics.jsonl")
                   .read_text().splitlines()]
        lrs = [r["lr"] for r in metrics if r.get("split") == "train"]
        assert len(lrs) == 4 and lrs[-1] < lrs[0]  # the cosine over whichever budget is further along: the steps
    text = (tmp_path / "docs" / "recipes_ptb-char.md").read_text()
    assert "| mem-0 | preset | `model.mem_len=0` |" in text and (tmp_path / "docs" / "recipes_ptb-char.png").stat().st_size > 0
    capsys.readouterr()
    assert main([*argv, *in_steps, "--confirm", "mem-0", "--seeds", "2"]) == 0
    report = json.loads((tmp_path / "docs" / "confirm_ptb-char_mem-0.json").read_text())
    assert [row["seed"] for row in report["rows"]] == [1111, 1112]
    for row in report["rows"]:
        result = json.loads((tmp_path / "runs" / f"ptb-char-confirm-mem-0-seed{row['seed']}" / "result.json").read_text())
        assert row["test"] > 0 and result["final"]["valid"]["tokens"] > 0 and "--seed" in row["command"]
    assert "Test bpc:" in (tmp_path / "docs" / "confirm_ptb-char_mem-0.md").read_text()
    assert main([*argv[:4], "nope", *argv[5:]]) == 2
    assert "unknown candidate(s) nope" in capsys.readouterr().err
    # a step budget (e.g. bf16 against fp32 over the same steps), two seeds each, in its own directories
    steps = [*argv[:4], "centre,fp32", *argv[7:], "--steps", "4", "--seeds", "2"]
    assert main(steps) == 0
    report = json.loads((tmp_path / "docs" / "recipes_ptb-char_4steps.json").read_text())
    assert sorted((r["name"], r["seed"] or 0) for r in report["rows"]) == [
        ("centre", 0), ("centre", 1112), ("fp32", 0), ("fp32", 1112)]  # 0: the preset's seed, no --seed
    assert all(r["steps"] == 4 for r in report["rows"])
    assert {r["precision"] for r in report["rows"] if r["name"] == "fp32"} == {"fp32"}
    assert (tmp_path / "runs" / "ptb-char-fp32-4steps-seed1112").is_dir()
    assert (tmp_path / "runs" / "ptb-char-centre" / "result.json").is_file()  # the minute proxies are untouched
    text = (tmp_path / "docs" / "recipes_ptb-char_4steps.md").read_text()
    assert "4-step proxies" in text and "| fp32 |" in text and "gap to centre" in text
    # without the centre, the gaps are to the first candidate named (fp32 for a bf16 check at another shape)
    rows = [r for r in report["rows"] if r["name"] == "fp32"] + [
        {**r, "name": "other"} for r in report["rows"] if r["name"] == "centre"]
    text = recipes.markdown({**report, "rows": rows})
    other = next(line for line in text.splitlines() if line.startswith("| other | ") and "±" in line)
    mean = lambda name: statistics.mean(r["valid"] for r in rows if r["name"] == name)  # noqa: E731
    assert "gap to fp32" in text and f"{mean('other') - mean('fp32'):+.4f}" in other
    assert main([*steps, "--minutes", "1"]) == 2 and "not both" in capsys.readouterr().err


def test_recipe_report_carries_the_weight_average_curve(tmp_path):
    """A run trained with train.ema logs `valid_ema` beside `valid`: the recipe report keeps both curves,
    which weights won and the live weights' test score, and plots the average's curve too."""
    collect, plot, valid_ends = recipes.collect, recipes.plot, recipes.valid_ends

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    records = [{"split": "train", "elapsed": 30.0 * k, "ppl": 300.0 - k} for k in range(1, 5)]
    records += [{"split": split, "elapsed": 60.0 * k, "ppl": base - 5 * k}
                for k in (1, 2) for split, base in (("valid", 200.0), ("valid_ema", 190.0))]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "run.json").write_text(json.dumps({"precision": "bf16"}))
    (run_dir / "result.json").write_text(json.dumps({
        "metric": "ppl", "parameters": 10, "steps": 4, "tokens": 400, "elapsed": 120.0, "tokens_per_second": 3.3,
        "final": {"valid": {"ppl": 181.0}, "test": {"ppl": 170.0}}, "best_weights": "average",
        "final_live": {"test": {"ppl": 171.5}}}))
    row = collect({"run_dir": str(run_dir), "name": "c", "about": "", "changes": [], "command": "txl train",
                   "peak_rss_mb": 1.0, "seed": 1111})
    assert row["valid_curve"] == [(1.0, 195.0), (2.0, 190.0)]
    assert row["valid_ema_curve"] == [(1.0, 185.0), (2.0, 180.0)]
    assert (row["valid"], row["test"], row["best_weights"], row["test_live"]) == (181.0, 170.0, "average", 171.5)
    plot({"sweep": "ptb-word", "confirm": "c", "rows": [row]}, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    old = {k: v for k, v in row.items() if k != "valid_ema_curve"}  # a report written before the curve existed
    plot({"sweep": "ptb-word", "confirm": "c", "rows": [old]}, tmp_path / "old.png")
    assert (tmp_path / "old.png").stat().st_size > 0
    # train.eval_live=false: the live weights validated once, at the end; the range holds both ends
    late = {**row, "valid_curve": [(2.0, 190.0)], "valid_ema_curve": [(1.0, 185.0), (2.0, 150.0)]}
    assert valid_ends(late) == [190.0, 150.0] and valid_ends(old) == [190.0]
    plot({"sweep": "ptb-word", "confirm": "c", "rows": [late]}, tmp_path / "late.png")
    assert (tmp_path / "late.png").stat().st_size > 0


@pytest.mark.parametrize("sweep", sorted(recipes.SWEEPS))
def test_the_preset_is_its_sweeps_named_recipe(sweep):
    """The hour preset trains exactly the candidate its sweep names (the preset's comment and
    docs/results/cpu_hour.md quote that candidate's confirmations), and no other candidate is the preset."""
    from txl.train.config import build_run_config

    def config(*sets: str) -> tuple:
        cfg = build_run_config(preset=recipes.SWEEPS[sweep].preset, sets=list(sets))
        return cfg.model_config(vocab_size=10_000), cfg.train

    preset = config()
    same = [c.name for c in recipes.SWEEPS[sweep].candidates if config(*recipes.SWEEPS[sweep].centre, *c.sets) == preset]
    assert same == [recipes.SWEEPS[sweep].recipe]


@pytest.mark.parametrize("sweep", sorted(recipes.SWEEPS))
def test_every_recipe_candidate_is_a_valid_config(sweep):
    """Each candidate's keys on top of its sweep's centre and preset build a run config and a model
    (a typo in a key or an impossible shape fails here, not an hour into a sweep)."""
    from txl.train.config import build_run_config, parse_value

    for candidate in recipes.SWEEPS[sweep].candidates:
        cfg = build_run_config(preset=recipes.SWEEPS[sweep].preset, sets=[*recipes.SWEEPS[sweep].centre, *candidate.sets])
        model = cfg.model_config(vocab_size=10_000)  # validated
        last = {key.split("=", 1)[0]: key for key in candidate.sets}  # a later --set of a key wins, as on the CLI
        for key in last.values():
            section, rest = key.split(".", 1)
            field, value = rest.split("=", 1)
            got, want = getattr(model if section == "model" else cfg.train, field), parse_value(value)
            if isinstance(got, tuple) and isinstance(want, list):  # the configs keep sequences as tuples
                want = tuple(want)
            assert got == want, (candidate.name, key, got)


@pytest.mark.parametrize(("argv", "expected"), [
    (["arena", "--minutes", "inf"], "--minutes must be a finite number in (0, 10,080], got inf"),
    (["recipes", "--sweep", "ptb-char", "--jobs", "0"], "--jobs must be >= 1"),
    (["claims", "--blocks", "1"], "--blocks must be >= 2"),
])
def test_each_out_of_range_number_is_one_line_naming_the_flag_and_its_range(argv, expected, tmp_path, monkeypatch,
                                                                              capsys):
    """(moved from test_cli_numbers with the studies' subcommands of `txl bench`)"""
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == 1 and ": error: " in lines[0], err
    assert expected in lines[0], lines[0]


def test_an_archived_recipe_report_renders_again(tmp_path, capsys):
    """docs/ keeps one archive JSON per study instead of the per-run pages: each archived report still
    gives its table and plot (`recipes.py --render NAME`), and an unknown name is one line naming the
    known ones."""
    name = "amd/confirm_ptb-char_small-dropout-0"
    assert main(["recipes", "--render", name, "--out", str(tmp_path)]) == 0
    text = (tmp_path / "confirm_ptb-char_small-dropout-0.md").read_text()
    assert text.startswith("# Confirmation: `small-dropout-0`") and "Test bpc:" in text
    assert (tmp_path / "confirm_ptb-char_small-dropout-0.png").read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    assert main(["recipes", "--render", "nope", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "holds no report 'nope'" in err and name in err


def _study_flags():
    """(script, flag) for each numeric flag of the studies (the sweep tests/test_cli_numbers.py makes of
    txl's own commands: these flags were `txl bench arena|claims|recipes` ones)."""
    import argparse

    for name in ("arena", "claims", "recipes"):
        parser = argparse.ArgumentParser()
        studies.load(name).configure(parser)
        for action in parser._actions:
            if action.option_strings and (action.type in (int, float) or getattr(action.type, "__name__", "")
                                          in ("integer", "real", "integer list")):
                yield name, action.option_strings[-1]


STUDY_FLAGS = list(_study_flags())


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "-inf", "1e400", "", "0x10", "1" + "0" * 30, "-1" + "0" * 30])
def test_no_numeric_flag_of_a_study_takes_a_word_or_a_number_past_its_bounds(value, tmp_path, monkeypatch, capsys):
    """Each of the studies' numeric flags against words, non-finite numbers and 10^30: one line naming the
    flag, exit 2, nothing written."""
    assert len(STUDY_FLAGS) >= 19
    monkeypatch.chdir(tmp_path)
    for name, flag in STUDY_FLAGS:
        argv = [name, *(["--sweep", "ptb-char"] if name == "recipes" else []), f"{flag}={value}"]
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert "Traceback" not in err and len(lines) == 1 and ": error: " in lines[0], (argv, err)
        assert flag in lines[0] or flag.lstrip("-") in lines[0], (argv, lines[0])
    assert list(tmp_path.iterdir()) == []


# A stand-in for the reference's pytorch/ folder (the real one is never shipped): the same constructor
# and forward contract as kimiyoung's MemTransformerLM (time-major (t, b) tokens, `forward(data, target,
# *mems)` -> [loss (t, b)] + new mems), and the `sys.path.append('utils')` import it relies on.
STAND_IN = '''
import torch
from torch import nn
from helper import width

class MemTransformerLM(nn.Module):
    def __init__(self, n_token, n_layer, n_head, d_model, d_head, d_inner, dropout, dropatt, *, mem_len, **kw):
        super().__init__()
        self.mem_len, self.n_layer = mem_len, n_layer
        self.emb, self.out = nn.Embedding(n_token, width(d_model)), nn.Linear(width(d_model), n_token)

    def forward(self, data, target, *mems):
        hidden = self.emb(data)
        loss = nn.functional.cross_entropy(self.out(hidden).flatten(0, 1), target.flatten(), reduction="none")
        new = [torch.cat([m, hidden.detach()])[-self.mem_len:] for m in mems]
        return [loss.view_as(target)] + new
'''


def test_reference_speed_times_both_sides_and_writes_the_ratio(tmp_path):
    ref = tmp_path / "pytorch"
    (ref / "utils").mkdir(parents=True)
    (ref / "mem_transformer.py").write_text(STAND_IN)
    (ref / "utils" / "helper.py").write_text("def width(d):\n    return d\n")
    out = tmp_path / "out"
    assert main(["reference_speed", "--reference", str(ref), "--config", "tiny", "--threads", "1", "--warmup", "0",
                 "--steps", "2", "--profile", "1", "--out", str(out)]) == 0
    got = json.loads((out / "reference_speed.json").read_text())
    assert [(r["kind"], r["threads"]) for r in got["rows"]] == [("train", 1), ("eval", 1)]
    for row in got["rows"]:
        assert all(len(times) == 2 for times in row["times_s"].values())
        assert row["ratio"] == pytest.approx(row["txl_tok_s"] / row["kimiyoung_tok_s"], rel=1e-2, abs=1e-3)  # (3 decimals)
        for kinds in row["profile_ms"].values():  # every side's profile, split by operator kind
            assert set(kinds) == {"matmul", "copy", "random", "other", "ops"} and kinds["matmul"] > 0
            assert kinds["ops"] == pytest.approx(sum(kinds[k] for k in ("matmul", "copy", "random", "other")), abs=0.05)
        assert row["matmul_bound"] > 0
    text = (out / "reference_speed.md").read_text()
    assert "| tiny | train | 1 |" in text and "| tiny | train | 1 | txl |" in text and "| bound |" in text


def test_reference_speed_refuses_a_folder_without_the_reference(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["reference_speed", "--reference", str(tmp_path)])
    assert exit_.value.code == 2 and "no mem_transformer.py" in capsys.readouterr().err


def test_step_profile_splits_each_step_by_operator_kind(tmp_path):
    """experiments/step_profile.py (issue 49, item 1): per config and thread count, the step time, the
    profile by operator kind (the kinds sum to the operators' time) and the costliest operators."""
    out = tmp_path / "out"
    assert main(["step_profile", "--config", "tiny", "--threads", "1", "--warmup", "0", "--steps", "1",
                 "--profile", "1", "--top", "5", "--out", str(out)]) == 0
    got = json.loads((out / "step_profile.json").read_text())
    (row,) = got["rows"]
    assert (row["config"], row["threads"], row["precision"]) == ("tiny", 1, "fp32")
    kinds = row["kinds_ms"]
    assert kinds["matmul"] > 0 and kinds["ops"] == pytest.approx(
        sum(kinds[k] for k in ("matmul", "copy", "random", "other")), abs=0.05)
    assert len(row["top"]) == 5 and row["top"][0]["self_ms_per_step"] >= row["top"][-1]["self_ms_per_step"]
    text = (out / "step_profile.md").read_text()
    assert "| tiny | 1 | fp32 |" in text and "## tiny, 1 thread(s), fp32" in text
