"""What the kinds' teacher-forced training forwards share: the padded batch, the targets the
losses read, and the teacher distribution at chosen positions.

Terms: S sequences of (padded) length n, each with features f_t [m·d] and a teacher at every
position t — the target's final-normed last hidden state z_t [d] (full-vocabulary teacher
p_t = softmax(W_lm z_t), computed in the step with the target's LM head) or a top-k summary;
N anchors per sequence; γ block size; V_d the drafter's vocabulary; k the teacher top-k.

The forwards are each kind's (named by its DrafterKind's training recipe):
:func:`dspark.drafters.dflash.training.block_forward` (DFlash, DSpark) and
:func:`dspark.drafters.eagle3.training.eagle3_forward` (both Eagle3 layouts)."""

from __future__ import annotations

from typing import Any

import torch
from attrs import frozen

__all__ = ["Batch", "Targets", "teacher_at", "per_row", "draft_slots"]


@frozen
class Batch:
    ids: torch.Tensor  # [S, n] int64, padded with 0
    lengths: torch.Tensor  # [S] real lengths
    prompt_lens: torch.Tensor  # [S] the response starts here
    feats: torch.Tensor  # [S, n, m·d] target features at the drafter's layer ids
    top_ids: torch.Tensor | None  # [S, n, k] top-k teacher: the target's k most likely next tokens
    top_logp: torch.Tensor | None  # [S, n, k] their log-probabilities
    anchors: torch.Tensor  # [S, N] anchor positions, −1 = none
    last_hidden: torch.Tensor | None = None  # [S, n, d] full teacher: target's final-normed last hidden state
    loss_mask: torch.Tensor | None = None  # [S, n] 1 = supervised label position; None: prompt_len ≤ t < length
    last_lse: torch.Tensor | None = None  # [S, n] log Σ_v exp(W_lm z_t) over the full vocabulary (optional)

    def mask(self) -> torch.Tensor:
        """The loss mask [S, n] float (default: the response, prompt_lens ≤ t < lengths)."""
        if self.loss_mask is not None:
            return self.loss_mask.float()
        t = torch.arange(self.ids.shape[1])[None]
        return ((t >= self.prompt_lens[:, None]) & (t < self.lengths[:, None])).float()


@frozen
class Targets:
    """What the losses read, per row (block or chain) × position (Eagle3: step).

    The teacher comes in one of two forms (``teacher_at``): full vocabulary (``p``, ``p_out``) or
    top-k (``p_slots``, ``p_top``); the other pair is None. ``valid`` is the supervision mask
    (block drafters: the reference's cumulative ``eval_mask``). ``weight`` / ``den``: per-token
    loss weights and the normaliser, when a forward sets them itself (Eagle3 may: see
    ``losses.eagle3_loss_weights``); None = the trainer derives them from ``valid``.
    """

    logq: torch.Tensor  # [B, γ, V_d]
    label: torch.Tensor  # [B, γ] draft slot of the true next token, −1 outside the draft vocab
    p_slots: torch.Tensor | None  # [B, γ, k] top-k teacher: draft slots of its top-k, −1 outside
    p_top: torch.Tensor | None  # [B, γ, k] their probabilities
    valid: torch.Tensor  # [B, γ] bool
    conf_logits: torch.Tensor | None  # [B, γ]
    p: torch.Tensor | None = None  # [B, γ, V_d] full teacher: probability of each draft slot's token
    p_out: torch.Tensor | None = None  # [B, γ] full teacher's mass outside the draft vocabulary
    weight: torch.Tensor | None = None  # [B, γ] float loss weights (None: derived by the trainer)
    den: torch.Tensor | None = None  # scalar normaliser of this micro-batch (None: Σ weight)
    hidden: torch.Tensor | None = None  # [B, γ, d] block drafters: backbone output after the final norm
    logits: torch.Tensor | None = None  # [B, γ, V_d] the logits logq was normalised from (Ũ)

    def teacher(self) -> dict[str, torch.Tensor | None]:
        """The teacher tensors as the losses take them (``p``, ``p_out``, ``p_slots``, ``p_top``)."""
        return dict(p=self.p, p_out=self.p_out, p_slots=self.p_slots, p_top=self.p_top)


# dynamo cannot construct a frozen attrs instance: a compiled training objective
# (dspark.training.compiled) builds its Targets eagerly, between two graphs
Targets.__init__ = torch.compiler.disable(Targets.__init__)  # type: ignore[method-assign]


_TEACHER_ROWS = 1024  # distinct positions per teacher matmul: [rows, V] fp32 ≈ 200 MB at V = 49152


