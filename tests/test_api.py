"""The typed library functions behind the commands (``dspark.build_data``, ``train``,
``calibrate``, ``evaluate``, ``run_bench``, ``run_demo``) on a tiny target: each called directly,
the options' defaults equal to the command line's, bad options refused in one sentence, and
what depends on the world (files, registered names) checked before any model loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import dspark
from dspark.bench.run import BenchOptions
from dspark.cli import build_parser
from dspark.data.build import DataOptions
from dspark.demo import DemoOptions
from dspark.evaluation.calibration_run import CalibrateOptions
from dspark.evaluation.eval_run import EvalOptions
from dspark.training.run import TrainOptions
from helpers import save_tiny_target, tiny_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")

DOMAINS = ("math", "code", "chat")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target folder (word-level tokenizer with a chat template), a prompts file, the
    data built from it and a drafter trained on that data — through the typed functions."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("api")
    target = save_tiny_target(root / "target", tiny_causal_lm(vocab_size=32, max_positions=512))
    tok = AutoTokenizer.from_pretrained(target)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(target)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(
        json.dumps({"prompt": " ".join(f"t{(7 * i + 3 * j) % 31 + 1}" for j in range(6)), "domain": DOMAINS[i % 3]})
        + "\n" for i in range(24)))
    data = dspark.build_data(dspark.DataOptions(
        out=root / "data", prompts=[prompts], no_builtin=True, model=target, dtype="float32", temperature=0,
        max_new_tokens=8, concurrency=4, eval_fraction=0.3, quiet=True))
    run = dspark.train(dspark.TrainOptions(
        data=data.out, out=root / "run", model=target, rank=8, gamma=4, steps=3, seqs_per_step=4, anchors=2,
        features="online", top_k=8, save_dtype="float32", quiet=True))
    return root, target, data, run


def test_build_data_and_train(tiny):
    root, target, data, run = tiny
    assert isinstance(data, dspark.DataResult) and data.out == root / "data"
    assert data.train_prompts + data.held_out == 24 and data.held_out > 0
    assert data.written == data.train_prompts and data.already_done == 0 and data.tokens == 8 * data.written
    assert len(data.train_path.read_text().splitlines()) == data.written
    assert json.loads(data.meta_path.read_text())["prompt_files"] == [str(root / "prompts.jsonl")]
    again = dspark.build_data(DataOptions.from_namespace(build_parser().parse_args(
        ["data", "--out", str(data.out), "--prompts", str(root / "prompts.jsonl"), "--no-builtin", "--target",
         str(target), "--dtype", "float32", "--temperature", "0", "--max-new-tokens", "8", "--eval-fraction", "0.3",
         "--quiet"])))
    assert (again.already_done, again.written, again.tokens) == (data.train_prompts, 0, 0)  # resumed

    assert isinstance(run, dspark.TrainResult) and run.finished and (run.step, run.steps) == (3, 3)
    assert run.checkpoint == root / "run" / "checkpoint" and (run.checkpoint / "config.json").is_file()
    assert run.summary["steps"] == 3 and run.summary["drafter"]["gamma"] == 4 and len(run.log) == 3
    assert json.loads((root / "run" / "train.json").read_text())["sequences"] == run.summary["sequences"]


def test_build_data_stops_at_max_tokens_and_resumes_to_a_larger_budget(tiny):
    """Every response here is 8 tokens: a 20-token budget takes 3 responses, a re-run with the
    same budget none, a 40-token budget 2 more; the token counts are those in the file."""
    root, target, _, _ = tiny
    base = dict(out=root / "budget", prompts=[root / "prompts.jsonl"], no_builtin=True, model=target, dtype="float32",
                temperature=0, max_new_tokens=8, concurrency=2, eval_fraction=0.3, quiet=True)
    first = dspark.build_data(**base, max_tokens=20)
    lines = lambda: [json.loads(x) for x in first.train_path.read_text().splitlines()]  # noqa: E731
    assert (first.written, first.tokens, first.total_tokens) == (3, 24, 24) and len(lines()) == 3
    assert (dspark.build_data(**base, max_tokens=20).written, len(lines())) == (0, 3)
    more = dspark.build_data(**base, max_tokens=40)
    assert (more.written, more.total_tokens) == (2, sum(len(r["response_ids"]) for r in lines())) == (2, 40)


def test_build_data_refuses_to_resume_with_other_generation_settings(tiny):
    """Appending records made with another temperature, dtype or target to train.jsonl would mix
    two datasets silently: refused in one sentence naming the field (the cheap fields before the
    model loads), the file and its records left as they were."""
    from helpers import save_tiny_target

    root, target, _, _ = tiny
    base = dict(out=root / "resume", prompts=[root / "prompts.jsonl"], no_builtin=True, model=target, dtype="float32",
                temperature=0, max_new_tokens=8, concurrency=2, eval_fraction=0.3, quiet=True)
    first = dspark.build_data(**base, max_tokens=16)
    before = first.train_path.read_text()
    with pytest.raises(ValueError, match=r"computed with temperature = 0(\.0)?, this run has 0.7"):
        dspark.build_data(**{**base, "temperature": 0.7}, max_tokens=32)
    with pytest.raises(ValueError, match="computed with dtype = 'float32', this run has 'bfloat16'"):
        dspark.build_data(**{**base, "dtype": "bfloat16"}, max_tokens=32)
    assert first.train_path.read_text() == before
    more = dspark.build_data(**base, max_tokens=32)  # the same settings resume
    assert more.already_done == 2 and more.written == 2
    # the same model folder holding other weights (retrained in place): the target's digest differs
    from transformers import AutoModelForCausalLM

    folder = root / "mutable-target"
    shutil.copytree(target, folder)
    moved = {**base, "out": root / "resume-2", "model": folder}
    dspark.build_data(**moved, max_tokens=16)
    other = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        next(other.parameters()).add_(0.01)
    save_tiny_target(folder, other)
    kept = (root / "resume-2" / "train.jsonl").read_text()
    with pytest.raises(ValueError, match="computed with target = "):
        dspark.build_data(**moved, max_tokens=32)
    assert (root / "resume-2" / "train.jsonl").read_text() == kept


def test_build_data_resumes_after_a_torn_last_record(tiny):
    """A run killed mid-write (or a copy of a live file) ends in half a record: the resumed run
    drops it and appends whole records after it, so every line of the file parses."""
    root, target, _, _ = tiny
    base = dict(out=root / "torn", prompts=[root / "prompts.jsonl"], no_builtin=True, model=target, dtype="float32",
                temperature=0, max_new_tokens=8, concurrency=2, eval_fraction=0.3, quiet=True)
    first = dspark.build_data(**base, max_tokens=16)
    whole = first.train_path.read_text()
    first.train_path.write_text(whole + whole.splitlines()[0][:40])  # half of a third record, no newline
    more = dspark.build_data(**base, max_tokens=32)
    rows = [json.loads(x) for x in first.train_path.read_text().splitlines()]  # raises on a merged line
    assert (more.already_done, more.written, len(rows)) == (2, 2, 4)
    assert first.train_path.read_text().startswith(whole) and len({r["key"] for r in rows}) == 4


def test_evaluate_and_calibrate(tiny):
    root, target, data, run = tiny
    ev = dspark.evaluate(drafters=[f"tiny={run.checkpoint}", "ngram"], temperatures=[0], prompts=data.eval_prompts_path,
                         model=target, per_domain=2, max_new_tokens=8, concurrency=2, out=root / "eval", quiet=True)
    assert isinstance(ev, dspark.EvalResult) and set(ev.tau) == {"tiny@T=0.0", "ngram@T=0.0"}
    assert all(t >= 1.0 for t in ev.tau.values())
    assert json.loads(ev.json_path.read_text())["runs"].keys() == ev.results["runs"].keys()
    assert ev.markdown_path.is_file() and (ev.out / "acceptance.png").is_file()

    # the rounds are reused only for the same inputs: another checkpoint under the same label is
    # refused in one sentence (not answered with the old numbers), --fresh recomputes
    kw = dict(temperatures=[0], prompts=data.eval_prompts_path, model=target, per_domain=2, concurrency=2,
              out=root / "eval", quiet=True)
    again = dspark.evaluate(drafters=[f"tiny={run.checkpoint}", "ngram"], max_new_tokens=8, **kw)
    assert again.tau == ev.tau
    assert ev.results["runs"]["tiny@T=0.0"]["provenance"]["checkpoint_digest"] != "ngram"
    other = root / "other-ckpt"
    shutil.copytree(run.checkpoint, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(cfg, indent=1))  # other bytes, same label
    with pytest.raises(ValueError, match=r"computed with checkpoint_digest = .*pass --fresh"):
        dspark.evaluate(drafters=[f"tiny={other}"], max_new_tokens=8, **kw)
    with pytest.raises(ValueError, match="computed with max_new_tokens = 8, this run has 6"):
        dspark.evaluate(drafters=[f"tiny={run.checkpoint}"], max_new_tokens=6, **kw)
    fresh = dspark.evaluate(drafters=[f"tiny={other}"], max_new_tokens=8, fresh=True, **kw)
    assert fresh.results["runs"]["tiny@T=0.0"]["provenance"]["checkpoint_digest"] != \
        ev.results["runs"]["tiny@T=0.0"]["provenance"]["checkpoint_digest"]
    # labels name files under OUT: a path is refused, and so is one label given twice, before any load
    with pytest.raises(ValueError, match="not a plain file name"):
        dspark.evaluate(drafters=[f"../../x={run.checkpoint}"], max_new_tokens=8, **kw)
    with pytest.raises(ValueError, match="'tiny' is given twice"):
        dspark.evaluate(drafters=[f"tiny={run.checkpoint}", f"tiny={other}"], max_new_tokens=8, **kw)
    assert not (root.parent / "x-T0.0.json").exists()

    cal = dspark.calibrate(dspark.CalibrateOptions(checkpoint=run.checkpoint, out=root / "cal", skip=0, per_domain=4,
                                                   prompts=data.eval_prompts_path, model=target, max_new_tokens=8,
                                                   quiet=True))
    assert isinstance(cal, dspark.CalibrateResult) and cal.calibration_path.is_file()
    assert {"raw", "calibrated"} <= set(cal.report["overall"]) and (cal.out / "reliability.png").is_file()
    # raw, STS and STS + bias all reported on the held-out half; the simplest within 0.1 points of
    # the lowest mean ECE shipped (the rule written out here, not taken from the module)
    cands = cal.report["candidates"]
    assert set(cands) == {"identity", "sts", "sts-bias"} and cal.report["n_bins"] == 20
    ece = {n: c["mean_ece"] for n, c in cands.items()}
    assert cands["identity"]["calibrated"]["ece"] == cal.report["overall"]["raw"]["ece"]  # identity = raw
    lowest = min(ece.values())
    expected = "identity" if ece["identity"] <= lowest + 1e-3 else "sts" if ece["sts"] <= lowest + 1e-3 else "sts-bias"
    assert cal.report["calibrator"] == expected
    assert len(cal.report["ece_noise_floor"]) == 4 and all(f >= 0 for f in cal.report["ece_noise_floor"])
    shipped = json.loads(cal.calibration_path.read_text())
    assert shipped["name"] == cal.report["calibrator"] == cal.calibrator.name
    assert len(shipped["temperatures"]) == (0 if expected == "identity" else 4)  # one per draft position
    report_md = (cal.out / "calibration_report.md").read_text()
    assert "STS + bias" in report_md and "no calibration (raw)" in report_md
    # a refit from the saved rounds decodes nothing and, asked for one calibrator, ships that one
    again = dspark.calibrate(checkpoint=run.checkpoint, out=root / "cal", reuse_rounds=True, calibrator="sts-bias",
                             model=root / "no-such-model", quiet=True)
    assert again.calibrator.name == "sts-bias" and set(again.report["candidates"]) == {"sts-bias"}
    assert again.report["test_rounds"] == cal.report["test_rounds"]
    assert again.report["candidates"]["sts-bias"]["mean_ece"] == cands["sts-bias"]["mean_ece"]
    raw = dspark.calibrate(checkpoint=run.checkpoint, out=root / "cal", reuse_rounds=True, calibrator="identity",
                           model=root / "no-such-model", quiet=True)
    from dspark.calibration import load_calibrator

    assert raw.calibrator.name == "identity" and load_calibrator(raw.calibration_path).name == "identity"
    with pytest.raises(FileNotFoundError, match="--reuse-rounds: .*calibration_rounds.json does not exist"):
        dspark.calibrate(checkpoint=run.checkpoint, out=root / "cal-none", reuse_rounds=True, quiet=True)


def test_run_bench(tiny):
    root, target, data, run = tiny
    opts = dspark.BenchOptions(out=root / "bench", model=target, dtype="float32", drafter=run.checkpoint,
                               prompts=data.eval_prompts_path, per_domain=1, concurrency=[1, 2], repeats=1,
                               max_new_tokens=6, mode="both", profile_repeats=1, min_requests=2, quiet=True)
    bench = dspark.run_bench(opts)
    assert isinstance(bench, dspark.BenchResult) and bench.json_path.is_file()
    keys = {(r["scheduler"], r["concurrency"], r["simulated"]) for r in bench.rows}
    for s in ("plain", "fixed:k=1", "fixed:k=4", "threshold", "sps-greedy"):
        assert {(s, 1, False), (s, 2, False), (s, 1, True), (s, 2, True)} <= keys
    assert bench.markdown == (bench.out / "bench.md").read_text() and (bench.out / "profile.json").is_file()
    # curves at both ends of the workload's contexts (mean prompt, + 6 new tokens) around the main one
    profile = json.loads((bench.out / "profile.json").read_text())
    lo, hi = sorted(c["context"] for c in profile["contexts"])
    assert lo < profile["context"] < hi and hi - lo == 6
    from dspark.bench.run import replot_bench

    (bench.out / "bench.md").unlink()
    assert replot_bench(bench.out) == bench.out / "bench.png" and (bench.out / "bench.md").read_text() == bench.markdown


def test_run_bench_interleaved(tiny):
    """--interleave: a level's schedulers side by side; every run recorded, and a re-run resumes them.
    plain listed twice runs twice (plain#2, an A/A control) and is reported against its original."""
    root, target, data, run = tiny
    opts = dict(out=root / "bench-il", model=target, dtype="float32", drafter=run.checkpoint,
                prompts=data.eval_prompts_path, per_domain=1, concurrency=[2], repeats=2, max_new_tokens=6,
                mode="measure", profile_repeats=1, min_requests=2,
                schedulers=["plain", "fixed:k=4", "sps-greedy", "plain"], interleave=True, quiet=True)
    bench = dspark.run_bench(**opts)
    files = sorted(p.name for p in (bench.out / "runs").iterdir())
    assert files == sorted(f"r{r}-c2-{s}.json" for r in (0, 1) for s in ("plain", "fixed_k_4", "sps-greedy", "plain_2"))
    assert {(r["scheduler"], r["repeat"]) for r in bench.result["runs"]} == {
        (s, r) for s in ("plain", "fixed:k=4", "sps-greedy", "plain#2") for r in (0, 1)}
    (aa,) = bench.result["replicas"]
    assert (aa["replica"], aa["original"], len(aa["ratios"])) == ("plain#2", "plain", 2)
    assert "## A/A: the same scheduler run twice" in bench.markdown
    assert all(r["output_tokens"] == 4 * 6 for r in bench.result["runs"])  # max(2c, 2) requests × 6 tokens
    stamps = {p.name: p.stat().st_mtime_ns for p in (bench.out / "runs").iterdir()}
    again = dspark.run_bench(**opts)
    assert {p.name: p.stat().st_mtime_ns for p in (again.out / "runs").iterdir()} == stamps  # resumed, not re-run


def test_run_demo(tiny):
    root, target, data, run = tiny
    demo = dspark.run_demo(drafter=run.checkpoint, model=target, max_new_tokens=8, per_domain=1, repeats=1,
                           samples=200, dtype="float32", step="packed", out=root / "demo")
    assert isinstance(demo, dspark.DemoResult) and demo.all_identical and demo.speedup > 0
    assert demo.result["gamma"] == 4 and {r["domain"] for r in demo.result["greedy_identity_fp32"]} == set(DOMAINS)
    assert demo.markdown == (demo.out / "demo.md").read_text()
    assert json.loads((demo.out / "demo.json").read_text())["command"].endswith(
        f"--samples 200 --dtype float32 --step packed --gate --vocab-cut --scheduler sps-greedy --out {root / 'demo'} "
        f"--target {target} --device cpu")
    assert demo.result["speed"]["step"] == demo.result["speed"]["plain_step"] == "packed"


def test_run_demo_races_the_dtypes_on_speculative_speed(tiny):
    """--dtype auto --step auto: every dtype × eager step path rated by its best fixed draft length
    (survival of the identity rounds, overhead timed on each); plain decoding runs in its own
    fastest configuration and the baseline is the fastest plain run, HF generate timed in both
    dtypes when they differ."""
    root, target, data, run = tiny
    demo = dspark.run_demo(drafter=run.checkpoint, model=target, max_new_tokens=8, per_domain=1, repeats=1,
                           samples=200, dtype="auto", compile=False, out=root / "demo-auto")
    choice, speed = demo.result["dtype_choice"], demo.result["speed"]
    assert set(choice["speculative"]) == {f"{d}/{p}" for d in ("float32", "bfloat16") for p in ("eager", "packed")}
    best = max(choice["speculative"], key=lambda d: choice["speculative"][d]["tokens_per_second"])
    assert f"{speed['dtype']}/{speed['step']}" == f"{choice['dtype']}/{choice['path']}" == best
    plain = min(choice["plain_step_seconds"], key=choice["plain_step_seconds"].get)
    assert f"{speed['plain_dtype']}/{speed['plain_step']}" == choice["plain"] == plain
    plain_runs = {k: v for k, v in speed["median_seconds"].items() if k != "engine_dspark"}
    assert (f"hf_generate_{speed['dtype']}" in plain_runs) == (speed["plain_dtype"] != speed["dtype"])
    assert speed["baseline"] == min(plain_runs, key=plain_runs.get)
    assert demo.speedup == pytest.approx(plain_runs[speed["baseline"]] / speed["median_seconds"]["engine_dspark"])
    # the draft gate starts from the same measurements: the identity rounds' survival, the overhead
    prior = speed["gate_prior"]
    assert prior["draft_overhead"] == {"1": choice["speculative"][best]["overhead_seconds"]}
    assert len(prior["survival"]) == demo.result["gamma"]


# -- options --------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, options", [
    (["data"], DataOptions()),
    (["train", "--data", "d", "--out", "o"], TrainOptions(data="d", out="o")),
    (["calibrate", "--drafter", "ck"], CalibrateOptions(checkpoint="ck")),
    (["eval", "--drafter", "ngram"], EvalOptions(drafters=["ngram"])),
    (["bench"], BenchOptions()),
    (["demo"], DemoOptions()),
], ids=lambda v: v[0] if isinstance(v, list) else "")
def test_options_defaults_are_the_command_lines(argv, options):
    assert type(options).from_namespace(build_parser().parse_args(argv)) == options


