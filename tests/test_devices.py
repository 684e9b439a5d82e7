"""Drafters, target and Engine on every device this machine has (CPU always; CUDA when present).

The CUDA cases skip with the reason on a machine without one; a GPU machine runs them (the drafting
loop builds its small index tensors on the CPU and the runner moves them; acceptance runs on the
CPU where the requests' generators live).
"""

from __future__ import annotations

import pytest
import torch

import dspark
from dspark.protocols import DraftContext
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
    blocks = [d.draft(DraftContext(["r"], [ids], [SamplingParams.greedy()], features={"hidden": [f]}))
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
