"""Targets: the models whose outputs speculative decoding must reproduce.

* :class:`~dspark.hf_target.HFTarget` — any HF causal LM with a plain full-attention cache, many
  requests batched over per-request KV caches, stepped by the HF forward (the ``eager`` path);
* :class:`~dspark.fast.FastTarget` — the same requests and caches stepped by dspark's own
  Llama-family forward, with prepacked (``packed``) or compiled (``compiled``) weights;
* :func:`load_target` — either, for a model name, folder or GGUF file.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from dspark.drafters.config import default_layer_ids
from dspark.fast import FastTarget, build_target
from dspark.hf_target import HFTarget
from dspark.models import SMOLLM2, load_causal_lm
from dspark.options import STEP_PATHS

__all__ = ["FastTarget", "HFTarget", "build_target", "default_layer_ids", "load_target"]


def load_target(
    spec: str = SMOLLM2, dtype: torch.dtype = torch.float32, capture_layers: Iterable[int] = (),
    device: Any = None, path: str = "packed",
) -> HFTarget:
    """A target for ``spec`` on ``device`` (see :func:`dspark.models.load_causal_lm`) whose step
    runs on ``path`` (:func:`dspark.fast.build_target`: ``packed`` by default, ``eager`` for the HF
    forward, ``compiled``); drafters loaded for it follow it to its device."""
    if path not in STEP_PATHS:  # before the model load
        raise ValueError(f"path must be one of {', '.join(STEP_PATHS)}, got {path!r}")
    model, tokenizer = load_causal_lm(spec, dtype, device)
    return build_target(model, tokenizer, capture_layers, path=path)