# Options every command has (dspark.cli.core) and options a command adds to its options class.
_SHARED = {"help", "verbose", "quiet", "json"}
_COMMAND_ONLY = {"bench": {"replot"}}


@pytest.mark.parametrize("command, cls", [
    ("data", DataOptions), ("train", TrainOptions), ("calibrate", CalibrateOptions), ("eval", EvalOptions),
    ("bench", BenchOptions), ("demo", DemoOptions),
])
def test_each_option_is_declared_once_in_its_options_class(command, cls):
    """The command's argparse arguments are generated from its options class: one argument per
    field, with the field's name as dest, its flag, default, choices and help — and nothing else
    but the options every command shares."""
    import argparse

    import attrs

    from dspark.cli_docs import _subcommands
    from dspark.options import CLI, flag_name

    parser = _subcommands(build_parser())[command]
    actions = {a.dest: a for a in parser._actions}
    fields = {f.name: f for f in attrs.fields(cls) if CLI in f.metadata}
    assert set(actions) == set(fields) | _SHARED | _COMMAND_ONLY.get(command, set())
    for name, f in fields.items():
        action, spec = actions[name], f.metadata[CLI]
        assert action.help == spec.help and action.help, name
        assert list(action.option_strings[:1]) == [flag_name(f)], name
        if spec.choices is not None:
            assert tuple(action.choices) == spec.choices, name
        if f.default is attrs.NOTHING:
            assert action.required, name
        elif not isinstance(action, argparse._AppendAction):
            assert action.default == f.default, name
    assert {f.name for f in attrs.fields(cls)} - set(fields) <= {"quiet"}  # -q, shared


