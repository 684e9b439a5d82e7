"""dspark — confidence-scheduled speculative decoding.

Compose a pipeline from named parts (each a ``typing.Protocol``, each registered through the
plugin hooks in :mod:`dspark.hookspecs`)::

    import dspark
    scheduler = dspark.get_scheduler("sps-greedy")
    cost = dspark.get_cost_model("sps-table", profile="my_profile.json")
    schedule = scheduler.schedule(confidence, cost_model=cost)

The commands are typed functions too, each taking an options object (or its fields as keywords)
whose defaults are the command line's::

    data = dspark.build_data(dspark.DataOptions(out="data/mine", per_domain=50))
    run = dspark.train(dspark.TrainOptions(data="data/mine", out="runs/mine", steps=200))
    report = dspark.evaluate(drafters=[str(run.checkpoint), "ngram"], out="out/eval")

Drafter checkpoints (dspark's, DeepSpec, speculators, z-lab DFlash, or a shipped drafter's name)::

    drafter = dspark.from_pretrained("dspark-5l-xl", target=dspark.load_target("smollm2-135m"))
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

from dspark.engine import Engine  # noqa: E402
from dspark.hookspecs import hookimpl  # noqa: E402
from dspark.plugins import PluginError, list_plugins  # noqa: E402
from dspark.plugins import create as _create  # noqa: E402
from dspark.protocols import (  # noqa: E402
    Calibrator,
    ConfidenceModel,
    CostModel,
    DraftContext,
    Drafter,
    DrafterKind,
    Scheduler,
    SequentialHead,
    TargetFeatures,
    TargetModel,
    TargetOutput,
)
from dspark.request_state import Completion  # noqa: E402
from dspark.targets import HFTarget, load_target  # noqa: E402
from dspark.types import DraftBlock, SamplingParams, Schedule, VerifyResult  # noqa: E402
from dspark.verify import verify, verify_greedy  # noqa: E402


def get_drafter(name: str, /, **config: Any) -> Drafter:
    return _create("drafters", name, **config)


def get_sequential_head(name: str, /, **config: Any) -> SequentialHead:
    return _create("sequential_heads", name, **config)


def get_confidence_model(name: str, /, **config: Any) -> ConfidenceModel:
    return _create("confidence_models", name, **config)


def get_calibrator(name: str, /, **config: Any) -> Calibrator:
    return _create("calibrators", name, **config)


def get_cost_model(name: str, /, **config: Any) -> CostModel:
    return _create("cost_models", name, **config)


def get_scheduler(name: str, /, **config: Any) -> Scheduler:
    return _create("schedulers", name, **config)


def get_drafter_kind(name: str, /) -> DrafterKind:
    """A registered kind of neural drafter (:mod:`dspark.drafters.kinds`)."""
    return _create("drafter_kinds", name)


# The typed functions behind the commands (and their options / results), imported on first use:
# they pull in training, plotting and benchmark code that `import dspark` does not need.
_LAZY = {
    "DataOptions": "dspark.data.build", "DataResult": "dspark.data.build", "build_data": "dspark.data.build",
    "TrainOptions": "dspark.training.run", "TrainResult": "dspark.training.run", "train": "dspark.training.run",
    "CalibrateOptions": "dspark.evaluation.calibration_run", "CalibrateResult": "dspark.evaluation.calibration_run",
    "calibrate": "dspark.evaluation.calibration_run", "EvalOptions": "dspark.evaluation.eval_run",
    "EvalResult": "dspark.evaluation.eval_run", "evaluate": "dspark.evaluation.eval_run",
    "BenchOptions": "dspark.bench.run", "BenchResult": "dspark.bench.run", "run_bench": "dspark.bench.run",
    "DemoOptions": "dspark.demo", "DemoResult": "dspark.demo", "run_demo": "dspark.demo",
    "from_pretrained": "dspark.drafters.checkpoint", "save_pretrained": "dspark.drafters.checkpoint",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dspark' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "__version__",
    "hookimpl",
    "PluginError",
    "list_plugins",
    "get_drafter",
    "get_sequential_head",
    "get_confidence_model",
    "get_calibrator",
    "get_cost_model",
    "get_scheduler",
    "get_drafter_kind",
    "DrafterKind",
    "Calibrator",
    "ConfidenceModel",
    "CostModel",
    "DraftContext",
    "TargetFeatures",
    "Drafter",
    "Scheduler",
    "SequentialHead",
    "TargetModel",
    "TargetOutput",
    "DraftBlock",
    "SamplingParams",
    "Schedule",
    "VerifyResult",
    "verify",
    "verify_greedy",
    "Engine",
    "Completion",
    "HFTarget",
    "load_target",
    *_LAZY,
]
