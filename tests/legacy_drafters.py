"""Legacy-layout drafters for the loader tests, materialised from a few kilobytes.

The drafters once shipped in pre-reference layouts (1-layer DSpark with vanilla / gated / RNN heads,
the learned-mask DFlash, the fused Eagle3) left the tree; git history keeps their trained weights
(data/smollm2-135m/README.md says how to get one back). What the loaders must keep reading is their
*layout*: the config, the calibration file and every tensor's name, shape and dtype, stored in
tests/fixtures/legacy-drafters/<name>/. :func:`materialize` writes such a folder with seeded random
weights of exactly that layout, so loading, running and refusing them is covered without the weights.
Random weights are accepted rarely, which is why the greedy-identity tests only require acceptance
from trained drafters.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "legacy-drafters"
NAMES = ("dspark-vanilla", "dspark-gated", "dspark-rnn",  # 4,096-token draft vocabulary; the three heads
         "dflash-legacy", "eagle3-fused-legacy")  # the legacy layouts shipped as dflash / eagle3 before
DTYPES = {"F16": torch.float16, "F32": torch.float32, "BF16": torch.bfloat16, "I8": torch.int8, "I64": torch.int64}


def _tensor(name: str, shape: list[int], dtype: str, gen: torch.Generator) -> torch.Tensor:
    if dtype == "I64":  # the draft vocabulary's token ids: the one ranking every legacy drafter shared
        ids = torch.tensor(json.loads((FIXTURES / "draft_ids.json").read_text()), dtype=torch.int64)
        assert list(ids.shape) == shape, f"{name}: draft_ids.json holds {list(ids.shape)}, the layout {shape}"
        return ids
    if dtype == "I8":  # int8 weights; their scales are the F16 "*.int8_scale" tensors
        return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int64).to(torch.int8)
    if name.endswith("int8_scale"):
        return torch.full(shape, 0.02 / 127).to(DTYPES[dtype])
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=DTYPES[dtype])
    return (0.02 * torch.randn(shape, generator=gen)).to(DTYPES[dtype])


def materialize(name: str, dest: Path, seed: int = 0) -> Path:
    """Write legacy drafter ``name`` (one of :data:`NAMES`) to ``dest`` with random weights; return ``dest``."""
    src = FIXTURES / name
    layout = json.loads((src / "tensors.json").read_text())
    gen = torch.Generator().manual_seed(seed)
    weights = {k: _tensor(k, t["shape"], t["dtype"], gen) for k, t in sorted(layout["tensors"].items())}
    dest.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "calibration.json"):
        if (src / f).exists():
            shutil.copy(src / f, dest / f)
    save_file(weights, str(dest / "model.safetensors"), metadata=layout["metadata"])
    return dest