@pytest.mark.parametrize("make, match", [
    (lambda: DataOptions(source="web"), "source must be one of builtin, natural, both"),
    (lambda: DataOptions(no_builtin=True, source="natural"), "contradicts --source natural"),
    (lambda: DataOptions(followups_from="train.jsonl"), "needs --source natural or both"),
    (lambda: DataOptions(no_builtin=True), "no prompts"),
    (lambda: DataOptions(eval_fraction=1.0), r"eval_fraction must lie in \[0, 1\)"),
    (lambda: TrainOptions(data="d", out="o", gamma=0), "gamma must be an integer in 1..64"),
    (lambda: TrainOptions(data="d", out="o", lr=0.0), "lr must be a number > 0"),
    (lambda: TrainOptions(data="d", out="o", teacher="top5"), "teacher must be one of full, topk"),
    (lambda: CalibrateOptions(checkpoint="ck", objective="nll"), "objective must be one of ece, brier"),
    (lambda: EvalOptions(drafters=[]), "drafters must name at least one drafter"),
    (lambda: EvalOptions(drafters=["ngram"], temperatures=[-1]), "temperatures must be one or more numbers ≥ 0"),
    (lambda: BenchOptions(concurrency=[0, 4]), r"concurrency levels must be >= 1, got \[0, 4\]"),
    (lambda: BenchOptions(arrival="poisson"), "--arrival poisson needs --rate > 0"),
    (lambda: BenchOptions(threads=0), "threads must be an integer ≥ 1"),
    (lambda: DemoOptions(max_new_tokens=0), "max_new_tokens must be an integer ≥ 1, got 0"),
    (lambda: DemoOptions(dtype="float16"), "dtype must be one of auto, float32, bfloat16"),
    (lambda: DemoOptions(scheduler="sps-argmax"), "scheduler 'sps-argmax' is not lossless"),
    (lambda: DemoOptions(scheduler="plain"), "scheduler 'plain': the demo already runs plain decoding"),
    (lambda: DemoOptions(scheduler="sps-greedy:sunk=maybe"), "sunk"),
])
def test_a_bad_option_is_one_sentence(make, match):
    with pytest.raises(ValueError, match=match) as info:
        make()
    text = str(info.value)
    assert "\n" not in text and text.count(". ") == 0, text


