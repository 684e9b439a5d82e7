"""A reduced draft vocabulary cut from a full-vocabulary drafter, without training (a named variant).

Terms: V the target's vocabulary, K the tokens kept, V_d = K + 1 draft slots (the last is the
placeholder of :mod:`dspark.drafters.vocab`), r the sequential head's rank.

A full-vocabulary DSpark round pays two V-sized products at each of its γ sequential steps: the
head's correction b = W_up · W_down[x̂_{j−1}] (W_up [V, r]) and, once per round for all γ positions,
the LM head U = h · W_lmᵀ ([V, d]). On a memory-bound CPU that is most of a round. The target's
own answers use few of the V tokens (SmolLM2's 1 M training tokens: 14,086 distinct; the 8,192
most frequent cover 99.0 %), so scoring only the K most frequent tokens cuts those products by V / K
while losing only the drafts whose token is outside the K. Nothing else changes: rows of W_lm,
W_up and W_down are selected, not refit, and verification stays lossless (a target token outside
the K is still committed by rejection sampling; it just cannot be drafted).

The token ranking is a file next to the weights, ``token_ranking.json``
(:func:`save_token_ranking`): ``{"source", "tokens_counted", "ranking": [token id, …]}``, most
frequent first, counted over target-written responses disjoint from the eval prompts.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

__all__ = ["RANKING_NAME", "parse_drafter_ref", "prune_draft_vocab", "rank_tokens", "read_token_ranking",
           "save_token_ranking", "variant_label"]

RANKING_NAME = "token_ranking.json"
_REF = re.compile(r"^(?P<path>.+?):vocab=(?P<k>[^:=]*)$")


def parse_drafter_ref(ref: str) -> tuple[str, int | None]:
    """``NAME_OR_PATH[:vocab=K]`` → (name or path, K or None): ``:vocab=K`` asks for the drafter cut
    to the K most frequent tokens of its ``token_ranking.json``."""
    m = _REF.match(str(ref))
    if m is None:
        return str(ref), None
    k = m["k"]
    if not k.isdigit() or int(k) < 1:
        raise ValueError(f"{ref!r}: ':vocab=K' needs a positive integer K, got {k!r}")
    return m["path"], int(k)


def variant_label(name: str, draft_vocab: int | None) -> str:
    """The name reports give a drafter: ``NAME``, or ``NAME-vocabK`` for its ``:vocab=K`` variant."""
    return f"{name}-vocab{draft_vocab}" if draft_vocab else name


def rank_tokens(sequences: Iterable[Sequence[int]]) -> tuple[list[int], int]:
    """Token ids by count over ``sequences``, most frequent first (ties: lower id first), and the
    number of tokens counted."""
    counts: Counter[int] = Counter()
    for s in sequences:
        counts.update(int(t) for t in s)
    return sorted(counts, key=lambda t: (-counts[t], t)), sum(counts.values())


def save_token_ranking(folder: str | Path, sequences: Iterable[Sequence[int]], source: str) -> Path:
    """Write ``folder/token_ranking.json`` from ``sequences`` (target-written token ids)."""
    ranking, n = rank_tokens(sequences)
    if not ranking:
        raise ValueError("no tokens to rank: the sequences are empty")
    path = Path(folder) / RANKING_NAME
    path.write_text(json.dumps({"source": source, "tokens_counted": n, "ranking": ranking}) + "\n")
    return path


def read_token_ranking(folder: str | Path, vocab_size: int) -> list[int]:
    """The ranking in ``folder/token_ranking.json``, checked against the target's vocabulary."""
    path = Path(folder) / RANKING_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: ':vocab=K' cuts the drafter to the K most frequent tokens of that file "
            "(make it with dspark.drafters.prune.save_token_ranking or scripts/token_ranking.py)")
    try:
        ranking = [int(t) for t in json.loads(path.read_text())["ranking"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a token ranking ({e})") from None
    bad = [t for t in ranking if not 0 <= t < vocab_size]
    if bad or len(set(ranking)) != len(ranking):
        raise ValueError(f"{path}: token ids must be distinct and in [0, {vocab_size}); "
                         f"{'out of range: ' + str(bad[:5]) if bad else 'some are repeated'}")
    return ranking


def prune_draft_vocab(drafter: Any, token_ids: Sequence[int] | torch.Tensor) -> Any:
    """A copy of the bound full-vocabulary ``drafter`` that drafts only ``token_ids`` (K distinct
    target ids): ``draft_vocab_size`` K + 1, the head's V-row weights (W_down, W_up) selected at
    those ids, a zero row for the placeholder slot (an anchor outside the K gets no correction)."""
    from dspark.drafters.neural import build_drafter

    config = drafter.config
    if config.draft_vocab_size is not None:
        raise ValueError(f"the drafter already has a reduced vocabulary (draft_vocab_size {config.draft_vocab_size})")
    if not getattr(drafter, "is_bound", False):
        raise ValueError("bind the drafter to its target first (from_pretrained(path, target))")
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)  # [K]
    V = config.vocab_size
    if not 1 <= ids.numel() < V:
        raise ValueError(f"keep between 1 and {V - 1} tokens (the vocabulary has {V}); got {ids.numel()}")
    if ids.unique().numel() != ids.numel() or int(ids.min()) < 0 or int(ids.max()) >= V:
        raise ValueError(f"the kept token ids must be distinct and in [0, {V})")
    Vd = ids.numel() + 1
    pruned = build_drafter(attrs.evolve(config, draft_vocab_size=Vd))
    pruned.set_draft_vocab(ids)
    state = dict(drafter.state_dict())
    for key, want in pruned.state_dict().items():
        have = state.get(key)
        if key == "draft_ids" or have is None:
            continue
        vocab_rows = key.startswith("head.") and have.shape[0] == V and want.shape[0] == Vd
        if vocab_rows and have.shape[1:] == want.shape[1:]:  # (V_d may equal V: K = V − 1)
            state[key] = torch.cat([have[ids], have.new_zeros(1, *have.shape[1:])])  # [K + 1, ...]
        elif have.shape != want.shape:
            raise ValueError(f"cannot cut {key} {tuple(have.shape)} to {tuple(want.shape)}: only the "
                             "sequential head's vocabulary rows are selected")
    state["draft_ids"] = pruned.draft_ids
    pruned.load_state_dict(state)
    embed, lm_head = drafter.target_weights()
    pruned = pruned.to(device=embed.device, dtype=drafter.dtype)  # where the target's weights are
    pruned.bind_target(embed, lm_head)
    return pruned.eval()
