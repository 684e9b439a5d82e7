"""A round's greedy draws in the target's vocabulary (dspark.drafters.draws.greedy_in_target_space).

The oracle builds each position's row by hand, one at a time: the target token of the drawn slot,
a q that is one on it (none for the placeholder slot, which has no target token), the draft
logits at their target ids and ``NEG`` elsewhere; past the draws token 0, q one-hot on it and zero
logits. Checked with a reduced vocabulary and without, for every number of draws 0…γ.
"""

from __future__ import annotations

import pytest
import torch

from dspark.drafters.draws import greedy_in_target_space
from dspark.drafters.vocab import NEG, DraftVocab

V, GAMMA, R = 40, 5, 3


def _by_hand(vocab, slots, U, gamma):
    R, n = slots.shape
    tokens, q, logits = torch.zeros(R, gamma, dtype=torch.long), torch.zeros(R, gamma, V), torch.zeros(R, gamma, V)
    for r in range(R):
        for i in range(gamma):
            if i >= n:
                q[r, i, 0] = 1.0
                continue
            slot = int(slots[r, i])
            if vocab is None:
                tokens[r, i] = slot
                q[r, i, slot] = 1.0
                logits[r, i] = U[r, i]
                continue
            tokens[r, i] = int(vocab.draft_ids[slot])
            if slot < vocab.size - 1:
                q[r, i, tokens[r, i]] = 1.0
            logits[r, i] = NEG
            for k in range(vocab.size - 1):
                logits[r, i, int(vocab.draft_ids[k])] = U[r, i, k]
    return tokens, q, logits


@pytest.mark.parametrize("reduced", [True, False], ids=["reduced", "full"])
@pytest.mark.parametrize("n", range(GAMMA + 1))
def test_greedy_draws_in_target_space_equal_the_rows_built_by_hand(reduced, n):
    gen = torch.Generator().manual_seed(n)
    vocab = DraftVocab(torch.randperm(V, generator=gen)[:12], V) if reduced else None
    Vd = vocab.size if reduced else V
    slots = torch.randint(0, Vd, (R, n), generator=gen)
    if reduced and n:
        slots[0, 0] = Vd - 1  # the placeholder slot: its q row stays zero
    U = torch.randn(R, n, Vd, generator=gen)
    got = greedy_in_target_space(vocab, slots, U if n else None, GAMMA, V)
    want = _by_hand(vocab, slots, U, GAMMA)
    for g, w, name in zip(got, want, ("tokens", "q", "logits")):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert torch.equal(g, w), name