def test_checks_before_any_model_loads(tmp_path):
    """Missing files, unknown names and lossy schedulers fail first: the model path does not exist,
    so reaching the model load would raise a different error."""
    nowhere = str(tmp_path / "no-model")
    with pytest.raises(FileNotFoundError, match="neither a drafter checkpoint folder"):
        dspark.evaluate(drafters=["ngram", str(tmp_path / "no-ckpt")], model=nowhere)
    with pytest.raises(FileNotFoundError, match="neither a drafter checkpoint folder"):
        dspark.calibrate(checkpoint=tmp_path / "no-ckpt", model=nowhere)
    with pytest.raises(FileNotFoundError, match="prompt file"):
        dspark.evaluate(drafters=["ngram"], prompts=tmp_path / "none.jsonl", model=nowhere)
    with pytest.raises(ValueError, match="unknown drafter kind 'nope'"):
        dspark.train(data=tmp_path, out=tmp_path / "o", kind="nope", model=nowhere)
    with pytest.raises(FileNotFoundError, match="dspark data"):
        dspark.train(data=tmp_path, out=tmp_path / "o", model=nowhere)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="'sps-argmax' is not lossless"):
        dspark.run_bench(schedulers=["plain", "sps-argmax"], model=nowhere, out=tmp_path / "b")
    with pytest.raises(FileNotFoundError, match="--followups-from"):
        dspark.build_data(source="natural", followups_from=tmp_path / "none.jsonl", out=tmp_path / "d", model=nowhere)


