"""dspark's own implementations, registered through the same hooks a third-party plugin uses."""

from __future__ import annotations

from typing import Any

from dspark.hookspecs import Register, hookimpl


@hookimpl
def register_drafters(register: Register) -> None:
    from dspark.drafters import NGramDrafter

    register("ngram", NGramDrafter)


@hookimpl
def register_sequential_heads(register: Register) -> None:
    # The neural heads (vanilla-markov, gated-markov, rnn) arrive with the neural drafters.
    return None


@hookimpl
def register_confidence_models(register: Register) -> None:
    from dspark.confidence import DraftHeadConfidence, MaxProbConfidence

    register("draft-head", DraftHeadConfidence)
    register("max-prob", MaxProbConfidence)


@hookimpl
def register_calibrators(register: Register) -> None:
    from dspark.calibration import IdentityCalibrator, STSCalibrator, TemperatureCalibrator

    register("identity", IdentityCalibrator)
    register("temperature", TemperatureCalibrator)
    register("sts", STSCalibrator)


def _sps_table(profile: Any = None, **options: Any):
    """SPS(B) from a measured profile (JSON path, dict or SPSProfile); default: the shipped CPU profile."""
    from dspark.cost_models import SPSTableCostModel, default_profile_path

    return SPSTableCostModel(profile if profile is not None else default_profile_path(), **options)


def _roofline(gpu: str | None = None, **options: Any):
    """Analytic roofline step time; ``gpu="h200"|"h100"|"a100"`` uses a datasheet preset."""
    from dspark.cost_models import RooflineCostModel

    return RooflineCostModel.for_gpu(gpu, **options) if gpu else RooflineCostModel(**options)


@hookimpl
def register_cost_models(register: Register) -> None:
    register("sps-table", _sps_table)
    register("roofline", _roofline)


@hookimpl
def register_schedulers(register: Register) -> None:
    from dspark.schedulers import (
        FixedScheduler,
        FullScheduler,
        SPSArgmaxScheduler,
        SPSGreedyScheduler,
        ThresholdScheduler,
    )

    register("full", FullScheduler)
    register("fixed", FixedScheduler)
    register("threshold", ThresholdScheduler)
    register("sps-greedy", SPSGreedyScheduler)
    register("sps-argmax", SPSArgmaxScheduler, description="NOT LOSSLESS: global argmax of Θ, for studying its bias")
