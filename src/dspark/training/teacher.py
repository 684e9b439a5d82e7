"""Target features and teacher distributions for training, online or from an on-disk cache.

For a token sequence x_0..x_{n−1} the teacher gives, at every position t:

* ``feats`` [n, m·d] — the target's hidden states after decoder layers ``layer_ids`` (what the
  engine hands a drafter at inference: ``hidden_states[k + 1]`` for layer k), concatenated;
* the teacher p_t (the target's distribution of x_{t+1}, T = 1), in one of two forms:

  - ``teacher="full"`` (the reference's, default): ``last_hidden`` [n, d] — the target's
    *final-normed* last hidden state z_t (HF ``hidden_states[-1]``; DeepSpec's
    ``target_last_hidden_states``). The training step turns it into the full-vocabulary
    p_t = softmax(W_lm z_t) with the target's LM head (``forward.teacher_at``): exact L1 / α, and
    d numbers per position to store instead of V. With it ``last_lse`` [n], the full-vocabulary
    log-normaliser log Σ_v exp(W_lm z_t), so that a step with a reduced draft vocabulary multiplies
    only the V_d draft rows of W_lm (same probabilities).
  - ``teacher="topk"``: ``top_ids`` / ``top_logp`` [n, k] — the target's k most likely next
    tokens and their log-probabilities. The L1 / α computed from it are bounds (α biased low).

Per sequence the teacher returns a :class:`TeacherRow` (feats, last_hidden, top_ids, top_logp)
with the unused pair None.

Online mode runs the target forward inside the training step (no cache, any data size: the
reference needs ~38 TB to cache this for its full runs). The cache (safetensors shards, fp16
features / hidden states) is for small runs where several drafters train on the same data: it is
built once, resumably, shard by shard. ``cache.json`` records the teacher form; a cache written
before the form was recorded is a top-k cache and keeps loading as one. It also records a digest of
each shard's token ids, so a cache grows with its data: when sequences are appended to the data
(or a cache of a prefix of the data is copied to a new folder), the leading shards whose sequences
are unchanged are kept and only the rest are computed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

__all__ = ["TEACHERS", "TeacherRow", "teacher_forward", "FeatureCache", "build_feature_cache"]

TEACHERS = ("full", "topk")


class TeacherRow(NamedTuple):
    feats: torch.Tensor  # [n, m·d] fp32
    last_hidden: torch.Tensor | None  # [n, d] fp32 (teacher "full")
    top_ids: torch.Tensor | None  # [n, k] int64 (teacher "topk")
    top_logp: torch.Tensor | None  # [n, k] fp32
    last_lse: torch.Tensor | None = None  # [n] fp32 (teacher "full"): log Σ_v exp(W_lm z_t), full vocabulary


@torch.no_grad()
def _lse(model: Any, z: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """log Σ_v exp(W_lm z) → [n] fp32, in chunks of positions (the [chunk, V] logits are the peak)."""
    W = model.get_output_embeddings().weight
    return torch.cat([torch.logsumexp((c.to(W.dtype) @ W.T).float(), dim=-1) for c in z.split(chunk)])


def _check_teacher(teacher: str, top_k: int | None) -> None:
    if teacher not in TEACHERS:
        raise ValueError(f"teacher must be one of {TEACHERS}, got {teacher!r}")
    if teacher == "topk" and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"the top-k teacher needs top_k >= 1, got {top_k!r}")


@torch.inference_mode()
def teacher_forward(
    model: Any, seqs: Sequence[Sequence[int]], layer_ids: Sequence[int], top_k: int | None = None,
    *, teacher: str = "full", store_half: bool = False,
) -> list[TeacherRow]:
    """One padded forward of the target over ``seqs`` → one :class:`TeacherRow` per sequence:
    feats [n, m·d] and, for ``teacher="full"``, the final-normed last hidden state [n, d]; for
    ``teacher="topk"``, the top-``top_k`` ids and log-probabilities [n, k]. ``store_half``: the
    hidden state will be stored in fp16, so its ``last_lse`` is computed from the rounded state."""
    _check_teacher(teacher, top_k)
    S = len(seqs)
    n_max = max(len(s) for s in seqs)
    ids = torch.zeros(S, n_max, dtype=torch.long)
    mask = torch.zeros(S, n_max, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(list(s))
        mask[i, : len(s)] = 1
    if teacher == "full":  # the LM head runs in the training step, on the positions it needs
        backbone = getattr(model, "base_model", model)  # HF: the decoder without the LM head
        out = backbone(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    else:
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    n_layers = len(hs) - 1
    bad = [k for k in layer_ids if not 0 <= k < n_layers]
    if bad:
        raise ValueError(f"target layer ids {bad} do not exist (the target has layers 0..{n_layers - 1})")
    feats = torch.cat([hs[k + 1] for k in layer_ids], dim=-1).float()  # [S, n, m·d]
    if teacher == "full":
        last = hs[-1].float()  # [S, n, d] after the final norm (= the backbone's last_hidden_state)
        rows = []
        for i, s in enumerate(seqs):
            z = last[i, : len(s)].clone()
            z_stored = z.half().float() if store_half else z  # the normaliser of what the step will read
            rows.append(TeacherRow(feats[i, : len(s)].clone(), z, None, None, _lse(model, z_stored)))
        return rows
    logp = torch.log_softmax(out.logits.float(), dim=-1)  # [S, n, V]
    top_logp, top_ids = logp.topk(top_k, dim=-1)  # [S, n, k]
    return [TeacherRow(feats[i, : len(s)].clone(), None, top_ids[i, : len(s)].clone(), top_logp[i, : len(s)].clone())
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
        self.teacher: str = self.meta.get("teacher", "topk")  # caches without the key are top-k caches
        if self.teacher not in TEACHERS:
            raise ValueError(f"{self.root}: unknown teacher form {self.teacher!r} in cache.json")
        self.top_k: int | None = int(self.meta["top_k"]) if self.teacher == "topk" else None
        keys = ("last_hidden",) if self.teacher == "full" else ("top_ids", "top_logp")
        self._rows: list[tuple[torch.Tensor, ...]] = []
        for shard in range(self.meta["complete_shards"]):
            path = self.root / f"shard-{shard:05d}.safetensors"
            try:
                t = load_file(str(path))
            except Exception as exc:
                raise ValueError(f"feature cache shard {path} is unreadable ({exc}); delete it and rebuild") from None
            has_lse = "last_lse" in t  # absent: the step normalises over the full vocabulary itself
            missing = [k for k in keys if k not in t]
            if missing:
                raise ValueError(f"feature cache shard {path} lacks {missing} for a {self.teacher!r} teacher; "
                                 "delete the cache and rebuild")
            off = t["offsets"].tolist()
            for a, b in zip(off[:-1], off[1:]):
                self._rows.append((t["feats"][a:b], *(t[k][a:b] for k in keys),
                                   t["last_lse"][a:b] if has_lse else None))

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, index: int, layer_ids: Sequence[int]) -> TeacherRow:
        """:class:`TeacherRow` with feats [n, m'·d] for ``layer_ids`` ⊆ cached ids (fp32), and the
        cached teacher (last_hidden fp32, or top_ids int64 / top_logp fp32)."""
        feats, *rest = self._rows[index]
        missing = [k for k in layer_ids if k not in self.layer_ids]
        if missing:
            raise ValueError(f"feature cache {self.root} holds layers {list(self.layer_ids)}, not {missing}")
        d = feats.shape[1] // len(self.layer_ids)
        cols = [feats[:, self.layer_ids.index(k) * d : (self.layer_ids.index(k) + 1) * d] for k in layer_ids]
        f = torch.cat(cols, dim=1).float()
        if self.teacher == "full":
            return TeacherRow(f, rest[0].float(), None, None, None if rest[1] is None else rest[1].float())
        return TeacherRow(f, None, rest[0].long(), rest[1].float())


def _shard_digest(seqs: Sequence[Sequence[int]]) -> str:
    """sha256 of a shard's sequences (each: its length, then its ids as int64)."""
    import numpy as np

    h = hashlib.sha256()
    for s in seqs:
        h.update(np.asarray([len(s), *s], dtype=np.int64).tobytes())
    return h.hexdigest()


def _legacy_digests(root: Path, meta: dict[str, Any], seqs: Sequence[Sequence[int]], shard_size: int) -> list[str]:
    """Digests for the complete shards of a cache written before digests were recorded, for the
    leading shards whose stored sequence lengths (the shard's offsets) equal those of ``seqs``,
    and only when the cache's sequence and token counts are those of a prefix of ``seqs``."""
    from safetensors import safe_open

    n0, done = int(meta["num_sequences"]), int(meta["complete_shards"])
    if n0 > len(seqs) or int(meta["tokens"]) != sum(len(s) for s in seqs[:n0]):
        return []
    out = []
    for shard in range(done):
        lo, hi = shard * shard_size, min(n0, (shard + 1) * shard_size)
        with safe_open(str(root / f"shard-{shard:05d}.safetensors"), "pt") as f:
            lengths = f.get_tensor("offsets").diff().tolist()
        if lengths != [len(s) for s in seqs[lo:hi]]:
            break
        out.append(_shard_digest(seqs[lo:hi]))
    return out


def build_feature_cache(
    model: Any,
    seqs: Sequence[Sequence[int]],
    root: str | Path,
    layer_ids: Sequence[int],
    top_k: int | None = 32,
    batch_size: int = 8,
    shard_size: int = 256,
    progress: bool = True,
    *,
    teacher: str = "full",
) -> FeatureCache:
    """Run the teacher over ``seqs`` and write shards of ``shard_size`` sequences; an interrupted
    build resumes at the first incomplete shard. Sequences are processed longest-first within a
    shard (less padding). ``top_k`` is used (and recorded) only for ``teacher="topk"``.

    A cache of other sequences with the same settings keeps its leading shards whose sequences
    are unchanged (appended data: all shards but a partial last one) and recomputes the rest; one
    sharing no shard with ``seqs`` is refused rather than overwritten. A shard is written to a
    temporary file and renamed, so an interruption never leaves a torn shard (and a cache whose
    files are hard links to another's never changes the other)."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    _check_teacher(teacher, top_k)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    meta_path = root / "cache.json"
    from dspark.models import model_identity

    target = model_identity(model)  # features of one target must never serve another of its shape
    settings = {"layer_ids": list(layer_ids), "teacher": teacher, "top_k": top_k if teacher == "topk" else None,
                "shard_size": shard_size, "target": target}
    n_shards = (len(seqs) + shard_size - 1) // shard_size
    digests = [_shard_digest(seqs[i * shard_size : (i + 1) * shard_size]) for i in range(n_shards)]
    done = 0
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        meta.setdefault("teacher", "topk")  # written before the teacher form was recorded
        if meta["teacher"] != teacher:
            raise ValueError(f"{root} holds a feature cache for the {meta['teacher']!r} teacher, not {teacher!r}; "
                             "use another folder (--feature-cache) or --teacher " + meta["teacher"])
        if meta.get("target") != target:
            was = meta.get("target") or {"name": "an unrecorded target"}
            raise ValueError(f"{root} holds features of another target ({was.get('name')}, {was.get('dtype', '?')}, "
                             f"weights {str(was.get('digest', '?'))[:12]}) than {target['name']} ({target['dtype']}, "
                             f"weights {target['digest'][:12]}); use another folder (--feature-cache)")
        if {k: meta.get(k) for k in settings} != settings:
            raise ValueError(f"{root} holds a feature cache for other data or settings; use another folder")
        stored = meta.get("shard_digests")
        if stored is None:  # written before digests were recorded
            stored = _legacy_digests(root, meta, seqs, shard_size)
        stored = stored[: int(meta["complete_shards"])]
        done = next((i for i, (a, b) in enumerate(zip(stored, digests)) if a != b), min(len(stored), n_shards))
        if done == 0 and int(meta["complete_shards"]) > 0:
            raise ValueError(f"{root} holds a feature cache for other data or settings (no shard of it holds "
                             "these sequences); use another folder")
        if done < int(meta["complete_shards"]) and progress:
            print(f"{root}: keeping {done} of {meta['complete_shards']} cached shards; computing from sequence "
                  f"{done * shard_size} on (the sequences there were appended to or changed)", file=sys.stderr)

    def write_meta(complete: int) -> None:
        meta = {**settings, "num_sequences": len(seqs), "tokens": sum(len(s) for s in seqs),
                "complete_shards": complete, "shard_digests": digests[:complete]}
        tmp = meta_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(meta) + "\n")
        os.replace(tmp, meta_path)

    write_meta(done)
    with tqdm(total=len(seqs), initial=min(done * shard_size, len(seqs)), desc="teacher features",
              unit="seq", disable=not progress) as bar:
        for shard in range(done, n_shards):
            chunk = list(range(shard * shard_size, min(len(seqs), (shard + 1) * shard_size)))
            order = sorted(chunk, key=lambda i: -len(seqs[i]))
            rows: dict[int, TeacherRow] = {}
            for b in range(0, len(order), batch_size):
                idx = order[b : b + batch_size]
                for i, r in zip(idx, teacher_forward(model, [seqs[i] for i in idx], layer_ids, top_k, teacher=teacher,
                                                     store_half=True)):
                    rows[i] = r
                bar.update(len(idx))
            tensors = {"feats": torch.cat([rows[i].feats for i in chunk]).half().contiguous(),
                       "offsets": torch.tensor([0] + [len(seqs[i]) for i in chunk]).cumsum(0)}
            if teacher == "full":
                tensors["last_hidden"] = torch.cat([rows[i].last_hidden for i in chunk]).half().contiguous()
                tensors["last_lse"] = torch.cat([rows[i].last_lse for i in chunk]).float().contiguous()
            else:
                tensors["top_ids"] = torch.cat([rows[i].top_ids for i in chunk]).int().contiguous()
                tensors["top_logp"] = torch.cat([rows[i].top_logp for i in chunk]).half().contiguous()
            path = root / f"shard-{shard:05d}.safetensors"
            save_file(tensors, str(path.with_suffix(".tmp")))
            os.replace(path.with_suffix(".tmp"), path)
            write_meta(shard + 1)
    return FeatureCache(root)
