"""The batched speculative engine with continuous batching.

Every ``step()`` runs one round for all active requests (docs/serving-and-benchmarks.md, docs/concepts.md §4–6):

    draft → confidence → calibrate → schedule (cost model) → verify (one batched target forward)
    → commit / roll back target and draft caches → per-request metrics.

Requests join (``add_request``) and leave (finish, ``abort``) between steps; their state and what
a round commits to each is :mod:`dspark.request_state`. The engine knows nothing about tokenizers
beyond the optional prompt/chat encoding helpers at the edge; every part is typed by its protocol
(:mod:`dspark.protocols`) and resolved by name through the plugin registry.
"""

from __future__ import annotations

import itertools
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from dspark.cost_models.context import ContextBinding
from dspark.fast.linear import route_linears
from dspark.gating import DraftGate
from dspark.plugins import resolve
from dspark.protocols import (
    Calibrator,
    ConfidenceModel,
    CostModel,
    DraftContext,
    Drafter,
    Scheduler,
    TargetFeatures,
    TargetModel,
    TargetOutput,
)
from dspark.request_state import ActiveRequest, Completion, StepOutput, catch_up_seconds
from dspark.round import RoundInfo, speculative_round
from dspark.types import SamplingParams

__all__ = ["Engine", "encode_prompt"]


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
        target: TargetModel,
        drafter: Drafter | str | None = None,
        *,
        scheduler: Scheduler | str = "sps-greedy",
        cost_model: CostModel | str | None = "sps-table",
        calibrator: Calibrator | str = "identity",
        confidence_model: ConfidenceModel | str | None = None,
        draft_gate: DraftGate | bool | None = None,
        seed: int = 0,
        clock: Callable[[], float] = time.perf_counter,
        capture_ahead: int = 64,
    ) -> None:
        if not isinstance(capture_ahead, int) or capture_ahead < 1:
            raise ValueError(f"capture_ahead must be an integer >= 1, got {capture_ahead!r}")
        self.target: TargetModel = target
        self.drafter: Drafter | None = resolve("drafters", drafter) if drafter is not None else None
        if isinstance(self.drafter, torch.nn.Module):  # bf16 on a CPU: its linears packed once (dspark.fast.linear)
            route_linears(self.drafter)
        self.scheduler: Scheduler = resolve("schedulers", scheduler)
        self.cost_model: CostModel | None = resolve("cost_models", cost_model) if cost_model is not None else None
        self._cost_model_at = ContextBinding(self.cost_model)  # read at each round's KV context
        self.calibrator: Calibrator = resolve("calibrators", calibrator)
        if confidence_model is None:
            confidence_model = (self.drafter.confidence_model if self.drafter is not None else None) or "draft-head"
        self.confidence_model: ConfidenceModel = resolve("confidence_models", confidence_model)
        if self.confidence_model.calibrated and self.calibrator.name != "identity":
            raise ValueError(
                f"confidence model {self.confidence_model.name!r} gives calibrated logits already; calibrator "
                f"{self.calibrator.name!r} would calibrate them twice (pass calibrator='identity', or "
                "confidence_model='draft-head' to calibrate the head's logits)")
        if not self.scheduler.lossless:
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
        if draft_gate is True:
            draft_gate = DraftGate()
        if draft_gate and self.cost_model is None:
            raise ValueError("draft_gate needs a cost model to compare drafting with plain decoding")
        self.draft_gate: DraftGate | None = draft_gate or None
        self.last_round: RoundInfo | None = None
        self.seed = seed
        self.clock = clock
        self._requests: dict[str, ActiveRequest] = {}
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
        req = ActiveRequest(rid, ids, ids.numel(), sampling, max_new_tokens, frozenset(stops),
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

    def _features(self, out: TargetOutput) -> torch.Tensor | None:
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
        target's own setting (``capture_layers``) is what is compared: another engine may have
        changed it since this one's last round (a gated engine switching capture off left a drafting
        neighbour without features, and a plain one paying for capture)."""
        want = tuple(self.drafter.target_layer_ids) if on and self.drafter is not None else ()
        if tuple(self.target.capture_layers) != want:
            self.target.set_capture_layers(want)

    # -- one round ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        reqs = [r for r in self._requests.values() if r.finished is None]
        if not reqs:
            return []
        t_round = self.clock()
        rids = [r.rid for r in reqs]
        R = len(reqs)
        max_context = self.target.max_context
        room = torch.tensor([r.room(max_context) for r in reqs]).clamp_min(0)  # [R]
        before = [self.target.cached_length(rid) for rid in rids]
        context = sum(before) / R  # mean KV context per request
        cost_model = self._cost_model_at(context, R)  # read at this round's KV context
        drafted = self.drafter is not None and (self.draft_gate is None
                                                or self.draft_gate.should_draft(rids, cost_model))
        drafter = self.drafter if drafted else None
        # Features wait in r.features while the gate skips drafting; the next drafted round gets them
        # all, from r.feature_start on (a request without any: its context restarts at the anchor).
        features = None
        if drafter is not None and drafter.target_layer_ids:
            width = len(drafter.target_layer_ids) * self.target.hidden_size
            features = TargetFeatures([r.pending_features(width) for r in reqs], [r.pending_start() for r in reqs])
        ctx = DraftContext(rids, [r.tokens for r in reqs], [r.sampling for r in reqs], [r.generator for r in reqs],
                           max_lengths=room, features=features)
        self._capture(self._features_wanted())

        def verify_fn(tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[TargetOutput, torch.Tensor]:
            out = self.target.verify(rids, tokens, lengths)  # logits [R, 1+γ, V]
            return out, out.logits

        res = speculative_round(
            ctx, verify_fn, drafter=drafter, confidence_model=self.confidence_model,
            calibrator=self.calibrator, scheduler=self.scheduler, cost_model=cost_model, clock=self.clock)
        catch_up = 0.0
        if drafter is not None:
            if features is not None and self.draft_gate is not None:
                catch_up = catch_up_seconds(reqs, features, drafter.timings)
            self.timings["draft"] += res.draft_seconds
            self.timings["sequential_head"] += drafter.timings.get("sequential_head", 0.0)
            for r in reqs:
                r.features = []
        self.timings["target"] += res.verify_seconds
        self.target.rollback(rids, torch.tensor(before) + 1 + res.accepted)  # anchor + accepted drafts stay cached
        feats = self._features(res.output)  # [R, 1 + γ, m·d] or None (no capture this round)
        outputs = []
        for i, r in enumerate(reqs):
            new = r.commit(res, i, feats, before[i], max_context)  # may finish the request
            outputs.append(StepOutput(r.rid, new, r.finished))
        for o in outputs:
            if o.finished:
                self._release(o.request_id)
        seconds = self.clock() - t_round
        self.timings["round"] += seconds
        self.rounds += 1
        B = (cost_model.batch_size(res.lengths) if cost_model is not None
             else R * (1 + int(res.lengths.max())))
        if self.draft_gate is not None and cost_model is not None:
            self.draft_gate.observe(res, seconds, cost_model, catch_up)
        self.last_round = RoundInfo.from_result(res, int(B), seconds, context)
        return outputs

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
