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
from dspark.drafters.dflash.round import backbone
from dspark.protocols import TargetFeatures
from dspark.protocols.drafter import DraftContext
from dspark.types import SamplingParams

ATOL = 1e-5
SPECULATORS_BLOCK = ("speculators-dspark", "speculators-dflash")


@pytest.fixture(scope="module")
def target(one_thread):
    return rf.target()


def _round(drafter, t, r):
    ids = t[f"round_{r}/known_ids"]
    ctx = DraftContext(["req"], [ids], [SamplingParams.greedy()],
                       features=TargetFeatures([t[f"round_{r}/target_hidden_states"]]))
    return drafter.draft(ctx)


@pytest.mark.parametrize("name", rf.DEEPSPEC_BLOCK)
def test_deepspec_drafter_matches_reference_rounds(name, target):
    t, meta = rf.cases(name)
    drafter = from_pretrained(rf.folder(name), target)
    assert drafter.config.kind == meta["kind"].split("-")[0]  # "dspark-gated" → dspark
    assert drafter.config.target_layer_ids == rf.layer_ids(name)
    assert drafter.gamma == rf.block_size(name) and drafter.config.mask_token_id == rf.mask_token_id(name)
    for r in rf.rounds(name):
        block = _round(drafter, t, r)
        assert block.tokens.shape == (1, rf.block_size(name))
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


@pytest.mark.parametrize("name", SPECULATORS_BLOCK)
def test_speculators_folder_drafts_as_its_deepspec_twin(name, target):
    """speculators folders hold the DeepSpec tensors: read as speculators, they draft identically."""
    twin = rf.twin(name)  # cases.json "weights_from"
    assert twin != name and twin in rf.DEEPSPEC_BLOCK
    t, _ = rf.cases(twin)
    drafter = from_pretrained(rf.folder(name), target)
    # speculators' aux ids are DeepSpec's + 1 (they count the embedding output)
    assert [i + 1 for i in drafter.config.target_layer_ids] == rf.config(name)["aux_hidden_state_layer_ids"]
    assert drafter.config.target_layer_ids == rf.layer_ids(twin)
    for r in rf.rounds(twin):
        block = _round(drafter, t, r)
        torch.testing.assert_close(block.draft_logits[0].float(), t[f"round_{r}/step_logits"], atol=ATOL, rtol=0)
        assert block.tokens[0].tolist() == t[f"round_{r}/draft_tokens"].tolist()


def test_the_fixture_sets_dimensions_agree_with_its_configs():
    """Every size the reference tests read through ``reference_fixtures`` (from the configs) is the
    size the set's own tensors and cases.json have: the tests assume no dimension of their own."""
    from safetensors import safe_open

    V, d = rf.vocab_size(), rf.hidden_size()
    for name in (*rf.DEEPSPEC_BLOCK, "deepspec-eagle3"):
        t, meta = rf.cases(name)
        inf, c = meta["inference"], rf.config(name)
        gamma, ids = rf.block_size(name), rf.layer_ids(name)
        assert c["vocab_size"] == V and c["hidden_size"] == d and c["num_target_layers"] == rf.num_target_layers()
        assert c.get("head_dim", rf.head_dim()) == rf.head_dim() and c["num_key_value_heads"] == rf.num_kv_heads()
        assert tuple(inf["target_layer_ids_deepspec"]) == ids and inf["hidden_states_index"] == [i + 1 for i in ids]
        assert all(-1 <= i < rf.num_target_layers() - 1 for i in ids)  # DeepSpec forbids the final-normed last layer
        with safe_open(str(rf.folder(name) / "model.safetensors"), "pt") as f:
            assert tuple(f.get_slice("embed_tokens.weight").get_shape()) == (V, d)
            assert tuple(f.get_slice("fc.weight").get_shape()) == (d, rf.feature_width(name))
            if c.get("markov_rank"):
                assert tuple(f.get_slice("markov_head.markov_w1.weight").get_shape()) == (V, c["markov_rank"])
        first = "prefill/target_hidden_states" if name == "deepspec-eagle3" else "round_1/target_hidden_states"
        assert t[first].shape == (t["prompt_ids"].numel(), rf.feature_width(name))
        assert not set(t["prompt_ids"].tolist()) & rf.mask_token_ids()
        for r in rf.rounds(name):
            assert t[f"round_{r}/step_logits"].shape == (gamma, V)
            assert t[f"round_{r}/draft_tokens"].shape == (gamma,)
            assert t[f"round_{r}/verify_input_ids"].shape == (gamma + 1,)
            if name != "deepspec-eagle3":
                assert inf["block_size"] == gamma and inf["mask_token_id"] == rf.mask_token_id(name)
                assert t[f"round_{r}/block_hidden"].shape == (gamma, d)
                anchor = t[f"round_{r}/known_ids"][-1:]
                assert t[f"round_{r}/draft_input_ids"].tolist() == [*anchor.tolist(), *[rf.mask_token_id(name)] * (gamma - 1)]
            else:
                assert inf["ttt_length"] == gamma and t[f"round_{r}/step_hidden"].shape == (gamma, d)
        if any(k.startswith("train/") for k in t):
            n_anchors = meta["train"]["num_anchors"]
            assert t["train/draft_logits"].shape == (n_anchors, gamma, V) and c["num_anchors"] == n_anchors
            assert t["train/target_hidden_states"].shape == (meta["train"]["seq_len"], rf.feature_width(name))
    for name in SPECULATORS_BLOCK + ("speculators-eagle3",):
        twin = rf.twin(name)
        assert rf.layer_ids(name) == rf.layer_ids(twin) and rf.block_size(name) == rf.block_size(twin)
        if name != "speculators-eagle3":
            assert rf.mask_token_id(name) == rf.mask_token_id(twin)
        assert rf.config(name)["draft_vocab_size"] == V
