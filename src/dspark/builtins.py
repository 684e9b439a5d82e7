"""dspark's own implementations, registered through the same hooks a third-party plugin uses."""

from __future__ import annotations

from typing import Any

from dspark.calibration import (
    IdentityCalibrator,
    STSBiasCalibrator,
    STSCalibrator,
    TemperatureCalibrator,
)
from dspark.confidence import (
    DraftHeadConfidence,
    HeadMaxProbConfidence,
    MaxProbConfidence,
    StackedConfidence,
)
from dspark.cost_models import RooflineCostModel, SPSTableCostModel, default_profile_path
from dspark.drafters import NGramDrafter
from dspark.drafters.checkpoint import from_pretrained
from dspark.drafters.config import DrafterConfig
from dspark.drafters.dflash import DFLASH_KIND
from dspark.drafters.dspark import DSPARK_KIND
from dspark.drafters.eagle3 import EAGLE3_FUSED_KIND, EAGLE3_KIND
from dspark.drafters.kinds import drafter_kind
from dspark.heads import GatedMarkovHead, RNNHead, SiluMarkovHead, VanillaMarkovHead
from dspark.hookspecs import Register, hookimpl
from dspark.schedulers import (
    FixedScheduler,
    FullScheduler,
    SPSArgmaxScheduler,
    SPSGreedyScheduler,
    ThresholdScheduler,
)

# The built-in drafter kinds, one folder each under dspark.drafters (a new kind: its folder and a line here).
BUILTIN_KINDS = (DSPARK_KIND, DFLASH_KIND, EAGLE3_KIND, EAGLE3_FUSED_KIND)


def neural_drafter_factory(kind: str):
    """The drafter factory of a neural kind (a plugin's kind registers its drafter with this too):
    ``factory(target=None, checkpoint=None, **config)`` builds a fresh drafter for ``target`` or
    loads a trained one."""
    def factory(target: Any = None, checkpoint: Any = None, **config: Any):
        if checkpoint is not None:
            if config:  # a trained drafter's shape is its checkpoint's: nothing may be ignored silently
                raise ValueError(
                    f"checkpoint= fixes the drafter's configuration (its block size γ included); "
                    f"{', '.join(sorted(config))} cannot be set with it")

            drafter = from_pretrained(checkpoint, target)  # a folder, a shipped name, or "NAME:vocab=K"
            if drafter_kind(drafter.config.kind).family_name != drafter_kind(kind).family_name:
                raise ValueError(f"{checkpoint} holds a {drafter.config.kind} drafter, not {kind}")
            return drafter
        if target is None:
            raise ValueError(f"the {kind} drafter needs target= (to copy its layer shape) or checkpoint=")
        cfg = DrafterConfig.for_target(target.model.config, kind, target_name=getattr(target, "name", "target"), **config)
        drafter = drafter_kind(kind).build(cfg)
        model = target.model
        param = next(model.parameters())
        drafter.to(device=param.device, dtype=param.dtype)
        drafter.bind_target(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
        return drafter.eval()

    return factory


@hookimpl
def register_drafter_kinds(register: Register) -> None:
    for kind in BUILTIN_KINDS:
        register(kind.name, lambda kind=kind: kind, description=kind.description)


@hookimpl
def register_drafters(register: Register) -> None:
    register("ngram", NGramDrafter)
    for kind in BUILTIN_KINDS:
        register(kind.name, neural_drafter_factory(kind.name),
                 description=f"{kind.description} (target=, checkpoint=, config)")


@hookimpl
def register_sequential_heads(register: Register) -> None:
    # Each class is its own factory: (vocab_size, hidden_size, rank=256), W_up zero-initialised.
    register("vanilla-markov", VanillaMarkovHead)
    register("gated-markov", GatedMarkovHead)
    register("rnn", RNNHead)
    register("silu-markov", SiluMarkovHead, description="legacy: dspark's pre-reference vanilla head (b = W_up·SiLU(W_down[x]))")


@hookimpl
def register_confidence_models(register: Register) -> None:
    register("draft-head", DraftHeadConfidence)
    register("max-prob", MaxProbConfidence)
    register("head-max-prob", HeadMaxProbConfidence.create,
             description="the head and the max-prob proxy stacked per position (path= a confidence.json)")
    register("stacked", StackedConfidence.create,
             description="a calibrated per-position logistic stack of named confidence features (path= a confidence.json)")


@hookimpl
def register_calibrators(register: Register) -> None:
    register("identity", IdentityCalibrator)
    register("temperature", TemperatureCalibrator)
    register("sts", STSCalibrator)
    register("sts-bias", STSBiasCalibrator)


def _sps_table(profile: Any = None, **options: Any):
    """SPS(B) from a measured profile (JSON path, dict or SPSProfile); default: the shipped CPU profile."""
    return SPSTableCostModel(profile if profile is not None else default_profile_path(), **options)


def _roofline(gpu: str | None = None, target: Any = None, **options: Any):
    """Analytic roofline step time; ``gpu="h200"|"h100"|"a100"`` uses a datasheet preset,
    ``target="llama-3.1-8b"`` (a TARGET_SHAPES name or an HF config) its parameters and KV bytes."""
    if target is not None:
        return RooflineCostModel.for_target(gpu or None, target, **options)
    return RooflineCostModel.for_gpu(gpu, **options) if gpu else RooflineCostModel(**options)


@hookimpl
def register_cost_models(register: Register) -> None:
    register("sps-table", _sps_table)
    register("roofline", _roofline)


@hookimpl
def register_schedulers(register: Register) -> None:
    register("full", FullScheduler)
    register("fixed", FixedScheduler)
    register("threshold", ThresholdScheduler)
    register("sps-greedy", SPSGreedyScheduler)
    register("sps-argmax", SPSArgmaxScheduler, description="NOT LOSSLESS: global argmax of Θ, for studying its bias")
