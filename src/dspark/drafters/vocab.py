"""The reduced draft vocabulary (EAGLE-3's d2t / t2d), shared by the PyTorch and exported drafters.

A drafter with a reduced vocabulary scores V_d slots instead of the target's V tokens: slot i is
target token ``draft_ids[i]`` for i < V_d − 1, and the last slot is a placeholder that is never
drawn (logit bias ``NEG``) — it is where anchors outside the draft vocabulary map to as the
sequential head's previous-token input. Draws are mapped back to target ids, and q is scattered
into the target's V (zero outside the draft vocabulary), which is all lossless verification needs:
a target token the drafter cannot propose is still committed through rejection sampling.
"""

from __future__ import annotations

import torch

__all__ = ["NEG", "DraftVocab", "to_slots", "to_target_space"]

NEG = -1.0e4  # "never": exp(NEG − max) underflows to 0 in fp32, and stays finite in fp16 graphs


class DraftVocab:
    def __init__(self, draft_ids: torch.Tensor, vocab_size: int) -> None:
        ids = torch.as_tensor(draft_ids, dtype=torch.long).reshape(-1)  # [V_d]
        if ids.numel() < 2 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"draft_ids must hold ≥ 2 target token ids in [0, {vocab_size})")
        self.draft_ids = ids
        self.vocab_size = vocab_size
        self.size = ids.numel()
        self.t2d = torch.full((vocab_size,), self.size - 1, dtype=torch.long)  # [V]
        self.t2d[ids[:-1]] = torch.arange(self.size - 1)
        self.bias = torch.zeros(self.size)  # [V_d]
        self.bias[-1] = NEG

    def to_draft(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target ids → slots (the placeholder for tokens outside the draft vocabulary)."""
        return self.t2d.to(tokens.device)[tokens]

    def to_target(self, slots: torch.Tensor) -> torch.Tensor:
        return self.draft_ids.to(slots.device)[slots]

    def full(self, x: torch.Tensor, fill: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """[..., V_d] → [..., V] with ``fill`` where the draft vocabulary has no slot (written into
        ``out`` [..., V] when given, e.g. a slice of a larger tensor)."""
        out = x.new_full((*x.shape[:-1], self.vocab_size), fill) if out is None else out.fill_(fill)
        # index_copy_, not out[..., ids] = …: advanced-index assignment costs a greedy round's two
        # calls (q and the logits, [R, γ, V]) about half a millisecond on a CPU
        return out.index_copy_(-1, self.draft_ids[:-1].to(x.device), x[..., :-1])


def to_slots(vocab: DraftVocab | None, tokens: torch.Tensor) -> torch.Tensor:
    """Target ids → draft slots; the identity without a reduced vocabulary (``vocab`` None)."""
    return tokens if vocab is None else vocab.to_draft(tokens)


def to_target_space(
    vocab: DraftVocab | None, slots: torch.Tensor, q: torch.Tensor, logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A draw in draft space — slots [R], q [R, V_d], logits [R, V_d] — as the verifier needs it:
    (target tokens [R], q [R, V], logits [R, V]; NEG where the draft vocabulary has no slot)."""
    if vocab is None:
        return slots, q, logits
    return vocab.to_target(slots), vocab.full(q, 0.0), vocab.full(logits, NEG)
