"""Drafters, target and Engine on every device this machine has (CPU always; CUDA when present).

The CUDA cases skip with the reason on a machine without one; a GPU machine runs them (the drafting
loop builds its small index tensors on the CPU and the runner moves them; acceptance runs on the
CPU where the requests' generators live).
"""

from __future__ import annotations

import pytest
import torch

import dspark
from dspark.protocols import DraftContext, TargetFeatures
from dspark.targets import HFTarget
from dspark.types import SamplingParams
from helpers import greedy_decode, tiny_causal_lm

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not CUDA, reason="no CUDA device visible to torch (a CPU-only build or no GPU)")])]
KINDS = {"dspark": {"head": "gated-markov", "rank": 8, "num_layers": 2}, "dflash": {"num_layers": 2}, "eagle3": {}}


def _drafter(target, kind):
    torch.manual_seed(1)
    d = dspark.get_drafter(kind, target=target, gamma=4, **KINDS[kind])
    for p in d.parameters():
        if p.ndim > 1:
            torch.nn.init.normal_(p, std=0.2)
    return d


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("device", DEVICES)
def test_drafter_on_device_drafts_as_on_the_cpu(device, kind):
    model = tiny_causal_lm()
    cpu = _drafter(HFTarget(model), kind)
    moved = _drafter(HFTarget(model), kind)
    moved.load_state_dict(cpu.state_dict())
    moved.to(device)
    moved.bind_target(model.get_input_embeddings().weight.to(device), model.get_output_embeddings().weight.to(device))
    ids = torch.tensor([3, 5, 7, 3, 5, 7, 3])
    with torch.no_grad():
        hs = model(ids[None], output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i + 1][0, :-1] for i in cpu.target_layer_ids], dim=-1)  # [n − 1, m·d]
    blocks = [d.draft(DraftContext(["r"], [ids], [SamplingParams.greedy()], features=TargetFeatures([f])))
              for d, f in ((cpu, feats), (moved, feats.to(device)))]
    assert blocks[1].tokens.device.type == "cpu"  # drafts come back where verification runs
    assert blocks[0].tokens.tolist() == blocks[1].tokens.tolist()
    torch.testing.assert_close(blocks[1].draft_logits.float(), blocks[0].draft_logits.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_engine_on_device_is_token_identical_to_greedy_decode(device):
    model = tiny_causal_lm()
    expected = greedy_decode(model, torch.tensor([2, 9, 4, 4, 11, 2, 9, 4]), 12)
    model = model.to(device)
    target = HFTarget(model)
    drafter = _drafter(target, "dspark")
    engine = dspark.Engine(target, drafter, scheduler="full", cost_model=None)
    out = engine.generate([torch.tensor([2, 9, 4, 4, 11, 2, 9, 4])], max_new_tokens=12, progress=False)
    assert out[0].output_ids == expected


def test_a_device_that_is_not_here_is_refused_before_a_model_loads(tmp_path, capsys):
    from dspark.cli import main
    from dspark.models import resolve_device

    assert resolve_device(None) == resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if CUDA else "cpu")
    for bad, says in (("tpu", "not a torch device"), ("cuda:x", "not a torch device"), ("meta", "cpu or cuda")):
        with pytest.raises(ValueError, match=says):
            resolve_device(bad)
    if not CUDA:
        with pytest.raises(ValueError, match="torch sees no CUDA device"):
            resolve_device("cuda")
        with pytest.raises(ValueError, match="no CUDA device"):
            dspark.BenchOptions(device="cuda")
    nowhere = str(tmp_path / "no-such-model")  # the device is refused first: the missing model is never reached
    assert main(["profile", "--target", nowhere, "--device", "gpu", "--out", str(tmp_path / "p.json")]) == 2
    assert "device 'gpu' is not a torch device" in capsys.readouterr().err


@pytest.mark.parametrize("device", DEVICES)
def test_profile_and_bench_run_where_they_are_told(device, tmp_path):
    """`--device` of profile, bench, demo, eval, data and generate: the target, and the drafter loaded
    for it from a checkpoint, run on the device; every scheduler serves the whole workload, the demo's
    outputs equal greedy decoding."""
    import json

    from transformers import AutoTokenizer

    from dspark.cli import main
    from dspark.drafters.checkpoint import from_pretrained, save_pretrained
    from dspark.targets import load_target
    from helpers import save_tiny_target

    folder = save_tiny_target(tmp_path / "target", tiny_causal_lm(max_positions=256))
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(folder)
    target = load_target(str(folder), device=device)
    assert target.model.device.type == device
    save_pretrained(_drafter(HFTarget(tiny_causal_lm(max_positions=256)), "dspark"), tmp_path / "drafter")
    drafter = from_pretrained(tmp_path / "drafter", target)  # follows the target to its device
    assert {p.device.type for p in drafter.parameters()} == {device}
    out = tmp_path / "p.json"
    assert main(["profile", "--target", str(folder), "--device", device, "--out", str(out), "--requests", "1,2",
                 "--widths", "1,3", "--contexts", "16", "--repeats", "1", "--quiet"]) == 0
    recorded = json.loads(out.read_text())["device"]
    assert ("core" in recorded) == (device == "cpu")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"t{i} t{i + 3} t{i + 1} t{i + 3}", "domain": d}) + "\n"
                               for i, d in enumerate(("math", "code", "chat"))))
    bench = dspark.run_bench(out=tmp_path / "bench", model=folder, dtype="float32", drafter=tmp_path / "drafter",
                             prompts=prompts, per_domain=1, concurrency=[2], repeats=1, max_new_tokens=6,
                             profile=out, schedulers=["plain", "fixed:k=4", "sps-greedy"], min_requests=3,
                             device=device, quiet=True)
    assert bench.result["meta"]["device"] == recorded
    runs = {r["scheduler"]: r for r in bench.result["runs"] if not r["simulated"]}
    assert set(runs) == {"plain", "fixed:k=4", "sps-greedy"}
    assert all(r["requests"] == 4 and r["output_tokens"] == 24 for r in runs.values())  # max(2c, 3) × 6
    assert runs["fixed:k=4"]["drafted_fraction"] == 1.0 and runs["fixed:k=4"]["draft_ms"] > 0
    demo = dspark.run_demo(drafter=tmp_path / "drafter", model=folder, prompts=prompts, max_new_tokens=6,
                           per_domain=1, repeats=1, samples=200, dtype="float32", device=device, out=tmp_path / "demo")
    assert demo.all_identical and demo.result["device"] == recorded and demo.result["device_type"] == device
    ev = dspark.evaluate(drafters=[str(tmp_path / "drafter")], model=folder, prompts=prompts, per_domain=1,
                         max_new_tokens=6, device=device, out=tmp_path / "eval", quiet=True)
    assert ev.results["prompts"] == 3
    data = dspark.build_data(out=tmp_path / "data", prompts=[prompts], no_builtin=True, model=folder, dtype="float32",
                             temperature=0, max_new_tokens=4, concurrency=2, eval_fraction=0.3, device=device, quiet=True)
    assert data.written == data.train_prompts and data.tokens == 4 * data.written
    assert main(["generate", "t1 t2 t3", "--target", str(folder), "--drafter",
                 str(tmp_path / "drafter"), "--device", device, "--dtype", "float32", "--max-new-tokens", "6"]) == 0
