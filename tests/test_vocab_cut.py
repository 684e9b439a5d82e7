"""A checkpoint's measured vocabulary cut (dspark.drafters.vocab_cut) and the demo's race of it.

* the record is written from a `dspark eval` of the drafter and its `:vocab=K` variant of the same
  weights at temperature 0, and refused in one sentence otherwise (nothing written);
* it is raced only for the weights it was measured on and within 1 % of τ: each refusal says why;
* writing it leaves the folder's digest (the eval caches' provenance) unchanged;
* the race's rule against tokens per second computed directly, and the demo's race on a tiny
  checkpoint: the cut where the full drafter's round is far dearer, the full drafter where not.
"""

from __future__ import annotations

import json

import pytest
import torch

import dspark
from dspark.drafters.checkpoint import save_pretrained
from dspark.drafters.prune import save_token_ranking
from dspark.drafters.vocab_cut import (
    VOCAB_CUT_NAME,
    VocabCut,
    cut_pays,
    raceable_cut,
    record_vocab_cut,
)
from dspark.fast import FastTarget
from dspark.provenance import files_digest
from helpers import race_eager_runner_only, tiny_causal_lm
from test_fast_step import FLAT

V = 16
pytestmark = pytest.mark.usefixtures("one_thread")


def _folder(tmp_path, name="d"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text('{"kind": "dspark"}\n')
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


def _eval(tmp_path, folder, tau_full=2.0, tau_cut=1.99, temperature=0.0, digest=None, k=10):
    digest = digest or files_digest(folder)

    def run(spec, tau):
        return {"drafter": spec.partition("=")[0] or folder.name, "temperature": temperature,
                "provenance": {"drafter": spec, "checkpoint_digest": digest, "temperature": temperature,
                               "prompts": "natural_eval.jsonl", "prompts_digest": "p", "model": "m",
                               "dtype": "bfloat16", "max_new_tokens": 96},
                "overall": {"tau": tau, "rounds": 100}}

    runs = {f"{folder.name}@T={temperature}": run(str(folder), tau_full),
            f"cut@T={temperature}": run(f"cut={folder}:vocab={k}", tau_cut)}
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"prompts": 30, "command": "dspark eval …", "runs": runs}))
    return path


def test_a_recorded_cut_within_one_percent_is_raced(tmp_path):
    folder = _folder(tmp_path)
    before = files_digest(folder)
    path = record_vocab_cut(folder, _eval(tmp_path, folder, 2.251, 2.230, k=10))
    assert path == folder / VOCAB_CUT_NAME
    assert files_digest(folder) == before  # the record is no part of the weights' digest
    cut, why = raceable_cut(folder)
    assert why == "" and cut == VocabCut(10, 2.251, 2.230, before, cut.evidence)
    assert cut.tau_ratio == pytest.approx(2.230 / 2.251) and cut.reference == ":vocab=10"
    assert cut.evidence["prompts_count"] == 30 and cut.evidence["temperature"] == 0.0


def test_each_refusal_to_race_says_why(tmp_path):
    folder = _folder(tmp_path)
    assert raceable_cut(folder) == (None, f"d records no measured vocabulary cut ({VOCAB_CUT_NAME})")
    record_vocab_cut(folder, _eval(tmp_path, folder, 2.0, 1.97))  # −1.5 %
    cut, why = raceable_cut(folder)
    assert cut is None and "lost 1.5% of τ" in why and "more than 1%" in why
    assert raceable_cut(folder, tolerance=0.02)[0] is not None
    record_vocab_cut(folder, _eval(tmp_path, folder, 2.0, 1.99))
    (folder / "model.safetensors").write_bytes(b"retrained")  # new weights: the record is not theirs
    cut, why = raceable_cut(folder)
    assert cut is None and "measured on other weights" in why
    (folder / VOCAB_CUT_NAME).write_text('{"draft_vocab": 0}')
    cut, why = raceable_cut(folder)
    assert cut is None and "is not a vocabulary-cut record" in why


@pytest.mark.parametrize("case", ["other weights", "sampled", "no cut run", "not an eval"])
def test_a_record_from_the_wrong_eval_is_refused_and_nothing_written(tmp_path, case):
    folder = _folder(tmp_path)
    if case == "not an eval":
        path = tmp_path / "eval.json"
        path.write_text("[1, 2]")
        match = "not a dspark eval result"
    else:
        path = _eval(tmp_path, folder, digest="0" * 32 if case == "other weights" else None,
                     temperature=1.0 if case == "sampled" else 0.0)
        if case == "no cut run":
            data = json.loads(path.read_text())
            data["runs"].pop("cut@T=0.0")
            path.write_text(json.dumps(data))
        match = "no pair of greedy"
    with pytest.raises(ValueError, match=match):
        record_vocab_cut(folder, path)
    assert not (folder / VOCAB_CUT_NAME).exists()


