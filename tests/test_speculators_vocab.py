"""A reduced draft vocabulary in the speculators format (d2t / t2d), read and written.

Oracles: the reference fixtures' own rounds (a reduced folder made by hand from a speculators
fixture by speculators' rules — ids sorted ascending, d2t = ids − arange, t2d a bool mask, the
lm_head / markov_w2 rows of the kept ids, markov_w1 left over the whole vocabulary — must draft the
reference's logits on the kept tokens), and for the writer the layout read straight off the
uncut drafter's weights (not through the conversion under test).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import dspark
import reference_fixtures as rf
from dspark.drafters import formats
from dspark.drafters.checkpoint import CheckpointError, from_pretrained
from dspark.drafters.prune import prune_draft_vocab
from dspark.protocols import TargetFeatures
from dspark.protocols.drafter import DraftContext
from dspark.targets import HFTarget
from dspark.types import SamplingParams
from helpers import tiny_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")
FIXTURE_V = rf.vocab_size()  # the fixtures' target vocabulary (read from the target's config)


def _reduce_fixture(name: str, kept: list[int], out, w1_outside: str = "common"):
    """A speculators fixture folder cut to ``kept`` by speculators' own rules (written here)."""
    shutil.copytree(rf.folder(name), out)
    w = load_file(str(out / "model.safetensors"))
    ids = torch.tensor(sorted(kept))
    w["d2t"] = ids - torch.arange(ids.numel())
    w["t2d"] = torch.zeros(FIXTURE_V, dtype=torch.bool)
    w["t2d"][ids] = True
    w["lm_head.weight"] = w["lm_head.weight"][ids].contiguous()
    if "markov_head.markov_w2.weight" in w:
        w["markov_head.markov_w2.weight"] = w["markov_head.markov_w2.weight"][ids].contiguous()
        if w1_outside == "common":  # one row for every token outside (what dspark can represent)
            w1 = w["markov_head.markov_w1.weight"].clone()
            w1[~w["t2d"]] = w1[~w["t2d"]][0]
            w["markov_head.markov_w1.weight"] = w1
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["draft_vocab_size"] = ids.numel()
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _kept_for(tokens: list[int], step: int = 3) -> list[int]:
    """Every ``step``-th token id plus ``tokens`` (the anchors and drafts the oracle's rounds read)."""
    return sorted(set(range(1, FIXTURE_V, step)) | set(tokens))


def _block_rounds(drafter, t, rounds):
    out = []
    for r in rounds:
        ids = t[f"round_{r}/known_ids"]
        ctx = DraftContext(["req"], [ids], [SamplingParams.greedy()], features=TargetFeatures([t[f"round_{r}/target_hidden_states"]]))
        out.append(drafter.draft(ctx))
    return out


@pytest.mark.parametrize("name", ["speculators-dspark", "speculators-dflash"])
def test_a_reduced_speculators_block_drafter_drafts_the_references_logits_on_its_tokens(name, tmp_path):
    twin = rf.twin(name)  # the DeepSpec folder whose tensors (and inference cases) it carries
    t, _ = rf.cases(twin)
    rounds = rf.rounds(twin)
    seen = [int(x) for r in rounds for x in [*t[f"round_{r}/known_ids"][-1:], *t[f"round_{r}/draft_tokens"]]]
    kept = _kept_for(seen)
    folder = _reduce_fixture(name, kept, tmp_path / "reduced")
    drafter = from_pretrained(folder, rf.target())
    assert drafter.config.draft_vocab_size == len(kept) + 1
    other = [v for v in range(FIXTURE_V) if v not in kept]
    for r, block in zip(rounds, _block_rounds(drafter, t, rounds)):
        assert block.tokens[0].tolist() == t[f"round_{r}/draft_tokens"].tolist()
        ref = t[f"round_{r}/step_logits"]  # [γ, V] the reference's, full vocabulary
        torch.testing.assert_close(block.draft_logits[0][:, kept].float(), ref[:, kept], atol=1e-5, rtol=0)
        assert bool((block.draft_logits[0][:, other] < -1e3).all())  # never drafted
        if drafter.confidence_head is not None:
            torch.testing.assert_close(block.confidence_logits[0], t[f"round_{r}/confidence_logits"], atol=1e-5, rtol=0)


