"""Writing a :class:`~dspark.drafters.formats.portable.Portable` as a checkpoint folder: dspark's
own format, DeepSpec or speculators. A reference format's ``config.json`` is the fields every
kind shares (the Qwen3 draft-layer config, the verifier, the layer ids) plus the drafter kind's
own (its kind object's ``deepspec_fields`` / ``speculators_fields``); what a format cannot
represent is refused with one sentence naming each reason (:class:`FormatError`), the kind's
reasons first (its ``refusals``), never approximated.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from dspark.drafters.config import FORMAT_VERSION
from dspark.drafters.formats.checks import check_tensors
from dspark.drafters.formats.portable import (
    CONFIG_NAME,
    DEEPSPEC_EXTRAS,
    EXTRAS_KEY,
    TARGET_KEYS,
    WEIGHTS_NAME,
    FormatError,
    Portable,
    dtype_name,
    from_reference_keys,
    layer_config,
    verifier_config,
    verifier_name,
)
from dspark.drafters.kinds import drafter_kind
from dspark.drafters.speculators_vocab import to_speculators_vocab

__all__ = ["SPECULATORS_VERSION", "WRITABLE", "write"]

# The speculators release whose config layout the writer follows (the ``interop`` extra pins it;
# its SpeculatorModel.from_pretrained loads what the writer writes: tests/test_interop_speculators.py).
SPECULATORS_VERSION = "0.9.0"
WRITABLE = ("dspark", "deepspec", "speculators")


def refuse_unrepresentable(p: Portable, fmt: str) -> None:
    """Raise a FormatError naming every reason reference format ``fmt`` cannot hold ``p``."""
    c = p.config
    reasons = list(drafter_kind(c.kind).refusals(c, fmt))
    if not c.layer.qk_norm:
        reasons.append(f"its draft layers lack q/k norm; the {fmt} format's draft layers are Qwen3 layers")
    if c.draft_vocab_size is not None and fmt == "deepspec":
        reasons.append("it has a reduced draft vocabulary, which DeepSpec's checkpoints do not hold (the speculators "
                       "format does: d2t / t2d)")
    if fmt == "deepspec" and not p.verifier_layers_known:
        reasons.append("the source does not record the verifier's layer count (num_target_layers); pass the target")
    missing = [k for k in TARGET_KEYS if k not in p.weights]
    if missing:
        reasons.append(f"the {fmt} format stores the target's embedding and LM head, and this source has none "
                       "(a dspark checkpoint: pass the target it was trained for)")
    if reasons:
        raise FormatError(f"cannot write this {c.kind} drafter in the {fmt} format: " + "; ".join(reasons))


def _deepspec_config(p: Portable) -> dict[str, Any]:
    c = p.config
    out = {**layer_config(c.layer, c.num_layers, c.vocab_size, p.max_positions),
           "dtype": dtype_name(p.weights), "num_target_layers": c.target.num_layers,
           "target_layer_ids": list(c.target_layer_ids)}
    out.update(drafter_kind(c.kind).deepspec_fields(p))  # its architecture and fields
    kept = p.extras.get("deepspec", {})  # the source's training fields (num_anchors, …) over the defaults
    out.update({k: kept[k] for k in DEEPSPEC_EXTRAS if k in kept})
    return dict(sorted(out.items()))


def _verifier_fields(p: Portable) -> dict[str, Any]:
    """speculators_config.verifier: a name that resolves and the verifier's real architectures."""
    name = verifier_name(p, "speculators_config.verifier.name_or_path")
    archs = list(p.verifier_architectures) or verifier_config(name, p.path).get("architectures")
    if not archs:
        raise FormatError(f"cannot write speculators_config.verifier.architectures: nothing records the "
                          f"architecture of verifier {name!r}; pass --target, or --verifier with an HF folder "
                          "holding its config.json")
    return {"architectures": list(archs), "name_or_path": name}


