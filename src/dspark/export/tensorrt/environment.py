"""Whether TensorRT engines can be built and run here (the package really importable, recent
enough, a CUDA device torch can see), the logger that turns TensorRT's errors into our sentences,
and :class:`TensorRTError`."""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

from dspark.export.manifest import ExportError

__all__ = ["MIN_MAJOR", "TensorRTError", "cuda_problem", "import_tensorrt", "major_version", "one_line",
           "require_tensorrt", "tensorrt_problem", "trt_logger", "with_log"]

log = logging.getLogger(__name__)

MIN_MAJOR = 10


class TensorRTError(ExportError):
    """TensorRT is missing or broken here, or it failed on an export folder (one sentence)."""


def one_line(text: Any, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def major_version(version: str) -> int:
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        return 0


def cuda_problem() -> str | None:
    try:
        available = torch.cuda.is_available()
    except Exception as exc:  # a broken driver / CUDA install can raise here
        return f"torch cannot query CUDA ({type(exc).__name__}: {one_line(exc, 160)})"
    if available:
        return None
    if not torch.version.cuda:
        return "no CUDA device is visible to torch (this torch is a CPU-only build)"
    return (f"no CUDA device is visible to torch (a CUDA {torch.version.cuda} build: check the driver "
            "with nvidia-smi and CUDA_VISIBLE_DEVICES)")


def import_tensorrt() -> tuple[Any, str | None]:
    """(the tensorrt module or None, what is wrong with it or None). The package is really
    imported: ``importlib.util.find_spec`` finds a wheel whose libraries cannot load."""
    try:
        trt = importlib.import_module("tensorrt")
    except ModuleNotFoundError as exc:
        if exc.name == "tensorrt":
            return None, "the tensorrt Python package is not installed"
        return None, f"the tensorrt package is installed but cannot be imported ({type(exc).__name__}: {one_line(exc, 160)})"
    except Exception as exc:  # a missing libnvinfer raises OSError / ImportError from inside the package
        return None, f"the tensorrt package is installed but cannot be imported ({type(exc).__name__}: {one_line(exc, 160)})"
    version = str(getattr(trt, "__version__", "?"))
    if not all(hasattr(trt, a) for a in ("Builder", "OnnxParser", "Runtime", "ILogger")):
        return None, f"the installed tensorrt {version} is not a usable TensorRT (no Builder / OnnxParser / Runtime)"
    if major_version(version) < MIN_MAJOR:
        return None, f"the installed TensorRT {version} is too old (dspark needs TensorRT {MIN_MAJOR} or newer)"
    return trt, None


def trt_logger(trt: Any, echo_warnings: bool = True) -> Any:
    """A ``trt.ILogger`` that logs TensorRT's warnings and keeps its errors for our sentence."""

    class _Recorder(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            level = int(severity)  # ILogger.Severity: INTERNAL_ERROR 0, ERROR 1, WARNING 2, INFO 3, VERBOSE 4
            if level <= 1:
                self.errors.append(one_line(msg, 400))
            elif level == 2 and echo_warnings:
                log.warning("[TensorRT] %s", msg)

        def last(self, n: int = 2) -> str:
            return "; ".join(self.errors[-n:])

    return _Recorder()


def with_log(logger: Any, fallback: str = "") -> str:
    last = logger.last() if logger is not None else ""
    return f" (TensorRT: {one_line(last)})" if last else fallback


def tensorrt_problem(probe: bool = False) -> str | None:
    """None when engines can be built and run here, else what is wrong (a sentence fragment).

    Imports tensorrt (a broken install fails here, not after the target has loaded), checks its version and
    that torch sees a CUDA device; ``probe`` also creates a ``trt.Builder``, which initialises CUDA
    inside TensorRT (a wheel built for a newer CUDA than the driver supports fails there)."""
    trt, problem = import_tensorrt()
    problems = [problem] if problem else []
    cuda = cuda_problem()
    if cuda:
        problems.append(cuda)
    if not problems and probe:
        logger = trt_logger(trt, echo_warnings=False)
        try:
            builder = trt.Builder(logger)
        except Exception as exc:
            builder, why = None, f"{type(exc).__name__}: {one_line(exc, 160)}"
        else:
            why = ""
        if builder is None:
            why = logger.last() or why or "no error was logged"
            major = (torch.version.cuda or "12").split(".")[0]
            problems.append(f"TensorRT {trt.__version__} cannot create a builder on this machine ({one_line(why, 200)}); "
                            f"is the tensorrt wheel built for a CUDA the driver supports? (torch is built for CUDA "
                            f"{torch.version.cuda}: pip install 'tensorrt-cu{major}>=10')")
        del builder
    return " and ".join(problems) or None


def require_tensorrt() -> Any:
    why = tensorrt_problem()
    if why:
        raise TensorRTError(f"the TensorRT backend cannot run here: {why}")
    trt, _ = import_tensorrt()
    return trt
