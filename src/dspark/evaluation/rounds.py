"""Per-round records of a drafter on a prompt set (:class:`Rounds`) and how they are collected
(:func:`collect_rounds`): the raw material of :mod:`dspark.evaluation.round_metrics`, of
calibration and of the benchmark's simulator.

A *round* drafts γ tokens, the target verifies ℓ of them and accepts a prefix of ``accepted``
(+1 committed bonus/correction token); ``proposed`` is the valid draft length.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from attrs import frozen

from dspark import serialization

__all__ = ["Rounds", "collect_rounds", "save_json"]


@frozen
class Rounds:
    """Per-round records of one drafter on a prompt set (N rounds, γ positions)."""

    domain: tuple[str, ...]  # [N]
    accepted: torch.Tensor  # [N]
    proposed: torch.Tensor  # [N]
    verified: torch.Tensor  # [N]
    confidence_logits: torch.Tensor  # [N, γ] raw
    prompt: tuple[int, ...]  # [N] which prompt each round belongs to
    new_tokens: int
    seconds: float

    def take(self, mask: torch.Tensor) -> Rounds:
        idx = mask.nonzero().flatten().tolist()
        return Rounds(tuple(self.domain[i] for i in idx), self.accepted[mask], self.proposed[mask],
                      self.verified[mask], self.confidence_logits[mask], tuple(self.prompt[i] for i in idx),
                      self.new_tokens, self.seconds)

    def to_dict(self) -> dict[str, Any]:
        return serialization.to_dict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Rounds:
        return cls(tuple(d["domain"]), torch.tensor(d["accepted"]), torch.tensor(d["proposed"]),
                   torch.tensor(d["verified"]), torch.tensor(d["confidence_logits"], dtype=torch.float32).reshape(len(d["accepted"]), -1),
                   tuple(d["prompt"]), int(d["new_tokens"]), float(d["seconds"]))


def collect_rounds(
    target: Any,
    drafter: Any,
    prompts: Sequence[Any],
    sampling: Any,
    *,
    max_new_tokens: int = 96,
    concurrency: int = 8,
    scheduler: str = "full",
    seed: int = 0,
    progress: bool = True,
    confidence_model: Any = None,
) -> Rounds:
    """Run ``prompts`` (``dspark.data.prompts.Prompt``) through an engine with ``scheduler``
    (default ``full``: every valid draft position verified) and record every round, its raw
    confidences from ``confidence_model`` (a registered name or object; default: the engine's,
    the drafter's own or ``draft-head``)."""
    import time

    from tqdm import tqdm

    from dspark.data.prompts import prompt_request
    from dspark.engine import Engine

    engine = Engine(target, drafter, scheduler=scheduler, calibrator="identity", seed=seed,
                    confidence_model=confidence_model)
    pending = list(enumerate(prompts))[::-1]
    live: dict[str, tuple[int, Any]] = {}
    rows: list[tuple[str, int, int, int, list[float], int]] = []
    new_tokens = 0
    t0 = time.perf_counter()
    with tqdm(total=len(prompts), desc=f"rounds {getattr(drafter, 'name', '')}", unit="prompt",
              disable=not progress, leave=False) as bar:
        while pending or live:
            while pending and len(live) < concurrency:
                i, p = pending.pop()
                rid = engine.add_request(prompt_request(p), sampling, max_new_tokens=max_new_tokens, request_id=f"p{i}")
                live[rid] = (i, p)
            engine.step()
            for c in engine.pop_finished():
                i, p = live.pop(c.request_id)
                m = c.rounds
                new_tokens += len(c.output_ids)
                for acc, prop, ver, conf in zip(m.accepted, m.proposed, m.verified, m.confidence):
                    rows.append((p.domain, acc, prop, ver, conf, i))
                bar.update(1)
    seconds = time.perf_counter() - t0
    if not rows:
        raise ValueError("no drafting rounds were recorded (are the prompts empty?)")
    conf = torch.tensor([r[4] for r in rows])  # [N, γ]: a confidence model scores every draft position
    return Rounds(tuple(r[0] for r in rows), torch.tensor([r[1] for r in rows]), torch.tensor([r[2] for r in rows]),
                  torch.tensor([r[3] for r in rows]), conf, tuple(r[5] for r in rows), new_tokens, seconds)


def save_json(obj: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    return path
