"""The golden fixtures made by the reference implementations (DeepSpec, speculators).

``tests/fixtures/reference-drafters/`` is a verbatim copy of the project's shared fixtures; its
README defines every tensor and convention. Every file is checked against ``manifest.json``'s
sha256 when first read, so a modified or truncated fixture fails loudly instead of silently
changing what the tests compare against. The helpers below read every dimension (vocabulary,
hidden size, layer ids, block size, mask token, ...) from the set's own configs, so the tests
hold for a set regenerated with other seeds and shapes (``DSPARK_REFERENCE_FIXTURES`` names one).
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import cache
from pathlib import Path
from typing import Any

import torch

# DSPARK_REFERENCE_FIXTURES points the tests at another (e.g. regenerated) fixture set.
ROOT = Path(os.environ.get("DSPARK_REFERENCE_FIXTURES") or Path(__file__).parent / "fixtures" / "reference-drafters")
DEEPSPEC_BLOCK = ("deepspec-dspark-vanilla", "deepspec-dspark-gated", "deepspec-dspark-rnn", "deepspec-dflash")
SPECULATORS = ("speculators-dspark", "speculators-dflash", "speculators-eagle3")


@cache
def _manifest() -> dict[str, Any]:
    return json.loads((ROOT / "manifest.json").read_text())["files"]


def checked(relpath: str) -> Path:
    """The fixture file ``relpath``, after checking its sha256 against the manifest."""
    path = ROOT / relpath
    entry = _manifest().get(relpath)
    if entry is None:
        raise AssertionError(f"{relpath} is not listed in the fixture manifest")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != entry["sha256"]:
        raise AssertionError(f"fixture {relpath} does not match its manifest sha256 (modified or corrupt)")
    return path


@cache
def cases(name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, json) of fixture folder ``name``'s cases."""
    from safetensors.torch import load_file

    return load_file(str(checked(f"{name}/cases.safetensors"))), json.loads(checked(f"{name}/cases.json").read_text())


def folder(name: str) -> Path:
    """A checkpoint folder, its config and weights checked."""
    checked(f"{name}/config.json")
    checked(f"{name}/model.safetensors")
    return ROOT / name


@cache
def target_model() -> Any:
    """The fixture's tiny Qwen3 target (float32, eval, SDPA attention as the reference evaluator)."""
    from transformers import AutoModelForCausalLM

    for f in ("config.json", "generation_config.json", "model.safetensors"):
        checked(f"target/{f}")
    model = AutoModelForCausalLM.from_pretrained(
        str(ROOT / "target"), dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
    )
    return model.eval()


def target(capture_layers: tuple[int, ...] = ()) -> Any:
    """An :class:`~dspark.targets.HFTarget` over the fixture target."""
    from dspark.targets import HFTarget

    t = HFTarget(target_model(), capture_layers=capture_layers)
    t.name = "target"
    return t


# -- the fixture set's own dimensions ---------------------------------------------------------
# Tests read every size, id and expectation from here (or from cases.json / the tensors' shapes),
# never from the README's numbers: the set can be regenerated with other seeds and shapes.


@cache
def config(name: str) -> dict[str, Any]:
    """``name``/config.json (checked): a drafter's config, or the target's for ``"target"``."""
    return json.loads(checked(f"{name}/config.json").read_text())


def target_config() -> dict[str, Any]:
    """The fixture target's HF config.json."""
    return config("target")


def vocab_size() -> int:
    """The target's vocabulary V (the fixture drafters are full-vocabulary)."""
    return int(target_config()["vocab_size"])


def hidden_size() -> int:
    """The target's (and every draft layer's) hidden size d."""
    return int(target_config()["hidden_size"])


def num_target_layers() -> int:
    return int(target_config()["num_hidden_layers"])


def num_kv_heads() -> int:
    c = target_config()
    return int(c.get("num_key_value_heads") or c["num_attention_heads"])


def head_dim() -> int:
    c = target_config()
    return int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])


def layer_ids(name: str) -> tuple[int, ...]:
    """The DeepSpec target layer ids of drafter ``name`` (speculators stores them + 1)."""
    c = config(name)
    if "target_layer_ids" in c:
        return tuple(c["target_layer_ids"])
    aux = c.get("aux_hidden_state_layer_ids") or c["eagle_aux_hidden_state_layer_ids"]
    return tuple(i - 1 for i in aux)


def feature_width(name: str) -> int:
    """Width of the concatenated target features drafter ``name`` reads."""
    return len(layer_ids(name)) * hidden_size()


def block_size(name: str) -> int:
    """Drafts per round: ``block_size`` (DSpark / DFlash), ``ttt_length`` (DeepSpec Eagle3) or the
    speculators proposal's ``speculative_tokens`` (speculators Eagle3)."""
    c = config(name)
    if "block_size" in c:
        return int(c["block_size"])
    if "ttt_length" in c:
        return int(c["ttt_length"])
    return int(c["speculators_config"]["proposal_methods"][0]["speculative_tokens"])


def mask_token_id(name: str) -> int:
    """The token whose (frozen) embedding fills the block's mask slots of drafter ``name``."""
    return int(config(name)["mask_token_id"])


def draft_layers(name: str) -> int:
    c = config(name)
    return int(c.get("transformer_layer_config", c)["num_hidden_layers"])


def twin(name: str) -> str:
    """The DeepSpec folder whose tensors a speculators folder carries (``name`` itself for DeepSpec)."""
    meta = json.loads(checked(f"{name}/cases.json").read_text())
    return meta.get("weights_from", name)


def rounds(name: str) -> range:
    """The recorded inference rounds r of DeepSpec folder ``name`` (keys ``round_r/…``)."""
    return range(1, len(cases(name)[1]["inference"]["rounds"]) + 1)


def mask_token_ids() -> frozenset[int]:
    """Every mask token id of the fixture drafters (prompts never contain one)."""
    return frozenset(mask_token_id(n) for n in (*DEEPSPEC_BLOCK, "speculators-dspark", "speculators-dflash"))


def prompt_ids(n: int, generator: torch.Generator) -> torch.Tensor:
    """n seeded random token ids of the target's vocabulary, mask tokens excluded (as the
    fixtures' prompts). With the mask token the last id this is ``randint(0, V − 1)``."""
    allowed = torch.tensor([i for i in range(vocab_size()) if i not in mask_token_ids()])
    return allowed[torch.randint(0, allowed.numel(), (n,), generator=generator)]


def features(hidden_states: tuple[torch.Tensor, ...] | list[torch.Tensor], ids: tuple[int, ...]) -> torch.Tensor:
    """DeepSpec layer ids → transformers ``hidden_states`` (index L + 1), concatenated on the last axis."""
    return torch.cat([hidden_states[i + 1] for i in ids], -1)
