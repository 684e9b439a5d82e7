"""What an evaluation runs on: the held-out prompts (and their calibration split), the target and
the sampling at a temperature."""

from __future__ import annotations

from typing import Any

__all__ = ["calibration_split", "eval_prompts", "load_eval_target", "prompt_keys_digest", "sampling_at"]


def calibration_split(prompts: list[Any]) -> tuple[list[Any], list[Any]]:
    """``dspark calibrate``'s split of held-out prompts by their hash: (fit, test) — an even last
    hex digit of the key fits, an odd one scores."""
    return ([p for p in prompts if int(p.key[-1], 16) % 2 == 0],
            [p for p in prompts if int(p.key[-1], 16) % 2 == 1])


def eval_prompts(path: str | None, per_domain: int, skip: int = 0) -> list[Any]:
    """Held-out prompts (a ``dspark data`` eval_prompts.jsonl; default: the shipped ones), at most
    ``per_domain`` per domain in a stable order (by prompt hash), after the first ``skip`` of each
    domain — calibration skips the prompts evaluation uses, so the two never share a prompt."""
    from dspark.data.prompts import jsonl_prompts

    if path is None:
        from dspark.checkpoints import eval_prompts_path

        path = str(eval_prompts_path())
    prompts = list(jsonl_prompts(path))
    out, seen = [], {}
    for p in sorted(prompts, key=lambda p: p.key):
        k = seen.get(p.domain, 0)
        seen[p.domain] = k + 1
        if skip <= k < skip + per_domain:
            out.append(p)
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out


def prompt_keys_digest(prompts: list[Any]) -> str:
    """A digest of the selected prompts' keys (which prompts ran, whatever file they came from)."""
    import hashlib

    return hashlib.blake2b("\n".join(p.key for p in prompts).encode(), digest_size=16).hexdigest()


def sampling_at(temperature: float) -> Any:
    """Greedy sampling at temperature 0, random sampling at any other."""
    from dspark.types import SamplingParams

    return SamplingParams.greedy() if temperature == 0 else SamplingParams.random(temperature)


def load_eval_target(model: str, dtype: str, device: str = "cpu") -> Any:
    """The target ``model`` in ``dtype`` (``float32`` or ``bfloat16``) on ``device``."""
    import torch

    from dspark.targets import load_target

    return load_target(model, {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype], device=device)
