"""Target features and teacher distributions for training, online or from an on-disk cache.

For a token sequence x_0..x_{n−1} the teacher gives, at every position t:

* ``feats`` [n, m·d] — the target's hidden states after decoder layers ``layer_ids`` (what the
  engine hands a drafter at inference: ``hidden_states[k + 1]`` for layer k), concatenated;
* ``top_ids`` / ``top_logp`` [n, k] — the target's k most likely next tokens x_{t+1} and their
  log-probabilities (T = 1), a top-k summary of p_t for the L1 / overlap losses.

Online mode runs the target forward inside the training step (no cache, any data size: the
reference needs ~38 TB to cache this for its full runs). The cache (safetensors shards, fp16
features) is for small runs where several drafters train on the same data: it is built once,
resumably, shard by shard.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["teacher_forward", "FeatureCache", "build_feature_cache"]


@torch.inference_mode()
def teacher_forward(
    model: Any, seqs: Sequence[Sequence[int]], layer_ids: Sequence[int], top_k: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One padded forward of the target over ``seqs``: per sequence (feats [n, m·d] fp32,
    top_ids [n, k] int64, top_logp [n, k] fp32)."""
    S = len(seqs)
    n_max = max(len(s) for s in seqs)
    ids = torch.zeros(S, n_max, dtype=torch.long)
    mask = torch.zeros(S, n_max, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(list(s))
        mask[i, : len(s)] = 1
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    n_layers = len(hs) - 1
    bad = [k for k in layer_ids if not 0 <= k < n_layers]
    if bad:
        raise ValueError(f"target layer ids {bad} do not exist (the target has layers 0..{n_layers - 1})")
    feats = torch.cat([hs[k + 1] for k in layer_ids], dim=-1).float()  # [S, n, m·d]
    logp = torch.log_softmax(out.logits.float(), dim=-1)  # [S, n, V]
    top_logp, top_ids = logp.topk(top_k, dim=-1)  # [S, n, k]
    return [(feats[i, : len(s)].clone(), top_ids[i, : len(s)].clone(), top_logp[i, : len(s)].clone())
            for i, s in enumerate(seqs)]


class FeatureCache:
    """Cached teacher outputs for a list of sequences (loaded fully into memory)."""

    def __init__(self, root: str | Path) -> None:
        from safetensors.torch import load_file

        self.root = Path(root)
        meta_path = self.root / "cache.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"{self.root} is not a feature cache (no cache.json)")
        self.meta = json.loads(meta_path.read_text())
        self.layer_ids: tuple[int, ...] = tuple(self.meta["layer_ids"])
        self.top_k: int = int(self.meta["top_k"])
        self._rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for shard in range(self.meta["complete_shards"]):
            path = self.root / f"shard-{shard:05d}.safetensors"
            try:
                t = load_file(str(path))
            except Exception as exc:
                raise ValueError(f"feature cache shard {path} is unreadable ({exc}); delete it and rebuild") from None
            off = t["offsets"].tolist()
            for a, b in zip(off[:-1], off[1:]):
                self._rows.append((t["feats"][a:b], t["top_ids"][a:b], t["top_logp"][a:b]))

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, index: int, layer_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(feats [n, m'·d] for ``layer_ids`` ⊆ cached ids, top_ids [n, k], top_logp [n, k]), fp32/int64."""
        feats, ids, logp = self._rows[index]
        missing = [k for k in layer_ids if k not in self.layer_ids]
        if missing:
            raise ValueError(f"feature cache {self.root} holds layers {list(self.layer_ids)}, not {missing}")
        d = feats.shape[1] // len(self.layer_ids)
        cols = [feats[:, self.layer_ids.index(k) * d : (self.layer_ids.index(k) + 1) * d] for k in layer_ids]
        return torch.cat(cols, dim=1).float(), ids.long(), logp.float()


def build_feature_cache(
    model: Any,
    seqs: Sequence[Sequence[int]],
    root: str | Path,
    layer_ids: Sequence[int],
    top_k: int = 32,
    batch_size: int = 8,
    shard_size: int = 256,
    progress: bool = True,
) -> FeatureCache:
    """Run the teacher over ``seqs`` and write shards of ``shard_size`` sequences; an interrupted
    build resumes at the first incomplete shard. Sequences are processed longest-first within a
    shard (less padding)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    meta_path = root / "cache.json"
    fingerprint = {"layer_ids": list(layer_ids), "top_k": top_k, "num_sequences": len(seqs),
                   "shard_size": shard_size, "tokens": sum(len(s) for s in seqs)}
    done = 0
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if {k: meta.get(k) for k in fingerprint} != fingerprint:
            raise ValueError(f"{root} holds a feature cache for other data or settings; use another folder")
        done = int(meta["complete_shards"])
    n_shards = (len(seqs) + shard_size - 1) // shard_size
    with tqdm(total=len(seqs), initial=min(done * shard_size, len(seqs)), desc="teacher features",
              unit="seq", disable=not progress) as bar:
        for shard in range(done, n_shards):
            chunk = list(range(shard * shard_size, min(len(seqs), (shard + 1) * shard_size)))
            order = sorted(chunk, key=lambda i: -len(seqs[i]))
            rows: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
            for b in range(0, len(order), batch_size):
                idx = order[b : b + batch_size]
                for i, r in zip(idx, teacher_forward(model, [seqs[i] for i in idx], layer_ids, top_k)):
                    rows[i] = r
                bar.update(len(idx))
            feats = torch.cat([rows[i][0] for i in chunk]).half()
            offsets = torch.tensor([0] + [len(seqs[i]) for i in chunk]).cumsum(0)
            save_file({"feats": feats.contiguous(),
                       "top_ids": torch.cat([rows[i][1] for i in chunk]).int().contiguous(),
                       "top_logp": torch.cat([rows[i][2] for i in chunk]).half().contiguous(),
                       "offsets": offsets}, str(root / f"shard-{shard:05d}.safetensors"))
            meta_path.write_text(json.dumps({**fingerprint, "complete_shards": shard + 1}) + "\n")
    return FeatureCache(root)
