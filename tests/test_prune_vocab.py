"""The `:vocab=K` variant (dspark.drafters.prune): a full-vocabulary drafter cut to K tokens.

Oracle: the uncut drafter itself. Where the kept tokens include every token it drafts (and the
anchor), the cut drafter must draft the same tokens with the same logits on the kept tokens and
q renormalised over them. Losslessness of engines running a cut drafter is covered by
tests/test_engine.py's battery (drafter `dspark-cut:vanilla-markov`, every scheduler, greedy and χ²).
"""

from __future__ import annotations

import json

import pytest
import torch

import dspark
from dspark.checkpoints import DEFAULT_DRAFTER
from dspark.drafters.checkpoint import from_pretrained, save_pretrained
from dspark.drafters.prune import (
    parse_drafter_ref,
    prune_draft_vocab,
    rank_tokens,
    read_token_ranking,
    save_token_ranking,
)
from dspark.evaluation.drafter_specs import load_drafter_spec, spec_path
from dspark.protocols import DraftContext, TargetFeatures
from dspark.targets import HFTarget
from dspark.types import SamplingParams
from helpers import tiny_causal_lm

V = 16
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return HFTarget(tiny_causal_lm("llama", vocab_size=V, max_positions=96))


def _drafter(target, head="vanilla-markov"):
    torch.manual_seed(3)
    if head == "eagle3":
        d = dspark.get_drafter("eagle3", target=target, gamma=4)
    else:
        d = dspark.get_drafter("dspark", target=target, gamma=4, head=head, rank=8, num_layers=2)
    for p in d.parameters():
        if p.ndim > 1:
            torch.nn.init.normal_(p, std=0.3)
    return d.eval()


def _draft(target, drafter, seq, rid="r", sampling=None):
    """One greedy round from a fresh loop over the prefill features of ``seq`` (anchor = seq[-1])."""
    target.set_capture_layers(drafter.target_layer_ids)
    out = target.prefill(["p"], [seq], logits=False)
    feats = torch.cat([out.hidden_states[k] for k in drafter.target_layer_ids], -1)[0, : seq.numel() - 1]  # [n - 1, m·d]
    target.release("p")
    drafter.release(rid)
    ctx = DraftContext([rid], [seq], [sampling or SamplingParams.greedy()], [torch.Generator().manual_seed(0)],
                       features=TargetFeatures([feats], [0]))
    return drafter.draft(ctx)


SEQS = [torch.tensor([3, 5, 7, 3, 5, 7, 3, 5]), torch.tensor([2, 9, 4, 4, 11, 2, 9, 13, 6, 1])]


@pytest.mark.parametrize("head", ["vanilla-markov", "gated-markov", "eagle3"])
@pytest.mark.parametrize("seq", range(len(SEQS)))
def test_cut_drafter_drafts_what_the_full_one_drafts_on_the_kept_tokens(target, head, seq):
    full = _drafter(target, head)
    ref = _draft(target, full, SEQS[seq])
    drafted = ref.tokens[0].tolist()
    left_out = [t for t in range(V) if t not in drafted and t != int(SEQS[seq][-1])][::2]  # γ + 1 < V
    kept = [t for t in range(V) if t not in left_out]  # ⊇ the drafts and the anchor, K < V
    cut = prune_draft_vocab(full, torch.tensor(kept))
    assert cut.config.draft_vocab_size == len(kept) + 1 and cut.draft_size == len(kept) + 1
    got = _draft(target, cut, SEQS[seq])
    assert got.tokens[0].tolist() == drafted
    other = [t for t in range(V) if t not in kept]
    torch.testing.assert_close(got.draft_logits[0][:, kept], ref.draft_logits[0][:, kept], atol=1e-5, rtol=1e-5)
    assert bool((got.draft_logits[0][:, other] < -1e3).all())  # never drafted
    torch.testing.assert_close(got.q, ref.q)  # greedy: one-hot at the same tokens, in the target's V
    # sampled (T = 1): position 1 (x̂_0 = the anchor in both) draws from the full drafter's q_1
    # renormalised over the kept tokens, and nothing outside them
    ref1 = _draft(target, full, SEQS[seq], sampling=SamplingParams(temperature=1.0))
    got1 = _draft(target, cut, SEQS[seq], sampling=SamplingParams(temperature=1.0))
    q1 = torch.softmax(ref1.draft_logits[0, 0, kept].double(), -1)  # [K]
    torch.testing.assert_close(got1.q[0, 0, kept].double(), q1, atol=1e-5, rtol=1e-4)
    assert float(got1.q[0, :, other].abs().max()) == 0.0


def test_an_anchor_outside_the_kept_tokens_gets_no_correction(target):
    full = _drafter(target)
    seq = SEQS[0]
    kept = [t for t in range(V) if t != int(seq[-1])]
    cut = prune_draft_vocab(full, torch.tensor(kept))
    slot = int(cut.to_draft(seq[-1:])[0])
    assert slot == len(kept)  # the placeholder
    assert float(cut.head.w_down.weight[slot].detach().abs().max()) == 0.0
    assert float(cut.head.w_up.weight[slot].detach().abs().max()) == 0.0
    _draft(target, cut, seq)  # drafts (from the uncorrected U) without error