def _row_groups(sizes: list[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive index ranges [r0, r1) whose ``sizes`` sum to ≤ ``limit`` (an item larger than
    ``limit`` forms a range of its own)."""
    groups: list[tuple[int, int]] = []
    r0, rows = 0, 0
    for r, n in enumerate(sizes):
        if r > r0 and rows + n > limit:
            groups.append((r0, r))
            r0, rows = r, 0
        rows += n
    return groups + [(r0, len(sizes))] if sizes else groups


# torch.compile runs it, never traces it (dspark.training.compiled): its shapes depend on the data
@torch.compiler.disable
@torch.no_grad()
def teacher_at(drafter: Any, batch: Batch, pos: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The teacher distribution at positions ``pos`` [S, M] (the target's distribution of token
    pos + 1) → (p_slots, p_top, p, p_out), each [S, M, ·], the unused pair None.

    Full (``batch.last_hidden`` set): p = softmax(W_lm z_pos) over the target vocabulary with the
    drafter's bound full LM head, read at the draft slots (placeholder slot 0), p_out the rest.
    With a reduced draft vocabulary and the cached full-vocabulary normaliser ``batch.last_lse``,
    only the V_d draft rows of W_lm are multiplied: p_slot = exp(W_lm[slot] z − lse), same values.
    Each distinct position of a sequence is computed once (blocks overlap).
    Top-k (``batch.top_ids``): the k ids mapped to draft slots and their probabilities.
    """
    S, M = pos.shape
    pos = pos.clamp(0, batch.ids.shape[1] - 1)
    if batch.last_hidden is not None:
        W = drafter._lm_head_full  # [V, d]
        if W is None:
            raise RuntimeError("bind_target(embed, lm_head) must be called before training")
        reduced = drafter.vocab_map is not None
        lse_path = reduced and batch.last_lse is not None
        # The LM head in the matmul dtype, cast once here: under autocast each z @ W.T would cast
        # the whole [V, d] weight again (a sequence at a time: S casts of V·d a step). Same values.
        dev = W.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else W.dtype
        W_c = (drafter._lm_head if lse_path else W).to(dt)  # [V_d or V, d]
        uniq = [pos[r].unique(return_inverse=True) for r in range(S)]  # ([M'] distinct, [M] index)
        ps, outs = [], []
        # sequences in groups of ≤ _TEACHER_ROWS distinct positions: the fp32 logits bound memory
        for r0, r1 in _row_groups([u.numel() for u, _ in uniq], _TEACHER_ROWS):
            z = torch.cat([batch.last_hidden[r, uniq[r][0]] for r in range(r0, r1)]).to(dt)  # [Σ M', d]
            if lse_path:
                lse = torch.cat([batch.last_lse[r, uniq[r][0]] for r in range(r0, r1)]).float()
                p_d = torch.exp((z @ W_c.T).float() - lse[:, None])  # [Σ M', V_d]
            else:
                p_full = torch.softmax(z @ W_c.T, dim=-1, dtype=torch.float32)  # [Σ M', V]
                p_d = p_full[:, drafter.draft_ids] if reduced else p_full
            if reduced:
                p_d[:, -1] = 0.0  # the placeholder slot scores nothing
                out = (1.0 - p_d.sum(-1)).clamp_min(0.0)
            else:
                out = p_d.new_zeros(p_d.shape[0])
            off = 0
            for r in range(r0, r1):
                u, inv = uniq[r]
                ps.append(p_d[off : off + u.numel()][inv])
                outs.append(out[off : off + u.numel()][inv])
                off += u.numel()
        return None, None, torch.stack(ps), torch.stack(outs)
    if batch.top_ids is None or batch.top_logp is None:
        raise ValueError("the batch has no teacher (neither last_hidden nor top_ids / top_logp)")
    k = batch.top_ids.shape[-1]
    idx = pos[..., None].expand(S, M, k)
    return draft_slots(drafter, batch.top_ids.gather(1, idx)), batch.top_logp.gather(1, idx).float().exp(), None, None


def per_row(tensors: tuple[torch.Tensor | None, ...], B: int, g: int) -> tuple[torch.Tensor | None, ...]:
    """Teacher tensors [S, N·γ, ...] → [B = S·N, γ, ...] (None stays None)."""
    return tuple(None if t is None else t.reshape(B, g, *t.shape[2:]) for t in tensors)


def draft_slots(drafter: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Target ids → draft slots, −1 where the draft vocabulary has no slot."""
    s = drafter.to_draft(tokens)
    if drafter.vocab_map is not None:
        s = torch.where(s == drafter.draft_size - 1, torch.full_like(s, -1), s)
    return s