def test_the_race_rule_is_tokens_per_second():
    g = torch.Generator().manual_seed(0)
    for _ in range(500):
        tau_full, ratio, t, o, o_cut = torch.rand(5, generator=g).tolist()
        cut = VocabCut(5, 1 + 3 * tau_full, (1 + 3 * tau_full) * (0.97 + 0.03 * ratio), "x")
        verify, overhead, cut_overhead = 0.01 + 0.03 * t, 0.02 * o, 0.02 * o_cut
        direct = cut.tau_cut / (verify + cut_overhead) > cut.tau_full / (verify + overhead)
        assert cut_pays(cut, verify, overhead, cut_overhead) == direct


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A tiny target and a saved DSpark drafter with a token ranking and a record of its cut."""
    model = tiny_causal_lm("llama", vocab_size=V, max_positions=96)
    target = FastTarget(model, path="packed")
    torch.manual_seed(3)
    drafter = dspark.get_drafter("dspark", target=target, gamma=4, head="vanilla-markov", rank=8, num_layers=2)
    root = tmp_path_factory.mktemp("vc")
    folder = save_pretrained(drafter, root / "d")
    save_token_ranking(folder, [list(range(V - 1, -1, -1))], "test")
    record_vocab_cut(folder, _eval(root, folder, 2.0, 1.995, k=12))
    return target, folder


def _timed_overheads(monkeypatch, full_overhead: float) -> None:
    """fastest_drafter's runner race on the eager runner alone, the full drafter's overhead set to
    ``full_overhead`` seconds (the cut keeps its measured one, a few milliseconds)."""
    race_eager_runner_only(monkeypatch, overhead=lambda d, s: s if d.config.draft_vocab_size else full_overhead)


@pytest.mark.parametrize("full_overhead,wins", [(10.0, True), (0.0, False)])
def test_the_fastest_drafter_races_the_recorded_cut(tiny_checkpoint, monkeypatch, full_overhead, wins):
    from dspark.fast.drafter import fastest_drafter

    target, folder = tiny_checkpoint
    _timed_overheads(monkeypatch, full_overhead)
    ids = [torch.tensor([3, 5, 7, 3, 5]), torch.tensor([1, 2, 9, 4])]
    setup = fastest_drafter(folder, target, ids, FLAT, 1e-3)
    record = setup.vocab_race
    assert record["raced"] and record["draft_vocab"] == 12
    assert setup.draft_vocab == (12 if wins else None)
    assert record["chosen"] == ("d:vocab=12" if wins else "d")
    assert (setup.drafter.config.draft_vocab_size == 13) == wins  # 12 tokens and the placeholder slot
    assert setup.runner.runner == "eager" and setup.overhead_seconds == (record["overhead_cut"] if wins else full_overhead)
    assert f"{record['chosen']} drafts more tokens a second" in record["reason"]


def test_the_fastest_drafter_races_no_cut_where_none_is_asked_for_or_recorded(tiny_checkpoint, monkeypatch, tmp_path,
                                                                              caplog):
    from dspark.fast.drafter import fastest_drafter

    target, folder = tiny_checkpoint
    _timed_overheads(monkeypatch, 10.0)  # a cut raced would win
    ids = [torch.tensor([3, 5, 7, 3, 5])]
    asked = fastest_drafter(folder, target, ids, FLAT, 1e-3, draft_vocab=6)  # the user's own cut
    assert asked.draft_vocab == 6 and asked.drafter.config.draft_vocab_size == 7 and asked.vocab_race is None
    assert fastest_drafter(folder, target, ids, FLAT, 1e-3, race_cut=False).vocab_race is None
    bare = save_pretrained(dspark.from_pretrained(folder, target), tmp_path / "bare")  # no vocab_cut.json
    with caplog.at_level("INFO", logger="dspark.fast.drafter"):
        setup = fastest_drafter(bare, target, ids, FLAT, 1e-3)
    assert setup.draft_vocab is None and not setup.vocab_race["raced"]
    assert setup.vocab_race["reason"].startswith("vocabulary cut not raced: ")
    assert setup.vocab_race["reason"] in caplog.messages  # the start-up log says why, in one line
