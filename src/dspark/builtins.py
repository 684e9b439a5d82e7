"""dspark's own implementations, registered through the same hooks a third-party plugin uses."""

from __future__ import annotations

from typing import Any

from dspark.hookspecs import Register, hookimpl


def _neural(kind: str):
    def factory(target: Any = None, checkpoint: Any = None, **config: Any):
        from dspark.drafters.checkpoint import from_pretrained
        from dspark.drafters.config import DrafterConfig
        from dspark.drafters.neural import build_drafter

        if checkpoint is not None:
            from dspark.checkpoints import locate

            if config:  # a trained drafter's shape is its checkpoint's: nothing may be ignored silently
                raise ValueError(
                    f"checkpoint= fixes the drafter's configuration (its block size γ included); "
                    f"{', '.join(sorted(config))} cannot be set with it")

            checkpoint = locate(checkpoint)  # a folder, or a shipped drafter's name ("dspark-gated")
            drafter = from_pretrained(checkpoint, target)
            if drafter.config.kind.split("-")[0] != kind.split("-")[0]:  # eagle3 also loads eagle3-fused
                raise ValueError(f"{checkpoint} holds a {drafter.config.kind} drafter, not {kind}")
            return drafter
        if target is None:
            raise ValueError(f"the {kind} drafter needs target= (to copy its layer shape) or checkpoint=")
        cfg = DrafterConfig.for_target(target.model.config, kind, target_name=getattr(target, "name", "target"), **config)
        drafter = build_drafter(cfg)
        model = target.model
        drafter.to(next(model.parameters()).dtype)
        drafter.bind_target(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
        return drafter.eval()

    factory.__doc__ = {
        "dspark": "DSpark: parallel backbone + sequential head + confidence head (target=, checkpoint=, config).",
        "dflash": "DFlash: the parallel backbone alone (target=, checkpoint=, config).",
        "eagle3": "Eagle3 (DeepSpec layout): one autoregressive layer over the fused target features.",
        "eagle3-fused": "legacy: dspark's pre-reference Eagle3 layout (format_version 1 checkpoints).",
    }[kind]
    return factory


@hookimpl
def register_drafters(register: Register) -> None:
    from dspark.drafters import NGramDrafter

    register("ngram", NGramDrafter)
    for kind in ("dspark", "dflash", "eagle3", "eagle3-fused"):
        register(kind, _neural(kind))


@hookimpl
def register_sequential_heads(register: Register) -> None:
    from dspark.heads import GatedMarkovHead, RNNHead, SiluMarkovHead, VanillaMarkovHead

    # Each class is its own factory: (vocab_size, hidden_size, rank=256), W_up zero-initialised.
    register("vanilla-markov", VanillaMarkovHead)
    register("gated-markov", GatedMarkovHead)
    register("rnn", RNNHead)
    register("silu-markov", SiluMarkovHead, description="legacy: dspark's pre-reference vanilla head (b = W_up·SiLU(W_down[x]))")


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
