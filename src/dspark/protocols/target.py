"""TargetModel: the model whose distribution speculative decoding must preserve."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from attrs import field, frozen


@frozen
class TargetOutput:
    """Logits (and optionally hidden states) at the positions a forward pass scored.

    For verification, row r holds the target logits at positions 1..ℓ_r + 1 after the anchor,
    right-padded to γ + 1.
    """

    logits: torch.Tensor = field()  # [R, n, V]
    lengths: torch.Tensor = field()  # [R] int64 valid positions per row
    hidden_states: dict[int, torch.Tensor] | None = field(default=None)  # layer id → [R, n, d]


@runtime_checkable
class TargetModel(Protocol):
    """A causal LM with a per-request KV cache that can be rolled back.

    ``verify`` scores, for each request, the anchor followed by its ℓ_r verified draft tokens
    (``tokens`` [R, 1 + γ], right-padded; ``lengths`` [R] = ℓ_r) in one forward and returns the
    target logits at the 1 + ℓ_r positions. ``rollback`` keeps the first ``keep`` cached tokens of
    each request (discarding rejected draft positions). ``accounting`` says whether the verification
    forward is ``"packed"`` or ``"padded"``, for the cost model. ``prefill(..., logits=False)``
    may skip the LM head over the prompt (``logits`` [R, 0, V]); the engine asks for the cache and
    hidden states only.

    ``set_capture_layers(ids)`` chooses the decoder layers whose hidden states every output
    carries (the drafter's ``target_layer_ids``; ``()`` for none) and ``capture_layers`` is that
    choice as it stands (engines sharing a target compare it before each round, since another may
    have changed it); ``cached_length(id)`` is the number of tokens in a request's cache;
    ``tokenizer`` (or None) encodes prompts and names EOS.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    max_context: int
    accounting: str
    tokenizer: Any
    capture_layers: tuple[int, ...]

    def set_capture_layers(self, layer_ids: Sequence[int]) -> None: ...

    def cached_length(self, request_id: str) -> int: ...

    def prefill(self, request_ids: Sequence[str], token_ids: Sequence[torch.Tensor], *,
                logits: bool = True) -> TargetOutput: ...

    def verify(
        self, request_ids: Sequence[str], tokens: torch.Tensor, lengths: torch.Tensor
    ) -> TargetOutput: ...

    def rollback(self, request_ids: Sequence[str], keep: torch.Tensor) -> None: ...

    def release(self, request_id: str) -> None: ...
