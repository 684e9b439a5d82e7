"""Writing dspark's calibration and cost profile in the formats production engines consume.

Established from the engines' public sources (docs/serving-and-benchmarks.md lists them):

* **TensorRT-LLM** DSpark confidence scheduling (``DSparkDecodingConfig``, PR #17056):
  ``confidence_sts_path`` → ``{"sts_temperatures": [T_1..T_γ]}`` with c_j = σ(z_j / T_j) — the
  same STS dspark fits; ``confidence_sps_table_path`` → the *decomposed* additive cost table
  T(bs, M) = bias + α(bs) + θ(M), M = bs · (verify_len + 1): ``token_counts`` (M, strictly
  increasing), ``step_time_ms`` (θ(M) > 0, extrapolating to 0 at M = 0), ``fixed_overhead_ms``
  (bias), ``batch_sizes`` / ``batch_overhead_ms`` (α), ``_meta.lookup = "interp"``.
* **TensorRT-LLM** main branch: ``draft_len_schedule`` {batch-size upper bound: draft length}
  (batch sizes above the largest key: speculation off; the smallest key maps to max_draft_len).
* **vLLM**: ``speculative_config.num_speculative_tokens_per_batch_size`` [[lo, hi, K], ...]
  (inclusive ranges from 1, non-overlapping, K ≤ num_speculative_tokens); DSpark's adaptive
  verification (``enable_adaptive_verification``) profiles the GPU at start-up and reads no file.

The fixed-length schedules come from :func:`best_fixed_lengths`: for each batch size R the k that
maximises R · (1 + Σ_{j≤k} s_j) / (t_draft(R)·[k > 0] + t(B(R, k))), s_j = P(accepted ≥ j).

Neither engine's file has a context axis, while the verification step costs more over a longer KV
context. So a profile measured at several contexts is written *at the serving context*
(``context``: the mean KV length per request the deployment expects, e.g. prompt + half the
output), recorded in ``_meta.context_tokens``; the fixed lengths are chosen with the cost model
read there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from dspark.cost_models import best_fixed_length, check_survival
from dspark.cost_models.fit import isotonic
from dspark.profiling import ProfileFitError, additive_cost_fit

__all__ = [
    "FormatError",
    "additive_cost_fit",
    "best_fixed_lengths",
    "check_draft_len_schedule",
    "check_trtllm_sps_table",
    "check_trtllm_sts",
    "check_vllm_per_batch_size",
    "draft_len_schedule",
    "trtllm_speculative_config",
    "trtllm_sps_table",
    "trtllm_sts",
    "vllm_per_batch_size",
    "vllm_speculative_config",
]

MIN_THETA_MS = 1e-4  # TensorRT-LLM rejects a non-positive step_time_ms


class FormatError(ValueError):
    """A file would not be accepted by the engine it is written for."""


# --------------------------------------------------------------------------------------------
# TensorRT-LLM: STS temperatures
# --------------------------------------------------------------------------------------------


def trtllm_sts(calibrator: Any) -> dict[str, Any]:
    """A fitted :class:`dspark.calibration.STSCalibrator` → ``confidence_sts_path`` JSON."""
    temps = tuple(getattr(calibrator, "temperatures", ()) or ())
    if getattr(calibrator, "name", None) != "sts" or not temps:
        raise FormatError("TensorRT-LLM's confidence_sts_path needs a fitted STS calibrator "
                          f"(per-position temperatures), got {getattr(calibrator, 'name', calibrator)!r}")
    out = {"sts_temperatures": [float(t) for t in temps]}
    check_trtllm_sts(out)
    return out


def check_trtllm_sts(d: Mapping[str, Any]) -> None:
    temps = d.get("sts_temperatures", d.get("temperatures"))
    if not isinstance(temps, list) or not temps:
        raise FormatError("sts_temperatures must be a non-empty list")
    if not all(isinstance(t, (int, float)) and math.isfinite(t) and t > 0 for t in temps):
        raise FormatError("every STS temperature must be a finite number > 0")


# --------------------------------------------------------------------------------------------
# TensorRT-LLM: the decomposed SPS cost table
# --------------------------------------------------------------------------------------------


def trtllm_sps_table(profile: Any, shapes: Mapping[tuple[int, int], float] | None = None,
                     gamma: int | None = None, context: float | None = None) -> dict[str, Any]:
    """An :class:`dspark.cost_models.SPSProfile` (and, when known, its per-shape timings) →
    ``confidence_sps_table_path`` JSON. With shapes: the decomposed encoding (θ, bias, α; θ over M and
    α over R fitted non-decreasing, as the sps-table model fits a profile). With
    only the profile's points: whole-step times at each B, as the ``sps-table`` model reads them
    (its monotone fit), and no overhead fields (TensorRT-LLM reads that as already including the
    step floor).

    ``context``: write the table at that KV context (module docstring). A profile with curves at
    several contexts is then read there (whole-step form: the per-shape timings belong to the
    profile's main context); a one-curve profile is written at its own context."""
    from dspark.cost_models import SPSTableCostModel

    meta = {"lookup": "interp", "source": "dspark", "device": profile.device, "model": profile.model,
            "dtype": profile.dtype, "date": profile.date, "accounting": profile.accounting,
            "context_tokens": profile.context}
    sizes = [int(b) for b, _ in profile.points]
    model = SPSTableCostModel(profile)  # its monotone fit, as dspark's own schedulers read it
    if context is not None and len(profile.curves()) > 1:  # read at the serving context, whole-step
        model = model.at_context(context)
        meta["context_tokens"], shapes = model.context, None
    points = list(zip(sizes, model.step_seconds(torch.tensor(sizes)).tolist()))
    if gamma:
        meta["recommended_confidence_verify_len_tiers"] = sorted({1, math.ceil(gamma / 2), gamma})
    if shapes:
        bias, alpha, theta = additive_cost_fit(shapes)
        if model.fit == "monotone":  # as the sps-table model reads a profile: never cheaper for more tokens or requests
            theta = dict(zip(theta, isotonic(np.array(list(theta.values()))).tolist()))
            alpha = dict(zip(alpha, isotonic(np.array(list(alpha.values()))).tolist()))
        out = {"token_counts": list(theta), "step_time_ms": [max(1e3 * t, MIN_THETA_MS) for t in theta.values()],
               "fixed_overhead_ms": 1e3 * max(bias, 0.0), "batch_sizes": list(alpha),
               "batch_overhead_ms": [1e3 * max(v, 0.0) for v in alpha.values()],
               "_meta": {**meta, "encoding": "decomposed: T(bs, M) = fixed_overhead + batch_overhead(bs) + step_time(M)"}}
    else:
        out = {"token_counts": [b for b, _ in points], "step_time_ms": [1e3 * t for _, t in points],
               "_meta": {**meta, "encoding": "whole-step: step_time_ms already includes the per-step floor"}}
    check_trtllm_sps_table(out)
    return out


def check_trtllm_sps_table(d: Mapping[str, Any]) -> None:
    counts, times = d.get("token_counts"), d.get("step_time_ms")
    if not isinstance(counts, list) or not isinstance(times, list) or not counts:
        raise FormatError("token_counts and step_time_ms must be non-empty lists")
    if len(counts) != len(times):
        raise FormatError(f"token_counts ({len(counts)}) and step_time_ms ({len(times)}) differ in length")
    if not all(isinstance(c, int) and c >= 0 for c in counts) or any(b <= a for a, b in zip(counts, counts[1:])):
        raise FormatError("token_counts must be strictly increasing integers >= 0")
    if not all(isinstance(t, (int, float)) and math.isfinite(t) and t > 0 for t in times):
        raise FormatError("every step_time_ms must be a finite number > 0")
    if not (isinstance(d.get("fixed_overhead_ms", 0.0), (int, float)) and d.get("fixed_overhead_ms", 0.0) >= 0):
        raise FormatError("fixed_overhead_ms must be a number >= 0")
    if ("batch_sizes" in d) != ("batch_overhead_ms" in d):
        raise FormatError("batch_sizes and batch_overhead_ms come together")
    if "batch_sizes" in d and len(d["batch_sizes"]) != len(d["batch_overhead_ms"]):
        raise FormatError("batch_sizes and batch_overhead_ms differ in length")


def trtllm_speculative_config(gamma: int, sts_path: str, sps_table_path: str) -> dict[str, Any]:
    """The ``speculative_config`` block of an ``--extra_llm_api_options`` YAML for DSpark with
    confidence scheduling (the drafter checkpoint itself must be in TensorRT-LLM's DSpark format)."""
    return {"speculative_config": {
        "decoding_type": "DSpark", "max_draft_len": gamma, "enable_confidence_scheduling": True,
        "enable_ragged_verify": True, "confidence_sts_path": sts_path, "confidence_sps_table_path": sps_table_path,
        "confidence_verify_len_tiers": sorted({1, math.ceil(gamma / 2), gamma})}}


# --------------------------------------------------------------------------------------------
# Fixed draft length per batch size: TensorRT-LLM draft_len_schedule, vLLM per-batch-size K
# --------------------------------------------------------------------------------------------


def _no_draft_time(R: int) -> float:
    return 0.0


def best_fixed_lengths(
    survival: Sequence[float], cost_model: Any, batch_sizes: Sequence[int],
    draft_seconds: Callable[[int], float] = _no_draft_time,
) -> dict[int, int]:
    """For each R the fixed k ∈ 0..γ of highest expected throughput (module docstring).

    ``survival`` s_j = P(accepted ≥ j), j = 1..γ (e.g. from ``dspark eval``'s prefix survival);
    ``cost_model`` gives the verification step time t(B); ``draft_seconds(R)`` the drafting time.
    The result is made non-increasing in R (both engines expect shorter drafts at larger batches).
    """
    s = check_survival(survival)
    out, cap = {}, len(s)
    for R in sorted(batch_sizes):
        best_k, _ = best_fixed_length(s, cost_model, R, draft_seconds(R))
        cap = min(cap, best_k)
        out[R] = cap
    return out


def _ranges(lengths: Mapping[int, int]) -> list[tuple[int, int, int]]:
    """{R: k} over sorted R → [(lo, hi, k)] maximal runs; R values between points take the next's k."""
    out: list[tuple[int, int, int]] = []
    lo = 1
    for R, k in sorted(lengths.items()):
        if out and out[-1][2] == k:
            out[-1] = (out[-1][0], R, k)
        else:
            out.append((lo, R, k))
        lo = R + 1
    return out


def draft_len_schedule(lengths: Mapping[int, int]) -> dict[str, Any]:
    """{R: k} → TensorRT-LLM ``max_draft_len`` + ``draft_len_schedule`` {upper bound: k}; batch
    sizes above the last bound with k > 0 run without speculation."""
    runs = [(lo, hi, k) for lo, hi, k in _ranges(lengths) if k > 0]
    if not runs:
        return {"max_draft_len": 0, "draft_len_schedule": {}}
    out = {"max_draft_len": runs[0][2], "draft_len_schedule": {hi: k for _, hi, k in runs}}
    check_draft_len_schedule(out["draft_len_schedule"], out["max_draft_len"])
    return out


def check_draft_len_schedule(schedule: Mapping[int, int], max_draft_len: int) -> None:
    if not schedule:
        return
    keys = sorted(schedule)
    if any(not isinstance(k, int) or k < 1 for k in keys):
        raise FormatError("draft_len_schedule keys must be batch sizes >= 1")
    if schedule[keys[0]] != max_draft_len:
        raise FormatError("the smallest batch size of draft_len_schedule must map to max_draft_len")
    if any(not 0 <= v <= max_draft_len for v in schedule.values()):
        raise FormatError("draft_len_schedule values must lie in [0, max_draft_len]")


def vllm_per_batch_size(lengths: Mapping[int, int], max_batch_size: int | None = None) -> list[list[int]]:
    """{R: k} → vLLM ``num_speculative_tokens_per_batch_size`` [[lo, hi, K], ...] from 1; the last
    range is extended to ``max_batch_size`` (then K = 0 beyond the measured sizes, as TensorRT-LLM does)."""
    runs = [list(r) for r in _ranges(lengths)]
    top = max(lengths)
    if max_batch_size and max_batch_size > top:
        if runs[-1][2] == 0:
            runs[-1][1] = max_batch_size
        else:
            runs.append([top + 1, max_batch_size, 0])
    check_vllm_per_batch_size(runs, max(k for _, _, k in runs))
    return runs


def check_vllm_per_batch_size(entries: Sequence[Sequence[int]], num_speculative_tokens: int) -> None:
    if not entries or entries[0][0] != 1:
        raise FormatError("num_speculative_tokens_per_batch_size ranges must start at batch size 1")
    prev_hi = 0
    for e in entries:
        if len(e) != 3 or not all(isinstance(v, int) for v in e):
            raise FormatError(f"entry {list(e)} must be [range_start, range_end, num_speculative_tokens]")
        lo, hi, k = e
        if lo <= prev_hi or hi < lo:
            raise FormatError(f"range {list(e)} overlaps the previous one or is empty")
        if not 0 <= k <= num_speculative_tokens:
            raise FormatError(f"range {list(e)}: K must lie in [0, num_speculative_tokens={num_speculative_tokens}]")
        prev_hi = hi


def vllm_speculative_config(gamma: int, model: str, per_batch_size: list[list[int]] | None = None,
                            adaptive: bool = False) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` JSON: DSpark with adaptive verification, or fixed K per batch size."""
    cfg: dict[str, Any] = {"method": "dspark", "model": model, "num_speculative_tokens": gamma}
    if adaptive:
        cfg["enable_adaptive_verification"] = True
    if per_batch_size is not None:
        cfg["num_speculative_tokens_per_batch_size"] = per_batch_size
    return cfg


# --------------------------------------------------------------------------------------------
# Everything at once
# --------------------------------------------------------------------------------------------


def survival_from_rounds(rounds: Any) -> list[float]:
    """s_j = P(accepted ≥ j), j = 1..γ, from rounds recorded with every position verified."""
    gamma = rounds.confidence_logits.shape[1]
    acc = rounds.accepted  # [N]
    return [float((acc >= j).float().mean()) for j in range(1, gamma + 1)]


def write_interop(
    out: Any, *, gamma: int, model: str, calibrator: Any = None, profile: Any = None,
    shapes: Mapping[tuple[int, int], float] | None = None, survival: Sequence[float] | None = None,
    draft_seconds: Callable[[int], float] | None = None, batch_sizes: Sequence[int] = (),
    max_batch_size: int = 256, context: float | None = None,
) -> list[str]:
    """Write every format the inputs allow under ``out`` (trtllm/, vllm/); returns what was
    written and why anything was left out, one line each. ``context``: the serving KV context the
    cost tables and fixed lengths are written at (module docstring)."""
    import json
    from pathlib import Path

    import yaml

    out = Path(out)
    notes: list[str] = []

    def dump(rel: str, obj: Any) -> None:
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith(".yaml"):
            path.write_text(yaml.safe_dump(obj, sort_keys=False))
        else:
            path.write_text(json.dumps(obj, indent=2) + "\n")
        notes.append(f"wrote {path}")

    if calibrator is not None and getattr(calibrator, "name", None) == "sts":
        dump("trtllm/sts.json", trtllm_sts(calibrator))
    elif calibrator is not None and getattr(calibrator, "name", None) == "sts-bias":
        notes.append("STS + bias calibration: TensorRT-LLM's confidence_sts_path holds temperatures only, "
                     "trtllm/sts.json not written (refit with `dspark calibrate --calibrator sts` to export one)")
    else:
        notes.append("no STS calibration: trtllm/sts.json not written")
    if profile is not None:
        try:
            table = trtllm_sps_table(profile, shapes, gamma, context)
        except ProfileFitError as err:  # shapes that cannot be split: the whole-step form
            notes.append(f"per-shape timings not decomposable ({err}); whole-step table written")
            table = trtllm_sps_table(profile, None, gamma, context)
        dump("trtllm/sps_table.json", table)
    else:
        notes.append("no cost profile: trtllm/sps_table.json not written")
    if (out / "trtllm/sts.json").is_file() and (out / "trtllm/sps_table.json").is_file():
        dump("trtllm/extra_llm_api_options.yaml", trtllm_speculative_config(gamma, "sts.json", "sps_table.json"))
    dump("vllm/speculative_config.adaptive.json", vllm_speculative_config(gamma, model, adaptive=True))
    if survival is not None and profile is not None:
        from dspark.cost_models import SPSTableCostModel

        cm = SPSTableCostModel(profile)
        cm = cm.at_context(context) if context is not None else cm
        sizes = sorted(set(batch_sizes) | {1, 2, 4, 8, 16, 32, 64, 128, max_batch_size})
        lengths = best_fixed_lengths(survival, cm, [b for b in sizes if b <= max_batch_size],
                                     draft_seconds or _no_draft_time)
        dump("trtllm/extra_llm_api_options.draft_len_schedule.yaml",
             {"speculative_config": {"decoding_type": "DSpark", **draft_len_schedule(lengths)}})
        dump("vllm/speculative_config.per_batch_size.json",
             vllm_speculative_config(gamma, model, vllm_per_batch_size(lengths, max_batch_size)))
        dump("best_fixed_lengths.json", {"survival": list(survival), "lengths": lengths,
                                         "context_tokens": getattr(cm, "context", None) or profile.context})
    else:
        notes.append("no acceptance survival or profile: per-batch-size draft lengths not written")
    return notes
