"""The Markov heads' correction rows kept per previous token (dspark.drafters.dspark.rows).

The oracle is the head's own correction b(x̂) = W_up · W_down[x̂] computed afresh for every call:

* the kept rows equal it bit for bit at one request and within float rounding for a batch, through
  evictions (a budget of a few rows), a batch with more distinct tokens than the budget holds, and
  weights changed in place or loaded (the table is emptied, never read stale);
* only heads whose correction reads the previous token alone keep rows, and only on a CPU;
* a drafter drafts the same blocks with the rows kept as with the uncached head step, and the
  engine with it stays greedy-identical to the target's own decode and keeps its sampled law.
"""

from __future__ import annotations

import pytest
import torch

import dspark.drafters.dspark.graphs as dspark_graphs
from dspark.drafters.dspark.graphs import HeadStepGraph
from dspark.drafters.dspark.rows import CachedHeadStep, CorrectionRows, caches_rows
from dspark.fast import FastTarget
from dspark.heads import build_head
from test_fast_drafter import (
    _assert_sampling_keeps_the_target_law,
    _contexts,
    _model,
    assert_engine_is_greedy_identical,
)
from test_fast_step import _drafter

pytestmark = pytest.mark.usefixtures("one_thread")

V, D, R = 300, 16, 8


def _head(kind: str = "vanilla-markov"):
    torch.manual_seed(0)
    head = build_head(kind, V, D, R)
    torch.nn.init.normal_(head.w_up.weight)  # W_up starts at zero: give b something to say
    return head


def _rows_budget(rows: int) -> int:
    return rows * V * 4  # fp32 rows of V numbers


@pytest.mark.parametrize("kind", ["vanilla-markov", "silu-markov"])
def test_kept_rows_equal_the_heads_correction_through_evictions(kind):
    head = _head(kind)
    rows = CorrectionRows(head, _rows_budget(6))
    assert rows.capacity == 6
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for _ in range(300):  # one request: the same bits as the uncached step
            prev = torch.randint(0, 14, (1,), generator=g)
            assert torch.equal(rows(prev), head._correction(prev, None))
        for _ in range(200):  # batches, repeated tokens inside a batch
            prev = torch.randint(0, 14, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g)
            torch.testing.assert_close(rows(prev), head._correction(prev, None), rtol=1e-6, atol=1e-6)
    assert rows.hits > 0 and rows.misses > 14  # rows were both read back and evicted
    assert len(rows.slots) == rows.table.shape[0] == 6
    assert sorted(rows.slots.values()) == list(range(6))


def test_more_distinct_tokens_than_the_budget_holds_are_computed_afresh():
    head = _head()
    rows = CorrectionRows(head, _rows_budget(2))
    prev = torch.tensor([5, 6, 7, 5])
    with torch.inference_mode():
        torch.testing.assert_close(rows(prev), head._correction(prev, None), rtol=1e-6, atol=1e-6)
    assert rows.table is None and rows.misses == 4


def test_changed_weights_empty_the_table():
    head = _head()
    rows = CorrectionRows(head)
    prev = torch.tensor([4])
    with torch.inference_mode():
        before = rows(prev)
    with torch.no_grad():
        head.w_up.weight.mul_(2.0)  # an optimizer step: in place
    with torch.inference_mode():
        assert torch.equal(rows(prev), head._correction(prev, None))
        assert not torch.equal(rows(prev), before)
    fresh = _head()
    torch.nn.init.normal_(fresh.w_down.weight, std=3.0)
    head.load_state_dict(fresh.state_dict())  # loading a checkpoint: copied in place
    with torch.inference_mode():
        assert torch.equal(rows(prev), head._correction(prev, None))


def test_only_previous_token_heads_on_a_cpu_keep_rows():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert caches_rows(_head("vanilla-markov"), cpu) and caches_rows(_head("silu-markov"), cpu)
    assert not caches_rows(_head("vanilla-markov"), cuda)  # a GPU reads W_up faster than it syncs
    assert not caches_rows(_head("gated-markov"), cpu) and not caches_rows(_head("rnn"), cpu)  # read h_j
    with pytest.raises(ValueError, match="budget_bytes"):
        CorrectionRows(_head(), 0)


def test_a_drafter_with_kept_rows_drafts_the_uncached_blocks(monkeypatch):
    """Every round of a run with a late join, replayed through a drafter whose head step keeps rows
    and one whose step computes b afresh (same weights)."""
    target = FastTarget(_model(), path="packed")
    contexts = _contexts(target, _drafter(target, "dspark:vanilla-markov"))
    kept, fresh = _drafter(target, "dspark:vanilla-markov"), _drafter(target, "dspark:vanilla-markov")
    for i, context in enumerate(contexts):
        with monkeypatch.context() as m:
            if i == 0:  # the first round builds the graphs: the uncached step for ``fresh``
                m.setattr(dspark_graphs, "caches_rows", lambda head, device: False)
            a = fresh.draft(context)
        b = kept.draft(context)
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(b.draft_logits, a.draft_logits, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(b.confidence_logits, a.confidence_logits, rtol=1e-6, atol=1e-6)
    step = kept.loop.runner._graphs["head"][0]
    assert isinstance(step, CachedHeadStep) and step.rows.hits > 0
    assert type(fresh.loop.runner._graphs["head"][0]) is HeadStepGraph


@pytest.mark.parametrize("path", ["packed", "compiled"])
def test_the_engine_with_kept_rows_is_greedy_identical(path):
    model = _model()
    target = FastTarget(model, path=path)
    drafter = _drafter(target, "dspark:vanilla-markov")
    assert_engine_is_greedy_identical(model, target, drafter, f"kept rows / {path}")
    assert drafter.loop.runner._graphs["head"][0].rows.hits > 0


def test_sampling_with_kept_rows_matches_the_target():
    model = _model()
    target = FastTarget(model, path="packed")
    drafter = _drafter(target, "dspark:vanilla-markov")
    _assert_sampling_keeps_the_target_law(model, target, drafter, "sps-greedy", "kept rows / T1")
    assert drafter.loop.runner._graphs["head"][0].rows.hits > 0
