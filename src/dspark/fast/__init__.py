"""The fast target step: the decoder as plain tensor code with prepacked or compiled weights.

* :mod:`dspark.fast.llama` — :class:`LlamaStep`, one Llama-family forward over a read-only past;
* :mod:`dspark.fast.linear` — linear layers prepacked for the CPU's matmul library;
* :mod:`dspark.fast.compile` — ``torch.compile`` (inductor freezing on CPU, CUDA graphs on GPU);
* :mod:`dspark.fast.target` — :class:`FastTarget` and :func:`build_target`, the TargetModel over it.
"""

from dspark.fast.compile import CompileUnavailable
from dspark.fast.target import PATHS, FastTarget, build_target

__all__ = ["PATHS", "CompileUnavailable", "FastTarget", "build_target"]
