"""A synthetic speculative-decoding world for statistical losslessness tests.

Target and drafter are Markov chains over a small vocabulary: p(·|prev) and q(·|prev) come from
logit tables [V, V] through the request's sampling params, and the raw confidence at draft
position j is a table lookup on x̂_{j-1} — so confidence depends on earlier draft tokens exactly as
a real confidence head does (the case that separates stopping rules from look-ahead schedules).
Each trial is one request generating ``n_tokens`` tokens from a start token; trials run as
requests in groups of ``group`` per scheduler call.
"""

from __future__ import annotations

import numpy as np
import torch

from dspark.sampling import probs_from_logits, sample
from dspark.types import SamplingParams
from dspark.verify import verify


def markov_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[V, V] logit table → [V, V] rows p(·|prev) under the sampling params."""
    V = logits.shape[0]
    return probs_from_logits(logits, torch.full((V,), params.temperature), params.top_k, params.top_p)


def simulate(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    conf_logits: torch.Tensor,
    params: SamplingParams,
    scheduler,
    cost_model,
    *,
    n_trials: int,
    n_tokens: int,
    gamma: int,
    group: int = 4,
    start: int = 0,
    seed: int = 0,
    greedy_draft_bug: bool = False,
) -> tuple[torch.Tensor, dict]:
    """Generated tokens [n_trials, n_tokens] and stats (mean τ, mean ℓ).

    ``greedy_draft_bug`` reproduces a known mistake (drafts taken greedily while q claims they were
    sampled) so tests can show the χ² harness has the power to catch it.
    """
    g = torch.Generator().manual_seed(seed)
    P = markov_probs(target_logits, params)  # [V, V]
    Q = markov_probs(draft_logits, params)  # [V, V]
    out = torch.full((n_trials, n_tokens), -1, dtype=torch.long)
    count = torch.zeros(n_trials, dtype=torch.long)
    last = torch.full((n_trials,), start, dtype=torch.long)
    taus, ells = [], []
    while bool((count < n_tokens).any()):
        live = (count < n_tokens).nonzero().squeeze(1)  # [R]
        R = live.numel()
        prev = last[live]  # [R] anchors
        drafts, qs, confs = [], [], []
        for _ in range(gamma):
            confs.append(conf_logits[prev])
            q_j = Q[prev]  # [R, V]
            # The public DFlash bug: draft greedily while verifying as if sampled from q.
            x_j = q_j.argmax(-1) if greedy_draft_bug else sample(q_j, g)  # [R]
            drafts.append(x_j)
            qs.append(q_j)
            prev = x_j
        draft = torch.stack(drafts, 1)  # [R, γ]
        q = torch.stack(qs, 1)  # [R, γ, V]
        ctx = torch.cat([last[live, None], draft], 1)  # [R, γ+1] token before each position
        p = P[ctx]  # [R, γ+1, V]
        c = torch.sigmoid(torch.stack(confs, 1))  # [R, γ]
        lengths = torch.cat(
            [scheduler.schedule(c[i : i + group], cost_model=cost_model).lengths for i in range(0, R, group)]
        )
        res = verify(draft, q, p, lengths, g)
        taus.append(res.num_committed.float())
        ells.append(lengths.float())
        for i, r in enumerate(live.tolist()):
            toks = res.committed[i, : int(res.num_committed[i])].tolist()
            room = n_tokens - int(count[r])
            toks = toks[:room]
            out[r, count[r] : count[r] + len(toks)] = torch.tensor(toks)
            count[r] += len(toks)
            last[r] = toks[-1]
    return out, {"tau": float(torch.cat(taus).mean()), "ell": float(torch.cat(ells).mean())}


def exact_joint(target_logits: torch.Tensor, params: SamplingParams, n_tokens: int, start: int = 0) -> np.ndarray:
    """Exact probability of every n-token sequence under plain target sampling. [V**n]."""
    P = markov_probs(target_logits, params).double()  # [V, V]
    V = P.shape[0]
    joint = P[start]  # [V]
    for _ in range(n_tokens - 1):
        joint = (joint[:, None] * P[torch.arange(joint.numel()) % V]).reshape(-1)
    return joint.numpy()
