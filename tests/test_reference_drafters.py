"""dspark's DSpark / DFlash drafters against the reference implementation's own outputs.

The fixtures (tests/fixtures/reference-drafters, made by DeepSpec and speculators; their README
defines every tensor) are the oracle: each DeepSpec checkpoint is read through dspark's format
reader and driven through the public ``draft`` API for both recorded rounds (round 2 on the
cached context), and every block hidden state, base / step / confidence logit and greedy draft
token must equal the reference's.
"""

from __future__ import annotations

import pytest
import torch

import reference_fixtures as rf
from dspark.drafters.checkpoint import from_pretrained
from dspark.drafters.loop import backbone
from dspark.protocols.drafter import DraftContext
from dspark.types import SamplingParams

ATOL = 1e-5


@pytest.fixture(scope="module")
def target(one_thread):
    return rf.target()


def _round(drafter, t, r):
    ids = t[f"round_{r}/known_ids"]
    ctx = DraftContext(["req"], [ids], [SamplingParams.greedy()],
                       features={"hidden": [t[f"round_{r}/target_hidden_states"]]})
    return drafter.draft(ctx)


@pytest.mark.parametrize("name", rf.DEEPSPEC_BLOCK)
def test_deepspec_drafter_matches_reference_rounds(name, target):
    t, meta = rf.cases(name)
    drafter = from_pretrained(rf.folder(name), target)
    assert drafter.config.kind == ("dflash" if "dflash" in name else "dspark")
    for r in (1, 2):
        block = _round(drafter, t, r)
        torch.testing.assert_close(block.hidden[0].float(), t[f"round_{r}/block_hidden"], atol=ATOL, rtol=0)
        # base logits: the backbone alone (the cache now holds exactly this round's context)
        ids = t[f"round_{r}/known_ids"]
        h, U = backbone(drafter.loop, ids[-1:], torch.tensor([ids.numel() - 1]), [drafter.loop.caches["req"]])
        torch.testing.assert_close(U[0].float(), t[f"round_{r}/base_logits"], atol=ATOL, rtol=0)
        torch.testing.assert_close(block.draft_logits[0].float(), t[f"round_{r}/step_logits"], atol=ATOL, rtol=0)
        assert block.tokens[0].tolist() == t[f"round_{r}/draft_tokens"].tolist()
        if drafter.confidence_head is not None:
            torch.testing.assert_close(block.confidence_logits[0], t[f"round_{r}/confidence_logits"], atol=ATOL, rtol=0)
        else:
            assert block.confidence_logits is None


@pytest.mark.parametrize("name", ["speculators-dspark", "speculators-dflash"])
def test_speculators_folder_drafts_as_its_deepspec_twin(name, target):
    """speculators folders hold the DeepSpec tensors: read as speculators, they draft identically."""
    twin = {"speculators-dspark": "deepspec-dspark-vanilla", "speculators-dflash": "deepspec-dflash"}[name]
    t, _ = rf.cases(twin)
    drafter = from_pretrained(rf.folder(name), target)
    assert drafter.config.target_layer_ids == (0, 2, 4)  # aux ids [1, 3, 5] − 1
    for r in (1, 2):
        block = _round(drafter, t, r)
        torch.testing.assert_close(block.draft_logits[0].float(), t[f"round_{r}/step_logits"], atol=ATOL, rtol=0)
        assert block.tokens[0].tolist() == t[f"round_{r}/draft_tokens"].tolist()
