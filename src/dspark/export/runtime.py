"""Drafting with exported graphs: the backend-independent half of the ONNX Runtime and TensorRT
drafters.

The graphs compute; this module keeps what the PyTorch drafters keep in Python and does it the
same way, so that outputs match :class:`~dspark.drafters.neural.BlockDrafter` /
:class:`~dspark.drafters.eagle3.Eagle3Drafter` / :class:`~dspark.drafters.neural.Eagle3FusedDrafter`
step for step:

* per request, the context K/V of every draft layer (``[L, H_kv, capacity, hd]``, grown by
  doubling instead of concatenated every round);
* per round, the new context positions of *all* requests are packed into one ``context`` call
  (KV injection is per position), then the caches are right-padded into
  ``ctx_k/ctx_v [L, R, H_kv, P, hd]`` + ``ctx_mask [R, P]`` for the ``backbone`` (P ≥ 1: an empty
  context is one masked slot);
* the sequential head is stepped γ times (j = 1..γ, x̂_0 the anchor), and every x̂_j is drawn
  with :mod:`dspark.sampling` under the request's SamplingParams and generator;
* Eagle3: the fused feature of the last context position waits ("pending") for its next token, as
  in PyTorch; the K/V of a causal layer's context position need no past, so context ingestion is
  packed over requests too; the γ drafting steps write their K/V into preallocated slots after
  the padded context, masked until written, so the step graph sees one shape per round.

A backend supplies a :class:`GraphRunner`: ``run(graph, {input: tensor}) → {output: tensor}``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

import torch

from dspark.drafters.neural import draft_lengths, draft_sample, target_features
from dspark.drafters.vocab import DraftVocab, to_slots, to_target_space
from dspark.export.manifest import ExportError
from dspark.protocols.drafter import DraftContext
from dspark.types import DraftBlock

__all__ = ["GraphRunner", "ExportedDrafter"]


class GraphRunner(Protocol):
    """Runs one exported graph. Inputs are CPU or ``device`` tensors; outputs are on ``device``."""

    device: torch.device
    limits: dict[str, dict[str, int]]  # graph → axis name → largest size it accepts ({} = any)

    def run(self, graph: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


class _KVStore:
    """One request's context K/V: [L, H_kv, capacity, hd] each, valid up to ``length``."""

    __slots__ = ("k", "v", "length")

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:  # [L, H_kv, n, hd]
        n = k.shape[2]
        if n == 0:
            return
        need = self.length + n
        if self.k is None or need > self.k.shape[2]:
            cap = max(need, 2 * (self.k.shape[2] if self.k is not None else 0), 16)
            shape = (k.shape[0], k.shape[1], cap, k.shape[3])
            grown_k, grown_v = k.new_zeros(shape), v.new_zeros(shape)
            if self.k is not None and self.length:
                grown_k[:, :, : self.length] = self.k[:, :, : self.length]
                grown_v[:, :, : self.length] = self.v[:, :, : self.length]
            self.k, self.v = grown_k, grown_v
        self.k[:, :, self.length : need] = k
        self.v[:, :, self.length : need] = v
        self.length = need


