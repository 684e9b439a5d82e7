"""Evaluating drafters against their target: rounds, the paper's metrics, calibration.

Terms (docs/concepts.md §2 and §8, :mod:`dspark.metrics`): a *round* drafts γ tokens, the target verifies
ℓ of them and accepts a prefix of ``accepted`` (+1 committed bonus/correction token).

* τ — mean committed tokens per round, mean(accepted + 1).
* proposal length — mean valid draft length; verify rate — Σ verified / Σ proposed.
* conditional acceptance at j — P(position j accepted | positions < j accepted) (paper Fig. 2);
  prefix survival at j — P(accepted ≥ j) (the reference's ``accept_rate@(j−1)``). Named apart.
* threshold sweep — for a survival threshold θ, a round verifies ℓ(θ) = #{j : a_j ≥ θ} positions
  (a_j = Π_{i≤j} c_i, calibrated); accepted = min(accepted, ℓ) and the rest of ℓ was verified in
  vain. Computed offline from rounds that verified every position (``full`` scheduler), which is
  exact for the acceptance counts because truncation is a stopping rule.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from attrs import frozen

from dspark import serialization

__all__ = ["ECE_BINS", "Rounds", "collect_rounds", "evaluate_rounds", "threshold_sweep", "fit_sts_from_rounds"]


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


def threshold_sweep(a: torch.Tensor, accepted: torch.Tensor, thresholds: Sequence[float],
                    proposed: torch.Tensor | None = None) -> list[dict[str, Any]]:
    """a [N, γ] calibrated survival, accepted [N] (full verification), proposed [N] valid draft
    lengths → per θ: verified, accepted and rejected-verified token totals, mean verified ℓ̄, τ."""
    out = []
    for th in thresholds:
        ell = (a >= th).long().cumprod(1).sum(1)  # [N] leading positions with a_j ≥ θ
        if proposed is not None:
            ell = torch.minimum(ell, proposed)
        acc = torch.minimum(accepted, ell)
        out.append({"threshold": float(th), "verified": int(ell.sum()), "accepted": int(acc.sum()),
                    "rejected_verified": int((ell - acc).sum()), "mean_verified": float(ell.float().mean()),
                    "tau": float((acc + 1).float().mean())})
    return out


ECE_BINS = 20
"""Equal-width bins of the reported ECE (the paper's)."""


def fit_sts_from_rounds(rounds: Rounds, objective: str = "ece", *, bias: bool = False,
                        n_bins: int = ECE_BINS) -> Any:
    """STS (``bias=True``: STS + per-position bias) on ``rounds``: T_j (and b_j) by survival ECE
    with ``n_bins`` bins (the paper's objective, Brier breaks ECE ties) or by Brier score alone
    (``objective="brier"``: a proper scoring rule, less prone to fitting the bin noise of a small
    calibration set)."""
    import dspark

    if objective not in ("ece", "brier"):
        raise ValueError(f"objective must be 'ece' or 'brier', got {objective!r}")
    kw = {"n_bins": n_bins, **({"ece_tolerance": 1.0} if objective == "brier" else {})}
    cal = dspark.get_calibrator("sts-bias" if bias else "sts", **kw)
    return cal.fit(rounds.confidence_logits, rounds.accepted, rounds.verified)


def _summary(r: Rounds) -> dict[str, Any]:
    n = len(r.domain)
    return {"rounds": n, "tau": float((r.accepted + 1).float().mean()) if n else math.nan,
            "mean_proposed": float(r.proposed.float().mean()) if n else math.nan,
            "verify_rate": float(r.verified.sum() / r.proposed.sum().clamp_min(1)) if n else math.nan}


def evaluate_rounds(rounds: Rounds, calibrator: Any = None, thresholds: Sequence[float] = (),
                    n_bins: int = ECE_BINS) -> dict[str, Any]:
    """Per domain and overall: τ, proposal length, verify rate, the confidence report (raw and,
    with ``calibrator``, calibrated; ECE over ``n_bins`` equal-width bins), and the threshold sweep
    on calibrated survival."""
    from dspark.metrics import confidence_report

    domains = sorted(set(rounds.domain))
    out: dict[str, Any] = {"domains": {}, "overall": {}}
    for name in [*domains, None]:
        r = rounds if name is None else rounds.take(torch.tensor([d == name for d in rounds.domain]))
        res = _summary(r)
        raw_c = torch.sigmoid(r.confidence_logits.float())
        res["raw"] = confidence_report(raw_c, r.accepted, r.verified, n_bins).to_dict()
        cal_c = raw_c
        if calibrator is not None:
            cal_c = calibrator.calibrate(r.confidence_logits.float()).float()
            res["calibrated"] = confidence_report(cal_c, r.accepted, r.verified, n_bins).to_dict()
        if thresholds:
            res["threshold_sweep"] = threshold_sweep(torch.cumprod(cal_c, 1), r.accepted, thresholds, r.proposed)
        if name is None:
            out["overall"] = res
        else:
            out["domains"][name] = res
    return out


def save_json(obj: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    return path