def _speculators_config(p: Portable) -> dict[str, Any]:
    c = p.config
    kind = drafter_kind(c.kind)
    verifier = _verifier_fields(p)
    arch = kind.speculators_arch
    out: dict[str, Any] = {
        "architectures": [arch],
        # speculators names a model XDraftModel and its config class XSpeculatorConfig
        "auto_map": {"": f"config.{arch.removesuffix('DraftModel')}SpeculatorConfig"},
        "draft_vocab_size": c.vocab_size if c.draft_vocab_size is None else c.draft_vocab_size - 1,
        "dtype": dtype_name(p.weights),
        "speculators_config": {"algorithm": c.kind, "default_proposal_method": "greedy",
                               "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                                     "speculative_tokens": c.gamma, "verifier_accept_k": 1}],
                               "verifier": verifier},
        "speculators_model_type": c.kind, "speculators_version": SPECULATORS_VERSION,
        "target_hidden_size": None, "tie_word_embeddings": False,
        "transformer_layer_config": layer_config(c.layer, c.num_layers, c.vocab_size, p.max_positions),
        "transformers_version": _transformers_version(),
        # speculators / vLLM index hidden_states: the decoder layer ids + 1
        kind.speculators_layer_ids_field: [i + 1 for i in c.target_layer_ids],
    }
    out.update(kind.speculators_fields(c))
    if p.extras:
        out[EXTRAS_KEY] = p.extras  # what speculators has no field for (DeepSpec's num_anchors, …)
    return dict(sorted(out.items()))


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _dspark_files(p: Portable, out: Path) -> None:
    from safetensors.torch import save_file

    from dspark import __version__

    state = from_reference_keys(p.config.kind, {k: v for k, v in p.weights.items() if k not in TARGET_KEYS})
    if p.config.mask_token_id is not None:
        state.pop("mask_embedding", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / WEIGHTS_NAME), metadata={"format": "dspark.drafter"})
    meta = {"format": "dspark.drafter", "format_version": FORMAT_VERSION, "dspark_version": __version__,
            "config": p.config.to_dict(), "converted_from": p.source_format}
    if p.extras:
        meta["reference_fields"] = p.extras
    (out / CONFIG_NAME).write_text(json.dumps(meta, indent=2) + "\n")


def _reference_config(p: Portable, fmt: str) -> dict[str, Any]:
    refuse_unrepresentable(p, fmt)
    return _deepspec_config(p) if fmt == "deepspec" else _speculators_config(p)


def _reference_files(p: Portable, out: Path, fmt: str, cfg: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    weights = p.weights
    if p.config.draft_vocab_size is not None:  # dspark's draft slots → speculators' d2t / t2d
        weights = to_speculators_vocab(weights, p.config.vocab_size)
    state, seen = {}, set()
    for k, v in weights.items():
        if k == "mask_embedding":
            continue
        v = v.contiguous()
        if v.data_ptr() in seen:  # a tied target (embedding = LM head): the formats store both tensors
            v = v.clone()
        seen.add(v.data_ptr())
        state[k] = v
    save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})  # as transformers' save_pretrained
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")


def write(p: Portable, fmt: str, out: str | Path, *, overwrite: bool = False,
          sources: tuple[str | Path, ...] = ()) -> Path:
    """Write ``p`` as a ``fmt`` checkpoint folder ``out``, all or nothing: the files go to a
    temporary sibling folder that replaces ``out`` only once complete. ``out`` is replaced only
    if it is empty or dspark wrote it, and never if it is, or holds, one of ``sources``
    (:mod:`dspark.outdir`)."""
    from dspark.outdir import OutputError, build_beside, check_replaceable, swap_in

    if fmt not in WRITABLE:
        raise FormatError(f"cannot write format {fmt!r}; writable: dspark, deepspec, speculators")
    if fmt != "dspark":
        refuse_unrepresentable(p, fmt)  # before touching the disk
    try:
        out = check_replaceable(out, overwrite=overwrite, sources=sources)
    except OutputError as err:
        raise FormatError(str(err)) from None
    check_tensors(p, p.path / WEIGHTS_NAME if p.path is not None else Path(f"<{p.source_format} checkpoint>"))
    cfg = _reference_config(p, fmt) if fmt != "dspark" else {}  # the verifier's refusals, before the disk
    tmp = build_beside(out)
    try:
        if fmt == "dspark":
            _dspark_files(p, tmp)
        else:
            _reference_files(p, tmp, fmt, cfg)
        swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
