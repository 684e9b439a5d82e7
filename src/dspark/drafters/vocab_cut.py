"""A checkpoint's measured vocabulary cut: the evidence that its ``:vocab=K`` variant
(:mod:`dspark.drafters.prune`) keeps τ within a tolerance, so that a start-up race may try it.

A cut scores K + 1 rows instead of V in the LM head over the block and in the Markov head's W_up,
which shortens the draft round; it also loses the drafts whose token is outside the K. Which of the
two wins is a fact about the drafter and the text, measured once by ``dspark eval`` (greedy, every
draft position verified, the full drafter and the cut on the same prompts) and recorded next to the
weights as ``vocab_cut.json`` (:func:`record_vocab_cut`):

    {"draft_vocab": K, "tau_full": τ, "tau_cut": τ_K, "temperature": 0.0, "prompts": …,
     "prompts_count": n, "model": …, "dtype": …, "command": "dspark eval …",
     "checkpoint_digest": the digest of the folder the eval read}

:func:`raceable_cut` reads it back and accepts it only for the same weights (the digest of the
folder now, this file left out) and a τ loss within ``tolerance`` (the default 1 %);
:func:`cut_pays` is the race's rule: the cut wins where τ_K / (t + o_K) > τ / (t + o), with t the
verification step and o, o_K the measured round overheads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

__all__ = ["VOCAB_CUT_NAME", "VocabCut", "cut_pays", "raceable_cut", "record_vocab_cut"]

VOCAB_CUT_NAME = "vocab_cut.json"
#: the τ a cut may lose and still be raced: 1 %
TOLERANCE = 0.01


def _positive(instance: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive number, got {value!r}")


@attrs.frozen
class VocabCut:
    """A measured cut: K, the two τ and where they were measured (``evidence``)."""

    draft_vocab: int = attrs.field(validator=_positive)
    tau_full: float = attrs.field(validator=_positive)
    tau_cut: float = attrs.field(validator=_positive)
    checkpoint_digest: str = attrs.field(validator=attrs.validators.instance_of(str))
    evidence: dict[str, Any] = attrs.field(factory=dict)

    @property
    def tau_ratio(self) -> float:
        """τ_K / τ: 1 − the relative τ loss."""
        return self.tau_cut / self.tau_full

    @property
    def reference(self) -> str:
        """How a user names this variant: ``:vocab=K``."""
        return f":vocab={self.draft_vocab}"


def _digest(folder: Path) -> str:
    from dspark.provenance import files_digest

    return files_digest(folder)  # leaves this file out (dspark.provenance)


def record_vocab_cut(folder: str | Path, eval_json: str | Path) -> Path:
    """Write ``folder/vocab_cut.json`` from a ``dspark eval`` of the folder's drafter and one
    ``:vocab=K`` variant of it at temperature 0 (``eval_json``: that eval's ``eval.json``). Refused in
    one sentence where the eval is of other weights, at another temperature or lacks either run."""
    from dspark.drafters.prune import parse_drafter_ref
    from dspark.evaluation.drafter_specs import split_label

    folder, eval_json = Path(folder), Path(eval_json)
    try:
        results = json.loads(eval_json.read_text())
        runs = results["runs"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{eval_json}: not a dspark eval result ({err})") from None
    digest = _digest(folder)
    full = cut = None
    for run in runs.values():
        prov = run.get("provenance", {})
        if prov.get("checkpoint_digest") != digest or float(run.get("temperature", -1)) != 0.0:
            continue
        k = parse_drafter_ref(split_label(prov["drafter"])[1])[1]
        if k is None:
            full = run
        elif cut is None:
            cut = (k, run)
    if full is None or cut is None:
        raise ValueError(f"{eval_json}: no pair of greedy (temperature 0) runs of {folder}'s drafter and a ':vocab=K' "
                         "variant of these weights; run dspark eval --drafter NAME --drafter NAME:vocab=K --temperature 0")
    k, run = cut
    prov = full["provenance"]
    evidence = {"temperature": 0.0, "prompts": prov.get("prompts"), "prompts_digest": prov.get("prompts_digest"),
                "prompts_count": results.get("prompts"), "model": prov.get("model"), "dtype": prov.get("dtype"),
                "max_new_tokens": prov.get("max_new_tokens"), "command": results.get("command"),
                "rounds": {"full": full["overall"].get("rounds"), "cut": run["overall"].get("rounds")}}
    data = {"draft_vocab": k, "tau_full": full["overall"]["tau"], "tau_cut": run["overall"]["tau"],
            "checkpoint_digest": digest, "evidence": evidence}
    VocabCut(**data)  # validated before anything is written
    path = folder / VOCAB_CUT_NAME
    tmp = path.with_name(f".{VOCAB_CUT_NAME}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def raceable_cut(folder: str | Path, tolerance: float = TOLERANCE) -> tuple[VocabCut | None, str]:
    """(the folder's recorded cut, "") where a race may try it, else (None, one sentence why not)."""
    path = Path(folder) / VOCAB_CUT_NAME
    if not path.is_file():
        return None, f"{Path(folder).name} records no measured vocabulary cut ({VOCAB_CUT_NAME})"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        cut = VocabCut(**data)
    except (ValueError, TypeError) as err:
        return None, f"{path} is not a vocabulary-cut record ({err})"
    if cut.checkpoint_digest != _digest(Path(folder)):
        return None, f"{path} was measured on other weights than {Path(folder).name} holds now"
    if cut.tau_ratio < 1 - tolerance:
        return None, (f"{cut.reference} lost {1 - cut.tau_ratio:.1%} of τ ({cut.tau_cut:.3f} vs {cut.tau_full:.3f}), "
                      f"more than {tolerance:.0%}")
    return cut, ""


def cut_pays(cut: VocabCut, verify_seconds: float, overhead_full: float, overhead_cut: float) -> bool:
    """Whether the cut drafts more tokens a second: τ_K / (t + o_K) > τ / (t + o), with t the
    verification step of a drafted round and o, o_K each variant's round overhead (seconds)."""
    return cut.tau_cut * (verify_seconds + overhead_full) > cut.tau_full * (verify_seconds + overhead_cut)