def test_a_reduced_speculators_eagle3_drafts_the_references_logits_on_its_tokens(tmp_path):
    t, _ = rf.cases("deepspec-eagle3")
    rounds = rf.rounds("deepspec-eagle3")
    seen = [int(x) for r in rounds for x in [*t[f"round_{r}/known_ids"][-1:], *t[f"round_{r}/draft_tokens"]]]
    kept = _kept_for(seen)
    drafter = from_pretrained(_reduce_fixture("speculators-eagle3", kept, tmp_path / "reduced"), rf.target())
    assert drafter.config.kind == "eagle3" and drafter.config.draft_vocab_size == len(kept) + 1
    for r in rounds:  # new features: the prompt's, then those of the tokens round r − 1 committed
        new = "prefill/target_hidden_states" if r == 1 else f"round_{r - 1}/update/target_hidden_states"
        blk = drafter.draft(DraftContext(["req"], [t[f"round_{r}/known_ids"]], [SamplingParams.greedy()],
                                         features=TargetFeatures([t[new]])))
        assert blk.tokens[0].tolist() == t[f"round_{r}/draft_tokens"].tolist()
        torch.testing.assert_close(blk.draft_logits[0][:, kept], t[f"round_{r}/step_logits"][:, kept], atol=1e-5, rtol=0)


