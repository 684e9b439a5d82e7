"""A reduced draft vocabulary in the speculators format (what vLLM serves), both ways.

Terms: V the target's vocabulary, K the draft vocabulary's target tokens, r the Markov head's rank.

dspark (:mod:`dspark.drafters.vocab`) works in V_d = K + 1 *slots*: slot i < K is target token
``draft_ids[i]`` (in any order), slot K a placeholder that is never drawn and that every token
outside the K maps to as the sequential head's previous-token input. Its per-slot weights are
``lm_head`` rows, W_up = ``markov_w2`` [V_d, r] and W_down = ``markov_w1`` [V_d, r].

speculators (``DraftVocabMixin``; vLLM's ``draft_id_to_target_id``) works in K draft ids, the kept
target ids **sorted ascending**: ``d2t`` [K] int64 is an offset (target id = i + d2t[i]), ``t2d``
[V] bool marks the kept target ids, ``lm_head.weight`` is [K, d] and ``markov_w2`` [K, r] in draft-id
order, and ``markov_w1`` stays an embedding over the *target* vocabulary, [V, r], indexed by the
previous token's target id (vLLM feeds it target ids). ``draft_vocab_size`` (top-level config) is K.

So the two are the same function: a target token outside the K has in dspark the placeholder's
W_down row, in speculators its own row of markov_w1 — equal rows when written by dspark, and a
speculators checkpoint whose rows there differ is refused rather than approximated (dspark would
have to give them all one row). The placeholder's own W_up / lm_head rows are never used (its
logit carries the ``NEG`` bias), so nothing is lost by dropping them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.drafters.files import CheckpointError
from dspark.drafters.vocab import DraftVocab

__all__ = ["from_speculators_vocab", "to_speculators_vocab"]

W1, W2, LM = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "lm_head.weight"


def to_speculators_vocab(weights: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """dspark slot layout → speculators' d2t / t2d layout (reference keys in, reference keys out).

    ``weights`` holds ``draft_ids`` [V_d] and, where the drafter has them, ``lm_head.weight`` ([V, d],
    the target's full head, or [V_d − 1, d] in slot order), markov_w1 / markov_w2 [V_d, r].
    """
    out = dict(weights)
    draft_ids = out.pop("draft_ids").long()  # [V_d]
    K = draft_ids.numel() - 1
    kept = draft_ids[:K]  # [K] target ids, slot order
    ids, order = torch.sort(kept)  # [K] ascending; order[i] = the slot of draft id i
    slot = DraftVocab(draft_ids, vocab_size).t2d  # [V] target id → slot (K: the placeholder)
    out["d2t"] = ids - torch.arange(K)  # [K] int64
    out["t2d"] = slot < K  # [V] bool
    if LM in out:
        lm = out[LM]
        out[LM] = (lm[ids] if lm.shape[0] == vocab_size else lm[order]).contiguous()  # [K, d]
    if W2 in out:
        out[W2] = out[W2][order].contiguous()  # [K, r]
    if W1 in out:
        out[W1] = out[W1][slot].contiguous()  # [V, r]
    return out


def from_speculators_vocab(
    weights: dict[str, torch.Tensor], vocab_size: int, draft_vocab: int, where: Path
) -> dict[str, torch.Tensor]:
    """speculators' d2t / t2d layout → dspark slot layout (V_d = K + 1, ``draft_ids`` added).

    Checks what vLLM and speculators rely on and names the first problem (a :class:`CheckpointError`).
    """
    K = draft_vocab
    if "d2t" not in weights or "t2d" not in weights:
        raise CheckpointError(f"{where}: draft_vocab_size {K} < the verifier's vocabulary {vocab_size}, but the "
                          "weights lack " + " and ".join(k for k in ("d2t", "t2d") if k not in weights)
                          + " (the draft → target token map)")
    out = dict(weights)
    d2t, t2d = out.pop("d2t").long().reshape(-1), out.pop("t2d").reshape(-1)  # [K], [V]
    ids = torch.arange(K) + d2t if d2t.numel() == K else None  # [K] target ids
    if ids is None or t2d.numel() != vocab_size:
        raise CheckpointError(f"{where}: d2t has {d2t.numel()} entries and t2d {t2d.numel()}; draft_vocab_size "
                          f"{K} and the verifier's vocabulary {vocab_size} need {K} and {vocab_size}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or not bool((ids[1:] > ids[:-1]).all()):
        raise CheckpointError(f"{where}: d2t does not map the draft ids to distinct, ascending target ids in "
                          f"[0, {vocab_size})")
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[ids] = True
    if not torch.equal(t2d.bool(), mask):
        raise CheckpointError(f"{where}: t2d does not mark exactly the {K} target ids that d2t maps to")
    if W1 in out:
        w1 = out[W1]  # [V, r]
        outside = w1[~mask]  # [V − K, r]
        if not torch.equal(outside, outside[:1].expand_as(outside)):
            raise CheckpointError(f"{where}: markov_head.markov_w1 has different rows for target tokens outside the "
                              "draft vocabulary; dspark gives all of them one row (its placeholder slot), so this "
                              "checkpoint cannot be loaded exactly")
        out[W1] = torch.cat([w1[ids], outside[:1]])  # [V_d, r]
    if W2 in out:
        w2 = out[W2]  # [K, r]
        out[W2] = torch.cat([w2, w2.new_zeros(1, w2.shape[1])])  # [V_d, r]: the placeholder's is never used
    out["draft_ids"] = torch.cat([ids, ids[:1]])  # [V_d]: the last is the placeholder
    return out
