"""Drafting with exported graphs: an export folder's manifest + a backend's runner, driven by the
one drafting loop (:mod:`dspark.drafters.loop`) the PyTorch drafters run too.

A backend supplies a :class:`~dspark.drafters.loop.GraphRunner`: ``run(graph, {input: tensor}) →
{output: tensor}`` (ONNX Runtime: :mod:`dspark.export.ort`; TensorRT:
:mod:`dspark.export.tensorrt`). Per-request state, padding, the sequential-head steps and
sampling are the loop's, so the outputs match the PyTorch drafter step for step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dspark.drafters.kinds import drafter_kind
from dspark.drafters.loop import DraftingLoop, GraphRunner, KVStore, LoopSpec
from dspark.drafters.vocab import DraftVocab
from dspark.export.manifest import MANIFEST_NAME as MANIFEST
from dspark.export.manifest import ExportError
from dspark.protocols.drafter import DraftContext
from dspark.types import DraftBlock

__all__ = ["GraphRunner", "ExportedDrafter", "loop_spec"]


def loop_spec(manifest: dict[str, Any]) -> LoopSpec:
    """The loop's view of an export folder's manifest."""
    ids = manifest.get("draft_ids")
    head = manifest.get("head")
    cfg = manifest.get("drafter_config") or {}
    return LoopSpec(
        kind=manifest["kind"], gamma=int(manifest["gamma"]), vocab_size=int(manifest["vocab_size"]),
        hidden_size=int(manifest["hidden_size"]),
        target_layer_ids=tuple(int(i) for i in manifest["target_layer_ids"]),
        num_layers=int(manifest["num_layers"]), num_kv_heads=int(manifest["num_kv_heads"]),
        head_dim=int(manifest["head_dim"]), head=head, rank=int(manifest.get("rank") or 0),
        confidence=bool(manifest.get("confidence")),
        stateful_head=bool(manifest.get("stateful_head", head == "rnn")),
        sample_from_anchor=bool(cfg.get("sample_from_anchor", True)),
        # manifests before format 1.x's "returns_hidden": block drafters returned h, Eagle3 nothing
        returns_hidden=bool(manifest.get("returns_hidden", "backbone" in manifest.get("graphs", {}))),
        vocab_map=DraftVocab(torch.tensor(ids), int(manifest["vocab_size"])) if ids else None)


class ExportedDrafter:
    """A :class:`dspark.protocols.Drafter` over the graphs of one export folder."""

    backend = "graphs"

    def __init__(self, manifest: dict[str, Any], runner: GraphRunner, root: str | Path | None = None) -> None:
        self.manifest = manifest
        self.runner = runner
        self.root = Path(root) if root is not None else None
        spec = loop_spec(manifest)
        self.loop = DraftingLoop(spec, runner, drafter_kind(spec.kind).drafting_round())
        self.kind = self.name = spec.kind
        self.gamma, self.vocab_size, self.hidden_size = spec.gamma, spec.vocab_size, spec.hidden_size
        self.target_layer_ids = spec.target_layer_ids
        self.feature_size = spec.feature_size
        self.num_layers, self.num_kv_heads, self.head_dim = spec.num_layers, spec.num_kv_heads, spec.head_dim
        self.head, self.rank, self.confidence = spec.head, spec.rank, spec.confidence
        self.vocab_map = spec.vocab_map
        self.device = runner.device
        # what the PyTorch drafter schedules with (manifest "scheduling"): its confidence model, which
        # dspark.Engine uses by default; the folder's calibration.json is read by calibrator_beside
        self.confidence_model = scheduling_confidence_model(manifest, self.root)

    def __repr__(self) -> str:
        where = f" from {self.root}" if self.root else ""
        return f"{type(self).__name__}({self.kind}, γ={self.gamma}, V={self.vocab_size}{where})"

    def check_target(self, target: Any) -> None:
        """Raise an ExportError unless ``target`` (an HFTarget or HF model) has the embedding and
        LM head baked into these graphs (compared by sha256 of their fp32 bytes)."""
        from dspark.export.manifest import sha256_tensor

        model = getattr(target, "model", target)
        baked = self.manifest["target"]["baked_weights"]
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        if tuple(embed.shape) != (self.vocab_size, self.hidden_size):
            raise ExportError(
                f"target embedding is {tuple(embed.shape)}; these graphs were exported for "
                f"[vocab {self.vocab_size}, hidden {self.hidden_size}]"
            )
        for what, w, key in (("embedding", embed, "embedding_sha256"), ("LM head", head, "lm_head_sha256")):
            if sha256_tensor(w) != baked[key]:
                raise ExportError(
                    f"the target's {what} differs from the one baked into {self.root or 'these graphs'}; "
                    "export the drafter again with this target (--target)"
                )

    # -- protocol ---------------------------------------------------------------------------
    def release(self, request_id: str) -> None:
        self.loop.release(request_id)

    def draft(self, context: DraftContext) -> DraftBlock:
        return self.loop.draft(context)

    @property
    def timings(self) -> dict[str, float]:
        return self.loop.timings

    @property
    def _caches(self) -> dict[str, KVStore]:
        return self.loop.caches


def scheduling_confidence_model(manifest: dict[str, Any], root: Path | None) -> Any:
    """The confidence model an export folder's manifest lists under ``scheduling`` (None: none)."""
    from dspark.confidence import load_confidence_model

    entry = (manifest.get("scheduling") or {}).get("confidence")
    if entry is None:
        return None
    if root is None:
        raise ExportError("the manifest lists a confidence model but the drafter has no export folder to read it from")
    try:
        model = load_confidence_model(root) if entry["file"] == "confidence.json" else None
    except ValueError as exc:
        raise ExportError(f"{root / entry['file']}: {exc}") from None
    if model is None:
        raise ExportError(f"{root / MANIFEST}: scheduling.confidence must be confidence.json, got {entry['file']!r}")
    return model


def require_kind(manifest: dict[str, Any]) -> None:
    """Raise an ExportError unless the manifest's kind is a registered drafter kind."""
    try:
        drafter_kind(str(manifest.get("kind")))
    except ValueError as exc:
        raise ExportError(f"manifest kind {manifest.get('kind')!r} is not an exported neural drafter ({exc})") from None