class ExportedDrafter:
    """A :class:`dspark.protocols.Drafter` over the graphs of one export folder."""

    backend = "graphs"

    def __init__(self, manifest: dict[str, Any], runner: GraphRunner, root: str | Path | None = None) -> None:
        self.manifest = manifest
        self.runner = runner
        self.root = Path(root) if root is not None else None
        self.kind: str = manifest["kind"]
        self.name = self.kind
        self.gamma = int(manifest["gamma"])
        self.vocab_size = int(manifest["vocab_size"])
        self.target_layer_ids = tuple(int(i) for i in manifest["target_layer_ids"])
        self.hidden_size = int(manifest["hidden_size"])
        self.feature_size = len(self.target_layer_ids) * self.hidden_size
        self.num_layers = int(manifest["num_layers"])
        self.num_kv_heads = int(manifest["num_kv_heads"])
        self.head_dim = int(manifest["head_dim"])
        self.head = manifest.get("head")
        self.rank = int(manifest.get("rank") or 0)
        self.confidence = bool(manifest.get("confidence"))
        ids = manifest.get("draft_ids")
        self.vocab_map = DraftVocab(torch.tensor(ids), self.vocab_size) if ids else None
        self.device = runner.device
        self._caches: dict[str, _KVStore] = {}
        self._pending: dict[str, torch.Tensor | None] = {}  # Eagle3
        self.timings: dict[str, float] = {}

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
        self._caches.pop(request_id, None)
        self._pending.pop(request_id, None)

    @torch.inference_mode()
    def draft(self, context: DraftContext) -> DraftBlock:
        feats = self._new_features(context)
        if self.kind in ("eagle3", "eagle3-fused"):
            return self._draft_eagle3(context, feats)
        return self._draft_block(context, feats)

    # -- shared helpers ---------------------------------------------------------------------
    def _new_features(self, context: DraftContext) -> list[torch.Tensor]:
        feats = target_features(context, self.name, self.target_layer_ids, self.hidden_size)
        return [f.to(self.device, torch.float32) for f in feats]

    @staticmethod
    def _check_anchor(rid: str, cache: _KVStore, ids: torch.Tensor, lag: int) -> None:
        if cache.length != ids.numel() - lag:
            raise ValueError(
                f"request {rid!r}: the drafter has context for {cache.length} positions but the "
                f"anchor is at position {ids.numel() - 1}; pass the target features of every "
                "committed token before the anchor"
            )

    def _limit(self, graph: str, axis: str) -> int | None:
        return self.runner.limits.get(graph, {}).get(axis)

    def _check_limit(self, graph: str, axis: str, size: int) -> None:
        top = self._limit(graph, axis)
        if top is not None and size > top:
            raise ValueError(
                f"{graph} graph: {axis} = {size} exceeds the engine's optimisation profile (max {top}); "
                f"rebuild the engines with a larger --{axis} range"
            )

    def _gather(self, caches: list[_KVStore], L: int, extra: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-pad the caches → K, V [L, R, H_kv, P + extra, hd], mask [R, P + extra] (P ≥ 1 - extra)."""
        R = len(caches)
        P = max([c.length for c in caches] + [0])
        P = max(P, 1 - extra)
        shape = (L, R, self.num_kv_heads, P + extra, self.head_dim)
        K = torch.zeros(shape, device=self.device)
        Vv = torch.zeros(shape, device=self.device)
        mask = torch.zeros(R, P + extra, dtype=torch.bool, device=self.device)
        for r, c in enumerate(caches):
            if c.length:
                K[:, r, :, : c.length] = c.k[:, :, : c.length]
                Vv[:, r, :, : c.length] = c.v[:, :, : c.length]
                mask[r, : c.length] = True
        return K, Vv, mask

    def _sample(self, logits: torch.Tensor, context: DraftContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft-space logits [R, V_d] (any device) → (slots [R], tokens [R], q [R, V],
        logits [R, V]) on the CPU; V_d = V without a reduced draft vocabulary."""
        U = logits.float().cpu()
        q, x = draft_sample(U, context)
        return (x, *to_target_space(self.vocab_map, x, q, U))

    def _valid(self, context: DraftContext, R: int) -> torch.Tensor:
        return draft_lengths(context, R, self.gamma)

    def _run_packed(self, graph: str, inputs: dict[str, torch.Tensor], axis_dim: dict[str, int],
                    outputs: dict[str, int]) -> dict[str, torch.Tensor]:
        """Run a per-position graph over N packed positions, in chunks the engine accepts."""
        n = next(iter(inputs.values())).shape[axis_dim[next(iter(inputs))]]
        step = self._limit(graph, "new") or n
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in outputs}
        for s in range(0, n, step):
            chunk = {k: v.narrow(axis_dim[k], s, min(step, n - s)) for k, v in inputs.items()}
            out = self.runner.run(graph, chunk)
            for k in outputs:
                parts[k].append(out[k])
        return {k: torch.cat(v, dim=outputs[k]) if len(v) > 1 else v[0] for k, v in parts.items()}

    # -- DSpark / DFlash --------------------------------------------------------------------
    def _draft_block(self, context: DraftContext, feats: list[torch.Tensor]) -> DraftBlock:
        R = len(context.request_ids)
        self._check_limit("backbone", "batch", R)
        caches, chunks, positions, owners = [], [], [], []
        for rid, f in zip(context.request_ids, feats):
            cache = self._caches.setdefault(rid, _KVStore())
            caches.append(cache)
            if f.shape[0]:
                chunks.append(f)
                positions.append(torch.arange(cache.length, cache.length + f.shape[0]))
                owners.append((cache, f.shape[0]))
        t0 = time.perf_counter()
        if chunks:
            out = self._run_packed(
                "context", {"features": torch.cat(chunks), "positions": torch.cat(positions)},
                {"features": 0, "positions": 0}, {"ctx_k": 2, "ctx_v": 2})
            k, v, off = out["ctx_k"], out["ctx_v"], 0  # [L, H_kv, N, hd]
            for cache, n in owners:
                cache.append(k[:, :, off : off + n], v[:, :, off : off + n])
                off += n
        t_ingest = time.perf_counter() - t0
        for rid, ids, cache in zip(context.request_ids, context.token_ids, caches):
            self._check_anchor(rid, cache, ids, lag=1)
        anchors = torch.stack([ids[-1] for ids in context.token_ids]).long()  # [R]
        anchor_pos = torch.tensor([ids.numel() - 1 for ids in context.token_ids])  # [R]
        t0 = time.perf_counter()
        ctx_k, ctx_v, mask = self._gather(caches, self.num_layers)
        self._check_limit("backbone", "past", mask.shape[1])
        out = self.runner.run("backbone", {
            "anchor_ids": anchors, "positions": anchor_pos[:, None] + torch.arange(self.gamma)[None],
            "ctx_k": ctx_k, "ctx_v": ctx_v, "ctx_mask": mask})
        h, U = out["h"], out["base_logits"]  # [R, γ, d], [R, γ, V]
        t_head = 0.0
        tokens, qs, logits, conf = [], [], [], []
        prev = to_slots(self.vocab_map, anchors)
        state = torch.zeros(R, self.rank, device=self.device) if self.head == "rnn" else None
        for j in range(self.gamma):
            U_j = U[:, j]
            if self.head is not None:
                t1 = time.perf_counter()
                inputs = {"prev_ids": prev, "h_j": h[:, j].contiguous(), "base_logits_j": U_j.contiguous()}
                if state is not None:
                    inputs["state"] = state
                step = self.runner.run("head", inputs)
                U_j = step["logits"]
                if self.confidence:
                    conf.append(step["confidence_logit"].float().cpu())  # [R]
                if state is not None:
                    state = step["state_out"]
                t_head += time.perf_counter() - t1
            slot, x_j, q_j, U_full = self._sample(U_j, context)
            tokens.append(x_j)
            qs.append(q_j)
            logits.append(U_full)
            prev = slot
        self.timings = {"draft": time.perf_counter() - t0, "sequential_head": t_head, "ingest": t_ingest}
        return DraftBlock(
            tokens=torch.stack(tokens, 1),  # [R, γ]
            q=torch.stack(qs, 1),  # [R, γ, V]
            valid_lengths=self._valid(context, R),
            confidence_logits=torch.stack(conf, 1) if conf else None,  # [R, γ]
            draft_logits=torch.stack(logits, 1),  # [R, γ, V]
            hidden=h.float().cpu(),  # [R, γ, d]
        )

    # -- Eagle3 -----------------------------------------------------------------------------
    def _draft_eagle3(self, context: DraftContext, feats: list[torch.Tensor]) -> DraftBlock:
        R, d = len(context.request_ids), self.hidden_size
        self._check_limit("step", "batch", R)
        t0 = time.perf_counter()
        sizes = [f.shape[0] for f in feats]
        fused_all = None
        if sum(sizes):
            fused_all = self._run_packed("fuse", {"features": torch.cat(feats)}, {"features": 0}, {"fused": 0})["fused"]
        caches, last_feat, off = [], [], 0
        toks, ready, positions, owners = [], [], [], []
        for rid, ids, n in zip(context.request_ids, context.token_ids, sizes):
            cache = self._caches.setdefault(rid, _KVStore())
            caches.append(cache)
            fused = fused_all[off : off + n] if n else torch.zeros(0, d, device=self.device)
            off += n
            if self._pending.get(rid) is not None:
                fused = torch.cat([self._pending[rid], fused])
            if fused.shape[0] == 0:
                # A one-token prompt has no target feature yet: draft from a zero feature once.
                last_feat.append(torch.zeros(d, device=self.device))
                self._pending[rid] = None
                owners.append((rid, ids, cache, 0, None))
                continue
            # Positions t with both f_t and x_{t+1} committed go into the cache; the last feature
            # (t = a−1, paired with the anchor) is the first drafting step.
            n_ready = fused.shape[0] - 1
            if n_ready > 0:
                start = cache.length
                toks.append(ids[start + 1 : start + 1 + n_ready].long())
                ready.append(fused[:n_ready])
                positions.append(torch.arange(start, start + n_ready))
            self._pending[rid] = fused[-1:]
            last_feat.append(fused[-1])
            owners.append((rid, ids, cache, n_ready, fused))
        if toks:
            out = self._run_packed(
                "context", {"token_ids": torch.cat(toks), "feats": torch.cat(ready), "positions": torch.cat(positions)},
                {"token_ids": 0, "feats": 0, "positions": 0}, {"ctx_k": 2, "ctx_v": 2})
            k, v, off = out["ctx_k"], out["ctx_v"], 0  # [1, H_kv, N, hd]
            for _rid, _ids, cache, n_ready, _f in owners:
                if n_ready:
                    cache.append(k[:, :, off : off + n_ready], v[:, :, off : off + n_ready])
                    off += n_ready
        for rid, ids, cache, _n, fused in owners:
            if fused is not None:
                self._check_anchor(rid, cache, ids, lag=2)
        t_ingest = time.perf_counter() - t0
        t0 = time.perf_counter()
        P0 = max(c.length for c in caches)
        k_ctx, v_ctx, mask = self._gather(caches, 1, extra=self.gamma)  # [1, R, H_kv, P0 + γ, hd]
        self._check_limit("step", "past", mask.shape[1])
        feat = torch.stack(last_feat)  # [R, d]
        tok = torch.stack([ids[-1] for ids in context.token_ids]).long()  # [R] x_{t+1} = anchor
        pos = torch.tensor([ids.numel() - 2 for ids in context.token_ids])  # [R] t = a − 1
        tokens, qs, logits = [], [], []
        for j in range(self.gamma):
            out = self.runner.run("step", {
                "token_ids": tok[:, None], "feats": feat[:, None].contiguous(), "positions": pos[:, None],
                "ctx_k": k_ctx, "ctx_v": v_ctx, "ctx_mask": mask})
            slot = P0 + j
            k_ctx[:, :, :, slot] = out["k_new"][:, :, :, 0]
            v_ctx[:, :, :, slot] = out["v_new"][:, :, :, 0]
            mask[:, slot] = True
            U = out["logits"][:, 0]  # [R, V]
            _, x_next, q, U_full = self._sample(U, context)
            tokens.append(x_next)
            qs.append(q)
            logits.append(U_full)
            tok, feat, pos = x_next.to(self.device), out["out"][:, 0], pos + 1
        self.timings = {"draft": time.perf_counter() - t0, "sequential_head": 0.0, "ingest": t_ingest}
        return DraftBlock(
            tokens=torch.stack(tokens, 1),
            q=torch.stack(qs, 1),
            valid_lengths=self._valid(context, R),
            draft_logits=torch.stack(logits, 1),
        )


def require_kind(manifest: dict[str, Any]) -> None:
    if manifest.get("kind") not in ("dspark", "dflash", "eagle3", "eagle3-fused"):
        raise ExportError(f"manifest kind {manifest.get('kind')!r} is not an exported neural drafter")
