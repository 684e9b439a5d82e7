"""Cost models: the hardware's verification speed SPS(B) and the batch B a schedule costs.

Two built-ins satisfy :class:`dspark.protocols.CostModel` (docs/concepts.md §4):

* :class:`SPSTableCostModel` (``"sps-table"``): measured step times from an :class:`SPSProfile`,
  interpolated linearly or as a staircase, because real curves have CUDA-graph buckets (§4).
* :class:`RooflineCostModel` (``"roofline"``): an analytic memory/compute roofline, with presets
  for NVIDIA data-centre GPUs (:data:`GPU_PRESETS`) and target shapes (:data:`TARGET_SHAPES`:
  parameters and KV-cache bytes per token, so that a step reads R · context · KV bytes).

Both own the engine's *accounting*: of R requests verifying ℓ_r drafts each, ``"packed"`` engines
verify B = Σ_r (1 + ℓ_r) tokens, ``"padded"`` ones (HF batch with padding) pay B = R · (1 + max ℓ).
A step costs t(B) + α(R), α(R) being the per-request overhead a profile may record (else 0).

Modules: :mod:`~dspark.cost_models.accounting` (B for a schedule, α(R), the shared protocol
methods), :mod:`~dspark.cost_models.profiles` (:class:`SPSProfile`, its JSON file and
validation), :mod:`~dspark.cost_models.table` (``sps-table``),
:mod:`~dspark.cost_models.roofline` (``roofline``, :data:`GPU_PRESETS`, :data:`TARGET_SHAPES`) and
:mod:`~dspark.cost_models.context` (:class:`~dspark.cost_models.context.ContextBinding`).
Everything public is importable from ``dspark.cost_models``.
"""

from __future__ import annotations

from dspark.cost_models.accounting import (
    ACCOUNTINGS,
    admission_batch_sizes,
    batch_overhead,
    batch_size,
    best_fixed_length,
    check_survival,
    fixed_length_rates,
    plain_step_seconds,
    round_seconds,
)
from dspark.cost_models.profiles import ProfileError, SPSProfile, default_profile_path
from dspark.cost_models.roofline import (
    GPU_PRESETS,
    TARGET_SHAPES,
    GPUSpec,
    RooflineCostModel,
    TargetShape,
    kv_bytes_per_token,
    kv_bytes_per_token_from_config,
    roofline_step_seconds,
    target_shape,
)
from dspark.cost_models.table import EXTRAPOLATIONS as EXTRAPOLATIONS  # outside __all__, as before
from dspark.cost_models.table import FITS as FITS
from dspark.cost_models.table import INTERPOLATIONS as INTERPOLATIONS
from dspark.cost_models.table import (
    SPSTableCostModel,
    fitted_curves,
    plain_curves,
    table_step_seconds,
)

__all__ = [
    "ACCOUNTINGS",
    "GPU_PRESETS",
    "GPUSpec",
    "ProfileError",
    "RooflineCostModel",
    "SPSProfile",
    "SPSTableCostModel",
    "TARGET_SHAPES",
    "TargetShape",
    "admission_batch_sizes",
    "batch_overhead",
    "batch_size",
    "best_fixed_length",
    "check_survival",
    "default_profile_path",
    "fitted_curves",
    "plain_curves",
    "plain_step_seconds",
    "fixed_length_rates",
    "kv_bytes_per_token",
    "kv_bytes_per_token_from_config",
    "round_seconds",
    "roofline_step_seconds",
    "table_step_seconds",
    "target_shape",
]