def test_bad_reduced_vocabularies_are_named(tmp_path):
    kept = _kept_for([])
    cases = {
        "no t2d": (lambda w, c: w.pop("t2d"), "lack t2d"),
        "d2t not ascending": (lambda w, c: w.__setitem__("d2t", w["d2t"].flip(0)), "ascending"),
        "t2d off": (lambda w, c: w["t2d"].__setitem__(0, not bool(w["t2d"][0])), "t2d does not mark"),
        "d2t short": (lambda w, c: w.__setitem__("d2t", w["d2t"][:-1]), "d2t has"),
        "vocab too big": (lambda w, c: c.__setitem__("draft_vocab_size", FIXTURE_V + 1), f"draft_vocab_size {FIXTURE_V + 1}"),
    }
    for i, (spoil, message) in enumerate(cases.values()):
        folder = _reduce_fixture("speculators-dspark", kept, tmp_path / f"bad{i}")
        w, cfg = load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text())
        spoil(w, cfg)
        save_file(w, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(CheckpointError, match=message):
            formats.read(folder)
    # speculators may train a row of markov_w1 per token outside the draft vocabulary; dspark has one
    folder = _reduce_fixture("speculators-dspark", kept, tmp_path / "distinct", w1_outside="own")
    with pytest.raises(CheckpointError, match="different rows for target tokens outside"):
        formats.read(folder)


# -- writing: a dspark drafter cut to K tokens, to speculators and back -------------------------

V = 16


@pytest.fixture(scope="module")
def tiny():
    return HFTarget(tiny_causal_lm("llama", vocab_size=V, max_positions=96))


def _cut(tiny, kind):
    torch.manual_seed(5)
    if kind == "eagle3":
        full = dspark.get_drafter("eagle3", target=tiny, gamma=4)
    elif kind == "dflash":
        full = dspark.get_drafter("dflash", target=tiny, gamma=4, num_layers=2)
    else:
        full = dspark.get_drafter("dspark", target=tiny, gamma=4, head="vanilla-markov", rank=8, num_layers=2)
    for p in full.parameters():
        if p.ndim > 1:
            torch.nn.init.normal_(p, std=0.3)
    kept = [9, 2, 14, 5, 7, 11, 3, 12, 0]  # slot order ≠ ascending: the writer must sort
    return full.eval(), kept, prune_draft_vocab(full.eval(), torch.tensor(kept))


def _draft(tiny, drafter, seq, sampling=None):
    tiny.set_capture_layers(drafter.target_layer_ids)
    out = tiny.prefill(["p"], [seq], logits=False)
    feats = torch.cat([out.hidden_states[k] for k in drafter.target_layer_ids], -1)[0, : seq.numel() - 1]
    tiny.release("p")
    drafter.release("r")
    ctx = DraftContext(["r"], [seq], [sampling or SamplingParams.greedy()], [torch.Generator().manual_seed(0)],
                       features=TargetFeatures([feats], [0]))
    return drafter.draft(ctx)


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_a_cut_drafter_goes_to_speculators_and_back(tiny, kind, tmp_path):
    full, kept, cut = _cut(tiny, kind)
    out = formats.write(formats.portable_from_drafter(cut, tiny), "speculators", tmp_path / "spec")
    cfg = json.loads((out / "config.json").read_text())
    w = load_file(str(out / "model.safetensors"))
    ids = torch.tensor(sorted(kept))
    # speculators' layout, read off the uncut drafter and the target (not through the writer)
    assert cfg["draft_vocab_size"] == len(kept) and cfg["transformer_layer_config"]["vocab_size"] == V
    assert "draft_ids" not in w and w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    assert torch.equal(w["d2t"] + torch.arange(len(kept)), ids)
    assert w["t2d"].nonzero().flatten().tolist() == ids.tolist()
    torch.testing.assert_close(w["lm_head.weight"], tiny.model.get_output_embeddings().weight[ids], rtol=0, atol=0)
    assert w["embed_tokens.weight"].shape == (V, full.config.layer.hidden_size)
    if kind == "dspark":
        torch.testing.assert_close(w["markov_head.markov_w2.weight"], full.head.w_up.weight[ids].detach(), rtol=0, atol=0)
        w1 = w["markov_head.markov_w1.weight"]  # [V, r] over the target's vocabulary
        assert w1.shape == (V, 8)
        torch.testing.assert_close(w1[ids], full.head.w_down.weight[ids].detach(), rtol=0, atol=0)
        assert float(w1[[v for v in range(V) if v not in kept]].abs().max()) == 0.0  # the cut's placeholder row
    # read back: the same drafter (greedy drafts and q, sampled q_1), an anchor outside the kept tokens too
    back = from_pretrained(out, tiny)
    assert back.config.draft_vocab_size == len(kept) + 1
    for seq in (torch.tensor([3, 5, 7, 3, 5, 7, 3, 5]), torch.tensor([2, 9, 4, 4, 11, 2, 9, 13, 6, 1])):
        a, b = _draft(tiny, cut, seq), _draft(tiny, back, seq)
        assert a.tokens.tolist() == b.tokens.tolist()
        torch.testing.assert_close(b.q, a.q, atol=1e-6, rtol=1e-5)
        # sampled (T = 1): q_1 (x̂_0 = the anchor in both); later positions follow each one's own draws,
        # which differ because the same random numbers index slots in another order
        t1 = SamplingParams(temperature=1.0)
        torch.testing.assert_close(_draft(tiny, back, seq, t1).q[:, 0], _draft(tiny, cut, seq, t1).q[:, 0],
                                   atol=1e-6, rtol=1e-5)
    # and a second write gives the same bytes (the slot order of the read-back drafter is ascending)
    again = formats.write(formats.portable_from_drafter(back, tiny), "speculators", tmp_path / "again")
    assert load_file(str(again / "model.safetensors")).keys() == w.keys()
    for k, v in load_file(str(again / "model.safetensors")).items():
        assert torch.equal(v, w[k]), k


def test_deepspec_still_refuses_a_reduced_vocabulary(tiny, tmp_path):
    _, _, cut = _cut(tiny, "dspark")
    with pytest.raises(CheckpointError, match="reduced draft vocabulary.*speculators format does"):
        formats.write(formats.portable_from_drafter(cut, tiny), "deepspec", tmp_path / "ds")
