"""The batched speculative engine with continuous batching.

Every ``step()`` runs one round for all active requests (docs/serving-and-benchmarks.md, docs/concepts.md §4–6):

    draft → confidence → calibrate → schedule (cost model) → verify (one batched target forward)
    → commit / roll back target and draft caches → per-request metrics.

Requests join (``add_request``) and leave (finish, ``abort``) between steps. The engine knows
nothing about tokenizers beyond the optional prompt/chat encoding helpers at the edge; all parts
are protocols resolved by name through the plugin registry.
"""

from __future__ import annotations

import itertools
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from attrs import define, field, frozen

from dspark.cost_models.context import ContextBinding
from dspark.fast.linear import route_linears
from dspark.plugins import resolve
from dspark.protocols import DraftContext
from dspark.round import speculative_round
from dspark.types import SamplingParams

__all__ = ["Engine", "encode_prompt", "RequestMetrics", "RoundInfo", "StepOutput", "Completion"]


@define
class RequestMetrics:
    rounds: int = 0
    proposed: list[int] = field(factory=list)  # valid draft length per round
    verified: list[int] = field(factory=list)  # ℓ per round
    accepted: list[int] = field(factory=list)  # accepted drafts per round
    confidence: list[list[float]] = field(factory=list)  # raw confidence logits [γ] per round

    @property
    def tau(self) -> float:
        """Mean committed tokens per round."""
        return (sum(self.accepted) + self.rounds) / max(self.rounds, 1)

    def accepted_per_position(self, gamma: int) -> list[int]:
        """How many rounds accepted position j (1-based), j = 1..γ."""
        return [sum(a >= j for a in self.accepted) for j in range(1, gamma + 1)]

    def to_dict(self) -> dict[str, Any]:
        n = max(self.rounds, 1)
        return {"rounds": self.rounds, "tau": self.tau, "mean_proposed": sum(self.proposed) / n,
                "mean_verified": sum(self.verified) / n, "accepted": sum(self.accepted)}


@define
class _Request:
    rid: str
    tokens: torch.Tensor  # [n] committed ids (prompt + output)
    prompt_len: int
    sampling: SamplingParams
    max_new_tokens: int
    stop_ids: frozenset[int]
    generator: torch.Generator
    # Target features [n, m·d] of committed positions the drafter has not seen yet, in order (one
    # chunk per round; several after rounds the draft gate skipped, joined when drafting), the
    # first row at position feature_start. Rounds run without capture leave a gap: the features
    # are dropped and the next captured ones restart the drafter's context (DraftingLoop.cache_for).
    features: list[torch.Tensor] = field(factory=list)
    feature_start: int = 0
    finished: str | None = None  # "length" | "stop" | "abort"
    metrics: RequestMetrics = field(factory=RequestMetrics)

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :].tolist()


@frozen
class RoundInfo:
    """What the last ``step()`` did, for benchmarks and simulators (lists are per active request)."""

    num_requests: int
    lengths: list[int]  # ℓ_r verified
    accepted: list[int]  # accepted drafts
    batch_size: int  # B under the cost model's accounting (padded count without a cost model)
    drafted: bool  # False: plain decoding (no drafter, or the draft gate skipped it)
    expected_tokens: float  # the scheduler's τ̂ (R on plain rounds)
    draft_seconds: float  # drafter + confidence + calibration + schedule
    target_seconds: float
    seconds: float
    context: float = 0.0  # mean KV context per request the round verified over (tokens)


@frozen
class StepOutput:
    request_id: str
    new_tokens: list[int]
    finished: str | None


@frozen
class Completion:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str | None
    finish_reason: str
    metrics: dict[str, Any]
    rounds: RequestMetrics | None = None  # per-round proposed/verified/accepted/confidence


def encode_prompt(tokenizer: Any, prompt: str | Sequence[dict] | Sequence[int] | torch.Tensor,
                  chat: bool = True) -> torch.Tensor:
    """Token ids for a prompt: ids pass through; text and chat messages use the tokenizer
    (text is wrapped as one user turn of the chat template when ``chat`` and one exists)."""
    if isinstance(prompt, torch.Tensor):
        return prompt.long().reshape(-1)
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return torch.tensor(list(prompt), dtype=torch.long)
    tok = tokenizer
    if tok is None:
        raise ValueError("text prompts need a target with a tokenizer; pass token ids instead")
    if isinstance(prompt, str) and not (chat and getattr(tok, "chat_template", None)):
        return torch.tensor(tok(prompt)["input_ids"], dtype=torch.long)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return torch.tensor(enc["input_ids"], dtype=torch.long)