def test_options_or_keywords():
    opts = TrainOptions(data="d", out="o")
    assert dspark.TrainOptions is TrainOptions and dspark.train.__module__ == "dspark.training.run"
    with pytest.raises(TypeError, match="expected a TrainOptions, got DataOptions"):
        dspark.train(DataOptions())
    with pytest.raises(ValueError, match="steps must be an integer ≥ 1"):
        dspark.train(opts, steps=0)  # keyword overrides are validated too
    assert EvalOptions(drafters="ngram", temperatures=0).temperatures == (0.0,)
    assert DataOptions(code_modules="json, re,").code_modules == ("json", "re")
    assert TrainOptions(data=Path("d"), out="o").data == "d"


def test_train_init_from_a_checkpoint_starts_at_its_weights(tiny):
    """--init-from: the checkpoint's config replaces the drafter options (here a different kind,
    rank and gamma are asked for and ignored), its weights are where training starts (one step at
    a negligible learning rate saves them back unchanged, where a target-initialised run saves
    others), and train.json records where it came from; a missing checkpoint is one clear error."""
    root, target, data, run = tiny
    base = dict(data=data.out, model=target, steps=1, seqs_per_step=4, anchors=2, features="online",
                top_k=8, save_dtype="float32", quiet=True, lr=1e-12)
    again = dspark.train(**base, out=root / "from", init_from=run.checkpoint, kind="dflash", rank=16, gamma=7)
    assert again.summary["init_from"] == str(run.checkpoint) and again.summary["kind"] == "dspark"
    assert again.summary["drafter"] == run.summary["drafter"]  # gamma 4, rank 8: the checkpoint's
    from safetensors.torch import load_file

    a, b = load_file(run.checkpoint / "model.safetensors"), load_file(again.checkpoint / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)  # lr 1e-12: unmoved
    fresh = dspark.train(**base, out=root / "fresh", rank=8, gamma=4)  # target-initialised: other weights
    c = load_file(fresh.checkpoint / "model.safetensors")
    assert any(not torch.allclose(a[k], c[k], atol=1e-3) for k in a if a[k].is_floating_point())
    with pytest.raises(ValueError, match="does not exist"):
        dspark.train(**base, out=root / "nope", init_from=root / "no-such-checkpoint")


