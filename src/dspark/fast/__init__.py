"""The fast target step: the decoder as plain tensor code with prepacked or compiled weights.

* :mod:`dspark.fast.llama` — :class:`LlamaStep`, one Llama-family forward over a read-only past;
* :mod:`dspark.fast.linear` — linear layers prepacked for the CPU's matmul library;
* :mod:`dspark.fast.compile` — ``torch.compile`` (inductor freezing on CPU, CUDA graphs on GPU);
* :mod:`dspark.fast.target` — :class:`FastTarget` and :func:`build_target`, the TargetModel over it.

The names below load on first use, so that importing :mod:`dspark.fast.linear` (the drafters do)
does not import the target.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PATHS", "CompileUnavailable", "FastTarget", "build_target"]

_HOMES = {"PATHS": "dspark.fast.target", "FastTarget": "dspark.fast.target", "build_target": "dspark.fast.target",
          "CompileUnavailable": "dspark.fast.compile"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'dspark.fast' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_HOMES[name]), name)
