"""Drafter checkpoint formats: dspark's own, DeepSpec (the paper's code), speculators (what vLLM
serves) and z-lab DFlash — detected, read and written (docs/interop.md, field by field).

Every format is read into one neutral form, a :class:`Portable`: the :class:`DrafterConfig`, the
weights under the *reference* key names (DeepSpec = speculators: ``fc``, ``hidden_norm``,
``layers.N.self_attn.q_proj``, ``markov_head.markov_w1``, ``confidence_head.proj``, …) with the
dtypes and bytes they were stored with, the target's ``embed_tokens`` / ``lm_head`` where the
checkpoint carries them, and what the source says about its verifier. Writers take a Portable, so
DeepSpec ⇄ speculators conversion copies tensors untouched (only ``config.json`` differs).

What differs between drafter kinds — the tensor-name map, the config fields each kind writes to
and reads from each format, what a format cannot hold of it — is the kind object's
(:class:`~dspark.drafters.kinds.NeuralKind`, one per kind folder); the modules here never name a
kind. :mod:`~dspark.drafters.formats.portable` holds the neutral form and the shared helpers,
:mod:`~dspark.drafters.formats.readers` detection and reading, :mod:`~dspark.drafters.formats.writers`
writing, :mod:`~dspark.drafters.formats.checks` the checks before either; this module builds
drafters from a Portable and converts folders.

What a format cannot represent is refused with one sentence naming it (:class:`FormatError`),
never approximated: vLLM's DSpark model has only the vanilla head, so gated / rnn heads go to the
DeepSpec format only; reference formats embed the mask slots with a target token's embedding, so
a learned mask vector has no place there; their draft layers are Qwen3 layers (q/k norm).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attrs import evolve

from dspark.drafters.files import _bind, _load_state
from dspark.drafters.formats.checks import check_tensors, check_verifier
from dspark.drafters.formats.portable import (
    TARGET_KEYS,
    WEIGHTS_NAME,
    FormatError,
    Portable,
    from_reference_keys,
    to_reference_keys,
    verifier_config,
)
from dspark.drafters.formats.readers import FORMATS, detect, read
from dspark.drafters.formats.writers import SPECULATORS_VERSION, write

__all__ = ["FORMATS", "SPECULATORS_VERSION", "FormatError", "Portable", "detect", "read", "write", "convert", "build",
           "portable_from_drafter", "with_verifier", "to_reference_keys", "from_reference_keys", "check_tensors"]


def build(p: Portable, target: Any = None) -> Any:
    """A drafter module from a Portable (checked against and bound to ``target`` when given)."""
    from dspark.drafters.neural import build_drafter

    config = check_verifier(p, target) if target is not None else p.config
    where = p.path / WEIGHTS_NAME if p.path is not None else Path(f"<{p.source_format} checkpoint>")
    check_tensors(evolve(p, config=config), where, complete=False)  # before allocating anything
    drafter = build_drafter(config)
    state = from_reference_keys(config.kind, {k: v for k, v in p.weights.items() if k not in TARGET_KEYS})
    if config.mask_token_id is not None:
        state.pop("mask_embedding", None)  # vLLM's loader skips this placeholder too
    _load_state(drafter, state, where)
    if target is not None:
        _bind(drafter, target)
    return drafter.eval()


def portable_from_drafter(drafter: Any, target: Any = None) -> Portable:
    """A Portable of a (bound) dspark drafter; the bound target embedding / LM head become
    ``embed_tokens`` / ``lm_head`` (what the reference formats store)."""
    config = drafter.config
    weights = to_reference_keys(config.kind, {k: v.detach() for k, v in drafter.state_dict().items()})
    if getattr(drafter, "_embed", None) is not None:
        dt = next(drafter.parameters()).dtype
        weights["embed_tokens.weight"] = drafter._embed.to(dt)
        weights["lm_head.weight"] = drafter._lm_head_full.to(dt)
    max_pos = getattr(getattr(getattr(target, "model", None), "config", None), "max_position_embeddings", None)
    return Portable(config, weights, config.target.name, target_architectures(target), max_pos, "dspark")


def target_architectures(target: Any) -> tuple[str, ...]:
    """The architectures of ``target`` (an HFTarget / FastTarget or an HF model): its config's, or
    the model's class name where the config has none (a GGUF-loaded model: ``architectures`` None)."""
    if target is None:
        return ()
    model = getattr(target, "model", target)
    archs = getattr(getattr(model, "config", None), "architectures", None)
    if archs:
        return tuple(archs)
    return (type(model).__name__,) if hasattr(model, "get_output_embeddings") else ()


def with_verifier(p: Portable, *, target: Any = None, verifier: str | Path | None = None) -> Portable:
    """``p`` naming its verifier as a reference format records it: ``verifier`` (a hub id or HF
    folder) over the ``target``'s name (``target.name``: a dspark alias becomes its hub id) over what
    the source recorded; the architectures from the target's model, else the ``verifier`` folder's
    config.json, else the source's."""
    name, archs = p.verifier, p.verifier_architectures
    if target is not None:
        name = getattr(target, "name", None) or name
        archs = target_architectures(target) or archs
    if verifier is not None:
        name = str(verifier)
        if target is None:
            archs = tuple(verifier_config(name, None).get("architectures") or ()) or archs
    return evolve(p, verifier=name, verifier_architectures=archs)


def convert(src: str | Path, to: str, out: str | Path, *, target: Any = None, overwrite: bool = False,
            verifier: str | Path | None = None) -> Path:
    """Convert checkpoint folder ``src`` (any readable format) to format ``to`` in ``out``.

    A dspark-format source needs ``target`` to write a reference format (those store the target's
    embedding and LM head); reference ⇄ reference conversion copies the tensors untouched.
    ``verifier`` (a hub id or an HF folder) is the verifier the output names
    (:func:`with_verifier`); the speculators format refuses a source that names none.
    """
    from dspark.outdir import OutputError, check_replaceable

    try:  # before reading anything: the output must be one dspark may write
        check_replaceable(out, overwrite=overwrite, sources=(src,))
    except OutputError as err:
        raise FormatError(str(err)) from None
    p = read(src)
    if p.source_format == "dspark" and to != "dspark" and target is not None:
        drafter = build(p, target)
        p = evolve(portable_from_drafter(drafter, target), extras=p.extras)
    elif target is not None:
        p = evolve(p, config=check_verifier(p, target), verifier_layers_known=True)
    return write(with_verifier(p, target=target, verifier=verifier), to, out, overwrite=overwrite, sources=(src,))