def test_a_calibrated_stacked_confidence_json_leaves_calibrate_on_the_head(tiny):
    """Beside a calibrated `stacked` confidence.json, `dspark calibrate` still fits the head's logits
    (the calibration.json vLLM / TensorRT-LLM read): its rounds carry the same confidences as the
    folder without it; `dspark eval` scores the stack and says so."""
    import shutil

    from dspark.confidence import StackedConfidence

    root, target, data, run = tiny
    folder = root / "stacked-ck"
    shutil.copytree(run.checkpoint, folder)
    from dspark.drafters.checkpoint import read_config

    gamma = read_config(folder).gamma
    StackedConfidence(["head", "max-prob"], [[0.3, 0.2, 0.1, 0.1, -0.5]] * gamma, [0.0, 0.0], [1.0, 1.0]).save(
        folder / "confidence.json")
    kw = dict(skip=0, per_domain=2, prompts=data.eval_prompts_path, model=target, max_new_tokens=8, quiet=True)
    with_stack = dspark.calibrate(checkpoint=folder, out=root / "cal-stack", **kw)
    without = dspark.calibrate(checkpoint=run.checkpoint, out=root / "cal-head", **kw)
    rounds = [json.loads((c.out / "calibration_rounds.json").read_text()) for c in (with_stack, without)]
    drop = lambda r: {k: v for k, v in r.items() if k != "seconds"}  # noqa: E731  (timings differ)
    assert drop(rounds[0]["test"]) == drop(rounds[1]["test"])  # the head's logits both times
    ev = dspark.evaluate(drafters=[f"s={folder}"], temperatures=[0], prompts=data.eval_prompts_path, model=target,
                         per_domain=2, max_new_tokens=8, concurrency=2, out=root / "eval-stack", quiet=True)
    assert ev.results["runs"]["s@T=0.0"]["calibrated_with"] == "stacked (confidence.json)"