def test_checkpoint_ranking_and_round_trip(target, tmp_path):
    full = _drafter(target)
    folder = save_pretrained(full, tmp_path / "d")
    with pytest.raises(FileNotFoundError, match="token_ranking.json"):
        from_pretrained(folder, target, draft_vocab=4)
    answers = [[5, 5, 5, 7, 7, 2], [7, 2, 9], [5]]  # counts: 5×4, 7×3, 2×2, 9×1
    assert rank_tokens(answers) == ([5, 7, 2, 9], 10)
    save_token_ranking(folder, answers, "test answers")
    assert read_token_ranking(folder, V) == [5, 7, 2, 9]
    cut = from_pretrained(folder, target, draft_vocab=3)
    assert cut.draft_ids.tolist() == [5, 7, 2, 5]  # last: the placeholder slot
    # the same cut written as a reference, "FOLDER:vocab=K", and a reference that disagrees
    assert from_pretrained(f"{folder}:vocab=3", target).draft_ids.tolist() == [5, 7, 2, 5]
    assert from_pretrained(f"{folder}:vocab=2", target, draft_vocab=2).draft_ids.tolist() == [5, 7, 5]
    with pytest.raises(ValueError, match="ask for different cuts"):
        from_pretrained(f"{folder}:vocab=3", target, draft_vocab=2)
    with pytest.raises(ValueError, match="ranks 4 tokens; cannot keep 5"):
        from_pretrained(folder, target, draft_vocab=5)
    with pytest.raises(ValueError, match="needs the target"):
        from_pretrained(folder, None, draft_vocab=3)
    # the cut drafter saves as a dspark checkpoint with its draft vocabulary, and loads back the same
    back = from_pretrained(save_pretrained(cut, tmp_path / "cut"), target)
    assert back.draft_ids.tolist() == cut.draft_ids.tolist()
    a, b = _draft(target, cut, SEQS[1]), _draft(target, back, SEQS[1])
    assert a.tokens.tolist() == b.tokens.tolist()
    torch.testing.assert_close(a.draft_logits, b.draft_logits)


def test_bad_rankings_and_specs_are_named(target, tmp_path):
    full = _drafter(target)
    folder = save_pretrained(full, tmp_path / "d")
    (folder / "token_ranking.json").write_text(json.dumps({"ranking": [1, 2, 99]}))
    with pytest.raises(ValueError, match=r"in \[0, 16\); out of range: \[99\]"):
        from_pretrained(folder, target, draft_vocab=2)
    (folder / "token_ranking.json").write_text(json.dumps({"ranking": [1, 2, 1]}))
    with pytest.raises(ValueError, match="repeated"):
        from_pretrained(folder, target, draft_vocab=2)
    (folder / "token_ranking.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a token ranking"):
        from_pretrained(folder, target, draft_vocab=2)
    with pytest.raises(ValueError, match="positive integer K, got 'abc'"):
        parse_drafter_ref(f"{DEFAULT_DRAFTER}:vocab=abc")
    with pytest.raises(ValueError, match="already has a reduced vocabulary"):
        prune_draft_vocab(prune_draft_vocab(full, torch.arange(4)), torch.arange(2))
    with pytest.raises(ValueError, match="distinct"):
        prune_draft_vocab(full, torch.tensor([1, 1, 2]))
    with pytest.raises(ValueError, match="between 1 and 15"):
        prune_draft_vocab(full, torch.arange(V))


def test_drafter_specs_with_a_vocabulary_cut(target, tmp_path):
    assert parse_drafter_ref(f"{DEFAULT_DRAFTER}:vocab=8192") == (DEFAULT_DRAFTER, 8192)
    assert parse_drafter_ref("runs/x/checkpoint") == ("runs/x/checkpoint", None)
    assert spec_path(f"{DEFAULT_DRAFTER}:vocab=8192") == DEFAULT_DRAFTER
    assert spec_path(f"fast={DEFAULT_DRAFTER}:vocab=8192") == DEFAULT_DRAFTER
    assert spec_path("plain=runs/a") == "runs/a"
    folder = save_pretrained(_drafter(target), tmp_path / "mine")
    save_token_ranking(folder, [[1, 2, 3, 4, 5, 6]], "test")
    label, cut, _ = load_drafter_spec(f"{folder}:vocab=4", target)
    assert label == "mine-vocab4" and cut.draft_size == 5
    label, cut, _ = load_drafter_spec(f"small={folder}:vocab=3", target)
    assert label == "small" and cut.draft_size == 4
    label, whole, _ = load_drafter_spec(f"small={folder}", target)
    assert label == "small" and whole.config.draft_vocab_size is None
    # the plugin factory (what dspark.get_drafter(kind, checkpoint=...) reads) takes the same form
    assert dspark.get_drafter("dspark", target=target, checkpoint=f"{folder}:vocab=4").draft_size == 5


def test_calibrating_a_cut_variant_needs_its_own_out_folder(tmp_path):
    from dspark.evaluation.calibration_run import calibrate

    with pytest.raises(ValueError, match="give --out"):
        calibrate(checkpoint=f"{DEFAULT_DRAFTER}:vocab=8192")
