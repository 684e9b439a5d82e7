"""The sequential-head step with the head's correction rows kept, for heads whose correction reads
only the previous token (the Markov heads: b(x̂_{j−1}) = W_up · W_down[x̂_{j−1}]).

Terms as in :mod:`dspark.heads`: V_d the draft vocabulary, r the head's rank, B requests in the step.
Such a head's correction is a row of the rank-r bigram table W_up W_downᵀ [V_d, V_d], and computing
one row reads all of W_up (V_d × r: 12.6 MB in bf16 at V_d = 49,152, r = 128) for a vector of V_d
numbers. On a CPU that read is the step: γ − 1 full reads of W_up a round, each at the memory
bandwidth. Text reuses a few hundred tokens most of the time, so :class:`CorrectionRows` keeps the
rows it computed (least recently used first out, within a byte budget) and a step whose previous
tokens were all seen reads B rows of V_d numbers instead of W_up.

The rows are the head's own ``_correction`` outputs, so the step computes the uncached step's
Ũ_j = U_j + b(x̂_{j−1}); a row computed among other misses may round differently in its last bits
from the same row in another batch, as any product does between batch sizes (one request: the
same bits). The table is keyed by the weights (their storage, dtype and in-place
version counter): training or loading new weights empties it at the next step.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn

__all__ = ["CorrectionRows", "CachedHeadStep", "caches_rows", "ROW_BUDGET_BYTES"]

#: the table's size limit: 64 MiB holds 682 bf16 rows of a 49,152-token vocabulary (341 fp32)
ROW_BUDGET_BYTES = 64 << 20


def caches_rows(head: Any, device: torch.device) -> bool:
    """Whether the step of ``head`` on ``device`` keeps its correction rows: a head that declares
    ``correction_reads_previous_token_only``, on a CPU (on a GPU reading W_up is cheap next to the
    host round trip a cache lookup needs, and the step is captured in a CUDA graph)."""
    return bool(getattr(head, "correction_reads_previous_token_only", False)) and device.type == "cpu"


class CorrectionRows:
    """b(x̂) for previous tokens x̂ (draft slots), the rows computed so far kept in a table of at
    most ``budget_bytes``, least recently used first out."""

    def __init__(self, head: nn.Module, budget_bytes: int = ROW_BUDGET_BYTES) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        self.head = head
        self.budget_bytes = budget_bytes
        self.slots: OrderedDict[int, int] = OrderedDict()  # token → table row, least recent first
        self.table: torch.Tensor | None = None  # [rows, V_d]
        self.key: tuple | None = None
        self.hits = self.misses = 0

    @property
    def capacity(self) -> int:
        """Rows the budget holds (at least one)."""
        w = self.head.w_up.weight  # [V_d, r]
        return max(1, self.budget_bytes // (w.shape[0] * w.element_size()))

    def _weights_key(self) -> tuple:
        ws = (self.head.w_up.weight, self.head.w_down.weight)
        return tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in ws)

    def __call__(self, prev: torch.Tensor) -> torch.Tensor:
        """x̂_{j−1} [B] (int64 slots) → b(x̂_{j−1}) [B, V_d], the head's own correction rows."""
        key = self._weights_key()
        if key != self.key:  # new or changed weights: nothing kept is theirs
            self.key, self.slots, self.table = key, OrderedDict(), None
        ids = prev.tolist()
        distinct = list(dict.fromkeys(ids))
        if len(distinct) > self.capacity:  # more tokens than the table holds: nothing to keep
            self.misses += len(ids)
            return self.head._correction(prev, None)
        for t in distinct:
            if t in self.slots:
                self.slots.move_to_end(t)
        new = [t for t in distinct if t not in self.slots]
        missed = sum(t in new for t in ids)
        self.misses += missed
        self.hits += len(ids) - missed
        if new:
            self._store(new, self.head._correction(torch.tensor(new, dtype=prev.dtype), None))
        return self.table.index_select(0, torch.tensor([self.slots[t] for t in ids]))  # [B, V_d]

    def _store(self, tokens: list[int], rows: torch.Tensor) -> None:
        """Put ``rows`` [n, V_d] in the table, the least recently used tokens out where it is full
        (never one of this step's: they were moved to the recent end first)."""
        if self.table is None:
            self.table = rows.new_empty(min(self.capacity, max(64, len(tokens))), rows.shape[1])
        targets = []
        for t in tokens:
            if len(self.slots) < self.table.shape[0]:
                slot = len(self.slots)
            elif self.table.shape[0] < self.capacity:  # grow by doubling up to the budget
                grown = self.table.new_empty(min(self.capacity, 2 * self.table.shape[0]), self.table.shape[1])
                grown[: self.table.shape[0]] = self.table
                self.table, slot = grown, len(self.slots)
            else:
                _, slot = self.slots.popitem(last=False)
            self.slots[t] = slot
            targets.append(slot)
        self.table[torch.tensor(targets)] = rows


class CachedHeadStep(nn.Module):
    """The ``head`` graph (:class:`~dspark.drafters.dspark.graphs.HeadStepGraph`'s inputs and
    outputs) with the correction rows from :class:`CorrectionRows`; eager, for a PyTorch runner."""

    def __init__(self, drafter: Any, budget_bytes: int = ROW_BUDGET_BYTES) -> None:
        super().__init__()
        self.head, self.confidence_head = drafter.head, drafter.confidence_head
        self.rows = CorrectionRows(self.head, budget_bytes)

    def forward(self, prev_ids: torch.Tensor, h_j: torch.Tensor, base_logits_j: torch.Tensor):
        logits = self.head._add(base_logits_j, self.rows(prev_ids))  # Ũ_j = U_j + b(x̂_{j−1}) [B, V_d]
        if self.confidence_head is None:
            return (logits,)
        return logits, self.confidence_head(h_j, self.head.prev_embedding(prev_ids))  # [B]