class Engine:
    """Speculative decoding over a target with a drafter, scheduler, cost model and calibrator.

    ``drafter=None`` is plain decoding through the same batched target (the baseline).
    ``draft_gate`` (``True`` or a :class:`dspark.gating.DraftGate`) skips the drafter in rounds where
    the measured rates say drafting does not pay for itself (needs a cost model).
    ``clock`` is the seconds counter every timing reads (default ``time.perf_counter``); tests
    substitute a virtual one to run a machine whose step times are known.
    ``confidence_model`` ``None`` (the default): the drafter's own (a checkpoint folder's
    ``confidence.json``, :func:`dspark.confidence.load_confidence_model`), else ``draft-head``.
    """

    def __init__(
        self,
        target: Any,
        drafter: Any = None,
        *,
        scheduler: Any = "sps-greedy",
        cost_model: Any = "sps-table",
        calibrator: Any = "identity",
        confidence_model: Any = None,
        draft_gate: Any = None,
        seed: int = 0,
        clock: Callable[[], float] = time.perf_counter,
        capture_ahead: int = 64,
    ) -> None:
        if not isinstance(capture_ahead, int) or capture_ahead < 1:
            raise ValueError(f"capture_ahead must be an integer >= 1, got {capture_ahead!r}")
        self.target = target
        self.drafter = resolve("drafters", drafter) if drafter is not None else None
        if isinstance(self.drafter, torch.nn.Module):  # bf16 on a CPU: its linears packed once (dspark.fast.linear)
            route_linears(self.drafter)
        self.scheduler = resolve("schedulers", scheduler)
        self.cost_model = resolve("cost_models", cost_model) if cost_model is not None else None
        self._cost_model_at = ContextBinding(self.cost_model)  # read at each round's KV context
        self.calibrator = resolve("calibrators", calibrator)
        if confidence_model is None:
            confidence_model = getattr(self.drafter, "confidence_model", None) or "draft-head"
        self.confidence_model = resolve("confidence_models", confidence_model)
        if getattr(self.confidence_model, "calibrated", False) and getattr(self.calibrator, "name", "") != "identity":
            raise ValueError(
                f"confidence model {self.confidence_model.name!r} gives calibrated logits already; calibrator "
                f"{self.calibrator.name!r} would calibrate them twice (pass calibrator='identity', or "
                "confidence_model='draft-head' to calibrate the head's logits)")
        if not getattr(self.scheduler, "lossless", False):
            raise ValueError(
                f"scheduler {self.scheduler.name!r} is not lossless; the engine only runs schedules "
                "that preserve the target's distribution"
            )
        if self.drafter is not None:
            if self.drafter.vocab_size != target.vocab_size:
                raise ValueError(
                    f"drafter vocab size {self.drafter.vocab_size} ≠ target vocab size {target.vocab_size}"
                )
            if self.drafter.target_layer_ids:
                target.set_capture_layers(self.drafter.target_layer_ids)
        # With a draft gate, target features are captured only while a drafted round is at most
        # capture_ahead rounds away: a long skip then costs no capture and no catch-up, and the
        # drafter restarts its context where the features resume (lossless; drafts see less context).
        self.capture_ahead = capture_ahead
        self._capturing = bool(self.drafter is not None and self.drafter.target_layer_ids)
        if draft_gate is True:
            from dspark.gating import DraftGate

            draft_gate = DraftGate()
        if draft_gate and self.cost_model is None:
            raise ValueError("draft_gate needs a cost model to compare drafting with plain decoding")
        self.draft_gate = draft_gate or None
        self.last_round: RoundInfo | None = None
        self.seed = seed
        self.clock = clock
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        # Seconds per part, summed over rounds: draft (drafter.draft, of which sequential_head),
        # target (the verification forward), and round (the whole step).
        self.timings: dict[str, float] = {"draft": 0.0, "sequential_head": 0.0, "target": 0.0, "round": 0.0}
        self.rounds = 0

    # -- requests -------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[dict] | Sequence[int] | torch.Tensor, chat: bool = True) -> torch.Tensor:
        """Token ids for a prompt (see :func:`encode_prompt`) with the target's tokenizer."""
        return encode_prompt(self.target.tokenizer, prompt, chat)

    def add_request(
        self,
        prompt: Any,
        sampling: SamplingParams | None = None,
        max_new_tokens: int = 128,
        stop: Sequence[int] | None = None,
        request_id: str | None = None,
        chat: bool = True,
        seed: int | None = None,
    ) -> str:
        """Queue a request; it joins the batch at the next ``step()``. ``seed``: the request's own
        sampling seed (a server's per-request ``seed``); None derives it from the engine's seed and
        the request id."""
        sampling = sampling or SamplingParams.greedy()
        if not isinstance(sampling, SamplingParams):
            raise TypeError("sampling must be a dspark.SamplingParams")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        ids = self.encode(prompt, chat=chat)
        if ids.numel() == 0:
            raise ValueError(f"request {rid!r}: the prompt is empty")
        if ids.numel() >= self.target.max_context:
            raise ValueError(
                f"request {rid!r}: the prompt has {ids.numel()} tokens; the target's context window "
                f"is {self.target.max_context} (room is needed for at least one new token)"
            )
        stops = set(stop or ())
        eos = getattr(self.target.tokenizer, "eos_token_id", None)
        if eos is not None:
            stops.add(int(eos))
        self._capture(self._features_wanted())
        out = self.target.prefill([rid], [ids], logits=False)  # only the cache and features are used
        if seed is None:
            seed = self.seed * 1_000_003 + zlib.crc32(rid.encode())
        req = _Request(rid, ids, ids.numel(), sampling, max_new_tokens, frozenset(stops),
                       torch.Generator().manual_seed(int(seed)))
        feats = self._features(out)
        req.features = [feats[0, : int(out.lengths[0])]] if feats is not None else []
        self._requests[rid] = req
        return rid

    def abort(self, request_id: str) -> None:
        """Stop a request and free its caches. A request that already finished is left as it is
        (its completion stays collectable with ``pop_finished``); an unknown id is an error."""
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request id {request_id!r} (never added, or already collected)")
        if req.finished is not None:
            return
        req.finished = "abort"
        self._release(request_id)

    def _release(self, rid: str, missing_ok: bool = False) -> None:
        """Free a request's state in the target and the drafter (``missing_ok``: a part that never
        saw it is no error, as after a failure before its prefill)."""
        for part in (self.target, self.drafter):
            if part is None:
                continue
            try:
                part.release(rid)
            except KeyError:
                if not missing_ok:
                    raise

    @property
    def active(self) -> list[str]:
        """The requests still running (finished ones awaiting ``pop_finished`` are not), so that
        ``while engine.active: engine.step()`` ends."""
        return [rid for rid, r in self._requests.items() if r.finished is None]

    def _features(self, out: Any) -> torch.Tensor | None:
        """The captured hidden states of every output row, concatenated over the drafter's layers:
        [R, q, m·d] (one copy per round; each request keeps a view of its row), or None."""
        hs = out.hidden_states
        if not hs:
            return None
        ids = self.drafter.target_layer_ids if self.drafter is not None else ()
        return torch.cat([hs[i] for i in ids], dim=-1) if ids else None

    def _features_wanted(self) -> bool:
        """Capture target features this round: a drafter needs them, and (with a draft gate) a
        drafted round is at most ``capture_ahead`` rounds away."""
        if self.drafter is None or not self.drafter.target_layer_ids:
            return False
        return self.draft_gate is None or self.draft_gate.features_needed(self.capture_ahead)

    def _capture(self, on: bool) -> None:
        """Have the target capture the drafter's layers (``on``) or none before its next forward.
        Engines may share a target (``dspark bench --interleave`` steps several in turn), so the
        target's own setting is what is compared, where it tells it: another engine may have
        changed it since this one's last round (a gated engine switching capture off left a drafting
        neighbour without features, and a plain one paying for capture)."""
        want = tuple(self.drafter.target_layer_ids) if on and self.drafter is not None else ()
        have = getattr(self.target, "capture_layers", None)
        if have is None:  # a target that does not say: what this engine last set
            have = tuple(self.drafter.target_layer_ids) if self._capturing else ()
        if tuple(have) != want:
            self.target.set_capture_layers(want)
        self._capturing = on

    # -- one round ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        reqs = [r for r in self._requests.values() if r.finished is None]
        if not reqs:
            return []
        t_round = self.clock()
        rids = [r.rid for r in reqs]
        R = len(reqs)
        gens = [r.generator for r in reqs]
        # Room for drafts: the round commits accepted + 1 tokens, within max_new_tokens and the
        # target's context (the anchor and ℓ drafts enter the cache).
        room = torch.tensor([
            min(r.max_new_tokens - (r.tokens.numel() - r.prompt_len) - 1,
                self.target.max_context - r.tokens.numel() - 1)
            for r in reqs
        ]).clamp_min(0)  # [R]
        before = [self.target.cached_length(rid) for rid in rids]
        cost_model = self._cost_model_at(sum(before) / R, R)  # read at this round's KV context
        drafted = self.drafter is not None and (self.draft_gate is None
                                                or self.draft_gate.should_draft(rids, cost_model))
        # Features wait in r.features while the gate skips drafting; the next drafted round gets them
        # all, from r.feature_start on (a request without any: its context restarts at the anchor).
        features = {}
        if drafted and self.drafter.target_layer_ids:
            width = len(self.drafter.target_layer_ids) * self.target.hidden_size
            features = {
                "hidden": [(r.features[0] if len(r.features) == 1 else torch.cat(r.features)) if r.features
                           else torch.empty(0, width) for r in reqs],
                "hidden_start": [r.feature_start if r.features else r.tokens.numel() - 1 for r in reqs]}
        ctx = DraftContext(rids, [r.tokens for r in reqs], [r.sampling for r in reqs], gens,
                           max_lengths=room, features=features)
        self._capture(self._features_wanted())

        def verify_fn(tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[Any, torch.Tensor]:
            out = self.target.verify(rids, tokens, lengths)  # logits [R, 1+γ, V]
            return out, out.logits

        res = speculative_round(
            ctx, verify_fn, drafter=self.drafter if drafted else None, confidence_model=self.confidence_model,
            calibrator=self.calibrator, scheduler=self.scheduler, cost_model=cost_model, clock=self.clock)
        block, raw, out = res.block, res.confidence_logits, res.output
        lengths, expected, accepted, committed = res.lengths, res.expected_tokens, res.accepted, res.committed
        gamma, t_draft, t_target = res.gamma, res.draft_seconds, res.verify_seconds
        catch_up = self._catch_up_seconds(reqs, features) if drafted and self.draft_gate is not None else 0.0
        if drafted:
            self.timings["draft"] += t_draft
            self.timings["sequential_head"] += self.drafter.timings.get("sequential_head", 0.0)
            for r in reqs:
                r.features = []
        self.timings["target"] += t_target
        keep = torch.tensor(before) + 1 + accepted  # anchor + accepted drafts stay cached
        self.target.rollback(rids, keep)
        outputs = []
        feats = self._features(out)  # [R, 1 + γ, m·d] or None (no capture this round)
        for i, r in enumerate(reqs):
            n_acc = int(accepted[i])
            new = committed[i, : n_acc + 1].tolist()
            if feats is not None:
                if not r.features:
                    r.feature_start = before[i]  # the anchor's position
                r.features.append(feats[i, : n_acc + 1])
            else:
                r.features = []  # a gap: the drafter restarts where capture resumes
            m = r.metrics
            m.rounds += 1
            m.verified.append(int(lengths[i]))
            m.accepted.append(n_acc)
            m.proposed.append(int(block.valid_lengths[i]) if gamma else 0)
            if gamma:
                m.confidence.append(raw[i].tolist())
            new = self._truncate(r, new)
            r.tokens = torch.cat([r.tokens, torch.tensor(new, dtype=torch.long)])
            outputs.append(StepOutput(r.rid, new, r.finished))
        for o in outputs:
            if o.finished:
                self._release(o.request_id)
        seconds = self.clock() - t_round
        self.timings["round"] += seconds
        self.rounds += 1
        B = (cost_model.batch_size(lengths) if cost_model is not None
             else R * (1 + int(lengths.max())))
        if self.draft_gate is not None:
            self.draft_gate.observe(R, drafted, R + int(accepted.sum()), seconds, cost_model,
                                    draft_seconds=t_draft if drafted else None, gamma=gamma, catch_up=catch_up,
                                    expected=float(expected) if drafted else None,
                                    lengths=lengths, accepted=accepted, target_seconds=t_target,
                                    survival=torch.cumprod(res.confidence, dim=1) if res.confidence is not None else None)
        self.last_round = RoundInfo(R, lengths.tolist(), accepted.tolist(), int(B), drafted, expected,
                                    t_draft, t_target, seconds, sum(before) / R)
        return outputs

    def _catch_up_seconds(self, reqs: list[_Request], features: dict[str, Any]) -> float:
        """The part of this drafted round's context ingestion that drafting every round would not
        have paid here: the feature rows captured in skipped rounds. What drafting every round pays
        too is steady: each request's newest capture (the anchor and the tokens the last round
        accepted) and its prompt (a request joining pays it once whenever it drafts first; at high
        concurrency with turnover that is a real share of every round). The drafter's measured
        ingest time (``timings["ingest"]``) is split in proportion to the rows. The draft gate
        judges drafting on what drafting every round costs: the catch-up is the price of the skip
        before it, and charging it to the probe after the skip made that probe look like a loss
        (then the next skip was longer, and its probe's catch-up larger)."""
        ingest = float(self.drafter.timings.get("ingest", 0.0))
        rows = [int(h.shape[0]) for h in features.get("hidden", [])]
        total = sum(rows)
        if ingest <= 0.0 or total == 0:
            return 0.0
        steady = 0
        for r, n in zip(reqs, rows):
            if not r.features:
                continue
            chunks = [int(c.shape[0]) for c in r.features]
            prompt = chunks[0] if r.feature_start == 0 else 0  # the prefill capture starts at position 0
            newest = chunks[-1] if len(chunks) > (1 if prompt else 0) else 0
            steady += min(prompt + newest, n)
        return ingest * (total - steady) / total

    def _truncate(self, r: _Request, new: list[int]) -> list[int]:
        """Cut at the first stop token (kept) and at max_new_tokens; mark the request finished."""
        for k, t in enumerate(new):
            if t in r.stop_ids:
                r.finished = "stop"
                return new[: k + 1]
        room = r.max_new_tokens - (r.tokens.numel() - r.prompt_len)
        if len(new) >= room:
            r.finished = "length"
            return new[:room]
        if r.tokens.numel() + len(new) >= self.target.max_context:
            r.finished = "length"
        return new

    # -- conveniences ---------------------------------------------------------------------
    def stream(self) -> Iterator[StepOutput]:
        """Run rounds until every request has finished, yielding committed tokens as they come."""
        while any(r.finished is None for r in self._requests.values()):
            yield from self.step()

    def pop_finished(self) -> list[Completion]:
        done = [r for r in self._requests.values() if r.finished is not None]
        tok = self.target.tokenizer
        for r in done:
            del self._requests[r.rid]
        return [
            Completion(r.rid, r.tokens[: r.prompt_len].tolist(), r.output,
                       tok.decode(r.output, skip_special_tokens=True) if tok is not None else None,
                       r.finished, r.metrics.to_dict(), r.metrics)
            for r in done
        ]

    def generate(
        self,
        prompts: Sequence[Any],
        sampling: SamplingParams | None = None,
        max_new_tokens: int = 128,
        stop: Sequence[int] | None = None,
        progress: bool = True,
    ) -> list[Completion]:
        """Run prompts to completion (all joined at once) and return them in order."""
        from tqdm import tqdm

        rids: list[str] = []
        try:
            for p in prompts:
                rids.append(self.add_request(p, sampling, max_new_tokens, stop))
        except Exception:  # one bad prompt: none of this call's requests stays behind
            for rid in rids:
                self.abort(rid)
                self._requests.pop(rid, None)
            raise
        total = len(rids) * max_new_tokens
        try:
            with tqdm(total=total, desc="generating", unit="tok", disable=not progress, leave=False) as bar:
                for o in self.stream():
                    bar.update(len(o.new_tokens))
        except BaseException:  # this call's requests leave the engine and the target with the error
            for rid in rids:
                req = self._requests.pop(rid, None)
                if req is not None and req.finished is None:
                    self._release(rid, missing_ok=True)
            raise
        done = {c.request_id: c for c in self.pop_finished()}
        return [done[rid] for rid in rids]
