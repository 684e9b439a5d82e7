"""The batched engine: greedy identity with the target's own decode for every drafter × head ×
scheduler on tiny Llama and Qwen3 models, requests joining mid-stream, sampling χ² tests, limits."""

from __future__ import annotations

import pytest
import torch

import dspark
from dspark.drafters.prune import prune_draft_vocab
from dspark.engine import Engine
from dspark.gating import DraftGate
from dspark.protocols import TargetFeatures
from dspark.targets import HFTarget
from dspark.types import SamplingParams
from helpers import (
    TickClock,
    assert_same_distribution,
    exact_two_token_probs,
    greedy_decode,
    record_rounds,
    run_with_late_join,
    sequence_counts,
    tiny_causal_lm,
)

V = 16  # a tiny vocabulary so random drafters are accepted often enough to exercise every path


pytestmark = pytest.mark.usefixtures("one_thread")

def tiny_model(arch: str):
    return tiny_causal_lm(arch, vocab_size=V, max_positions=96)  # no EOS: decode to max_new_tokens


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request):
    return tiny_model(request.param)


def drafter_for(target, name):
    torch.manual_seed(1)
    if name == "ngram":
        return dspark.get_drafter("ngram", vocab_size=V, gamma=4)
    kind, _, head = name.partition(":")
    cut = kind.endswith("-cut")  # a full-vocabulary drafter cut to target ids 0..9 (prune_draft_vocab)
    kind = kind.removesuffix("-cut")
    cfg = {"gamma": 4}
    if kind.endswith("-dv"):  # reduced draft vocabulary: target ids 0..9 only (10..15 never drafted)
        kind = kind.removesuffix("-dv")
        cfg["draft_vocab_size"] = 11
    if kind == "dspark":
        cfg.update(head=head, rank=8, num_layers=2)
    elif kind == "dflash":
        cfg.update(num_layers=2)
    d = dspark.get_drafter(kind, target=target, **cfg)
    for p in d.parameters():
        if p.ndim > 1:
            torch.nn.init.normal_(p, std=0.2)
    return prune_draft_vocab(d, torch.arange(10)) if cut else d


DRAFTERS = ["ngram", "dspark:vanilla-markov", "dspark:gated-markov", "dspark:rnn", "dflash", "eagle3",
            "dspark-dv:gated-markov", "eagle3-dv", "dspark-cut:vanilla-markov"]
SCHEDULERS = {
    "full": ("full", {}),
    "fixed-1": ("fixed", {"k": 1}),
    "threshold": ("threshold", {"threshold": 0.2}),
    "sps-greedy": ("sps-greedy", {}),
    "sps-greedy-async": ("sps-greedy", {"lag": 2}),  # the paper's asynchronous variant
    "sps-greedy-sunk": ("sps-greedy", {"sunk": True}),  # Θ counts the round's drafting time
    # The draft gate skips drafting in some rounds (plain verification; the drafter catches up on
    # the skipped tokens' features next time): short skips so drafted and skipped rounds mix.
    "sps-greedy+gate": ("sps-greedy", {}),
}


def gate_for(sched):
    # Short skips by every rule (the bound, the forecast, the measured rates' probe budget), so that
    # drafted rounds follow skipped ones within a test's few tokens and the drafter's catch-up on
    # skipped tokens is exercised: the random drafters lose, and with the defaults (256–512 rounds,
    # or ~230 by the 0.5 % probe budget on a clear loss) no round after the first skip was drafted.
    return DraftGate(min_backoff=1, max_backoff=2, hopeless_skip=2, forecast_probe=2,
                     probe_budget=0.9) if sched.endswith("+gate") else None


# A flat "packed" profile: drafting always pays, so sps-greedy verifies every draft with a non-negligible
# survival even for the 1500-request χ² batches. (Under "padded" accounting the first admitted draft
# doubles B from R to 2R; with the old padded profile and 1500 identical requests that cliff made
# sps-greedy verify nothing at all, so its χ² cases silently tested plain sampling.)
# The step time is absurdly short (0.1 ms) on purpose: before any plain round is measured the draft
# gate compares the measured drafted rounds with this estimate, so its first decision (once it has
# min_evidence request-rounds) is surely a skip and the "+gate" runs really mix drafted and plain
# rounds; later decisions read the measured rates. The engines below run on a TickClock, so those
# rates, and which rounds are drafted, do not depend on the machine's speed or load (the output
# must not change either way; the χ² samples would).
FLAT = dspark.get_cost_model("sps-table", profile={
    "device": "test", "model": "tiny", "dtype": "float32", "date": "2026-11-30", "accounting": "packed",
    "points": [{"batch_size": 1, "step_seconds": 1e-4}, {"batch_size": 65536, "step_seconds": 1.01e-4}]})


def assert_verified(infos, label: str, gate: bool, catch_up: bool = False) -> None:
    """Drafts were really verified (not a silent fallback to plain decoding); with the draft gate
    some rounds were also skipped and, with ``catch_up``, some drafted round followed a skipped one
    (the drafter caught up on the skipped tokens)."""
    assert any(i.drafted and sum(i.lengths) > 0 for i in infos), f"{label}: no draft was verified"
    if gate:
        assert any(not i.drafted for i in infos), f"{label}: the draft gate never skipped a round"
    if gate and catch_up:
        assert any(not a.drafted and b.drafted for a, b in zip(infos, infos[1:])), \
            f"{label}: no round was drafted after a skipped one"


PROMPTS = [[3, 5, 7, 3, 5, 7, 3, 5], [1], [2, 9, 4, 4, 11, 2, 9, 4, 4, 11, 2, 9, 13, 6, 1, 2, 9, 4]]


@pytest.mark.parametrize("sched", sorted(SCHEDULERS))
@pytest.mark.parametrize("dname", DRAFTERS)
def test_greedy_batch_identical_to_target_decode(model, dname, sched):
    target = HFTarget(model)
    name, cfg = SCHEDULERS[sched]
    engine = Engine(target, drafter_for(target, dname), scheduler=dspark.get_scheduler(name, **cfg), cost_model=FLAT,
                    draft_gate=gate_for(sched), clock=TickClock())
    infos = record_rounds(engine)
    prompts = [torch.tensor(p) for p in PROMPTS]
    n = 20
    rids, done = run_with_late_join(engine, prompts, n)
    for rid, p in zip(rids, prompts):
        assert done[rid].output_ids == greedy_decode(model, p, n), f"{dname}/{sched}: request {rid} diverged"
        assert done[rid].finish_reason == "length"
    assert list(target.request_ids) == []  # finished requests released their KV caches
    assert_verified(infos, f"{dname}/{sched}", gate=sched.endswith("+gate"), catch_up=True)
    assert sum(sum(done[r].rounds.verified) for r in rids) > 0


class CaptureSpy(HFTarget):
    """Records, per verification round, whether target features were captured."""

    def __init__(self, model):
        super().__init__(model)
        self.captured: list[bool] = []

    def verify(self, request_ids, tokens, lengths):
        self.captured.append(bool(self.capture_layers))
        return super().verify(request_ids, tokens, lengths)


@pytest.mark.parametrize("dname", [d for d in DRAFTERS if d != "ngram"])
def test_capture_pauses_during_long_skips_and_drafting_resumes_losslessly(model, dname):
    """A gate whose skips (3–6 rounds) are longer than capture_ahead = 1: the skipped rounds run
    without capturing target features except the one right before a drafted round, so the
    drafter restarts its context after a gap. Outputs stay the target's greedy decode, features
    really paused, and drafts after a gap were verified."""
    target = CaptureSpy(model)
    engine = Engine(target, drafter_for(target, dname), scheduler="sps-greedy", cost_model=FLAT,
                    draft_gate=DraftGate(min_backoff=3, max_backoff=6, hopeless_skip=6, forecast_probe=6,
                                         probe_budget=0.9), clock=TickClock(),
                    capture_ahead=1)
    infos = record_rounds(engine)
    prompts = [torch.tensor(p) for p in PROMPTS]
    n = 40
    rids, done = run_with_late_join(engine, prompts, n)
    for rid, p in zip(rids, prompts):
        assert done[rid].output_ids == greedy_decode(model, p, n), f"{dname}: request {rid} diverged"
    cap = target.captured
    assert len(cap) == len(infos)
    assert not all(cap), f"{dname}: features were captured in every round"
    # a drafted round after a round without capture (so after a gap) whose drafts were verified
    gap_then_draft = [i for i in range(2, len(infos)) if infos[i].drafted and not cap[i - 2]]
    assert gap_then_draft and any(sum(infos[i].lengths) > 0 for i in gap_then_draft), \
        f"{dname}: no verified drafts after a gap"
    with pytest.raises(ValueError, match="capture_ahead"):
        Engine(target, None, capture_ahead=0)


@pytest.mark.parametrize("dname", [d for d in DRAFTERS if d != "ngram"])
def test_without_gaps_the_drafter_keeps_the_whole_context(model, dname):
    """Features captured every round: the drafter's context is never restarted (offset 0) and
    has grown past the prompt."""
    target = HFTarget(model)
    engine = Engine(target, drafter_for(target, dname), scheduler="full", cost_model=FLAT)
    rid = engine.add_request(torch.tensor(PROMPTS[2]), max_new_tokens=30)
    for _ in range(4):
        engine.step()
    cache = engine.drafter.loop.caches[rid]
    assert cache.offset == 0 and cache.end > len(PROMPTS[2])


def test_drafts_are_accepted_somewhere():
    """The identity tests above would be weak if nothing were ever accepted: with these seeds every
    drafter (random weights, 16-token vocabulary) gets drafts accepted on the tiny Llama target."""
    model = tiny_model("llama")
    target = HFTarget(model)
    for dname in DRAFTERS:
        engine = Engine(target, drafter_for(target, dname), scheduler="full", cost_model=FLAT)
        out = engine.generate([torch.tensor(p) for p in PROMPTS], max_new_tokens=40, progress=False)
        assert sum(c.metrics["accepted"] for c in out) > 0, dname


# Top-p 0.95 at T = 1 (not tighter): on this peaked tiny model top-p 0.9 at T = 0.7 keeps only 2–3
# tokens, and random drafters' truncated q then rarely overlaps p, so some cases accepted nothing.
SAMPLING = {"T1": SamplingParams(temperature=1.0), "T1-topp0.95": SamplingParams(temperature=1.0, top_p=0.95),
            "T1.3-topk8": SamplingParams(temperature=1.3, top_k=8)}
# A repeating prompt whose n-gram proposal (11) is likely under the target in every setting
# (p ≈ 0.5): with the old prompt the n-gram draft had p ≈ 0.002 (0 under top-k / top-p), so the
# n-gram cases never accepted a draft. Every drafter × setting gets drafts accepted with it.
CHI2_PROMPT = [7, 13, 11, 7, 13, 11, 7, 13]


@pytest.mark.parametrize("pname", sorted(SAMPLING))
@pytest.mark.parametrize("sched", sorted(SCHEDULERS))
@pytest.mark.parametrize("dname", DRAFTERS)
def test_sampling_matches_target_distribution(dname, sched, pname):
    """Joint law of the first two sampled tokens = plain target sampling (χ², fixed seeds).

    max_new_tokens = 3 leaves room for two drafts in the first round, so both tested tokens can
    come from accepted drafts. Every case must verify drafts and accept some (else it would only
    test plain sampling). The "+gate" cases: the first round drafts and verifies, then the gate
    (FLAT's tiny plain-step estimate) skips the next rounds, so the remaining tokens of the same
    requests come from plain rounds (the γ = 0 sampling path) after a speculative one; the drafter's
    catch-up after skipped rounds is covered by the greedy battery's longer decodes (asserted there).

    Every source of randomness is fixed: the weights (seeded builders), the engine's per-request
    generators (seed 11 and a CRC of the request id) and the draft gate's decisions, which read
    the engine's clock: a TickClock, not wall-clock time, so a busy machine cannot change which
    rounds are drafted and hence the samples."""
    model = tiny_model("llama")
    target = HFTarget(model)
    name, cfg = SCHEDULERS[sched]
    engine = Engine(target, drafter_for(target, dname), scheduler=dspark.get_scheduler(name, **cfg),
                    cost_model=FLAT, seed=11, draft_gate=gate_for(sched), clock=TickClock())
    infos = record_rounds(engine)
    prompt = torch.tensor(CHI2_PROMPT)
    N, params = 1500, SAMPLING[pname]
    out = engine.generate([prompt] * N, params, max_new_tokens=3, progress=False)
    tokens = torch.tensor([c.output_ids[:2] for c in out])  # [N, 2]
    label = f"{dname}/{sched}/{pname}"
    # the exact law comes from a separate forward: a top-p boundary token may differ by float noise
    assert_same_distribution(sequence_counts(tokens, V), exact_two_token_probs(model, prompt, params), label,
                             exact_support=False)
    assert_verified(infos, label, gate=sched.endswith("+gate"))
    verified = sum(sum(c.rounds.verified) for c in out)
    accepted = sum(c.metrics["accepted"] for c in out)
    assert verified > 0 and accepted > 0, f"{label}: verified {verified}, accepted {accepted}"


def test_stop_tokens_and_context_limit(model):
    target = HFTarget(model)
    ref = greedy_decode(model, torch.tensor(PROMPTS[0]), 20)
    stop = ref[5]
    engine = Engine(target, drafter_for(target, "dflash"), scheduler="full", cost_model=FLAT)
    (c,) = engine.generate([torch.tensor(PROMPTS[0])], max_new_tokens=20, stop=[stop], progress=False)
    assert c.output_ids == ref[: ref.index(stop) + 1] and c.finish_reason == "stop"
    # a prompt near the context window: drafts shrink, the request stops at the window, no crash
    long_prompt = torch.tensor((PROMPTS[2] * 6)[:93])
    (c,) = engine.generate([long_prompt], max_new_tokens=20, progress=False)
    assert len(c.output_ids) == 96 - 93 and c.finish_reason == "length"
    assert c.output_ids == greedy_decode(model, long_prompt, 3)


def test_bad_input_is_a_clear_error(model):
    target = HFTarget(model)
    engine = Engine(target, drafter_for(target, "dflash"), scheduler="full", cost_model=FLAT)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request(torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="context window is 96"):
        engine.add_request(torch.arange(100) % V)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        engine.add_request(torch.tensor([1, 2]), SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match="unknown drafter 'dsprak'"):
        Engine(target, "dsprak")
    with pytest.raises(ValueError, match="not lossless"):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            Engine(target, drafter_for(target, "dflash"), scheduler="sps-argmax", cost_model=FLAT)
    other = dspark.get_drafter("ngram", vocab_size=V + 1)
    with pytest.raises(ValueError, match="vocab size"):
        Engine(target, other)


def test_plain_decoding_engine_is_the_baseline(model):
    """drafter=None: the same batched target, one token per round, identical to HF generate."""
    target = HFTarget(model)
    engine = Engine(target, None, scheduler="full", cost_model=None)
    out = engine.generate([torch.tensor(p) for p in PROMPTS], max_new_tokens=12, progress=False)
    for c, p in zip(out, PROMPTS):
        assert c.output_ids == greedy_decode(model, torch.tensor(p), 12)
        assert c.metrics["rounds"] == 12 and c.metrics["tau"] == 1.0


# -- requests that go wrong ----------------------------------------------------------------------


def test_abort_and_a_bad_prompt_lose_nothing():
    model = tiny_causal_lm()
    target = HFTarget(model)
    engine = Engine(target, dspark.get_drafter("ngram", vocab_size=32, gamma=3), cost_model="sps-table")
    greedy = SamplingParams.greedy()
    with pytest.raises(KeyError, match="unknown request id 'nope'"):
        engine.abort("nope")
    # one bad prompt among several: the call raises and none of its requests stays prefilled
    with pytest.raises(ValueError, match="empty"):
        engine.generate([torch.tensor([1, 2, 3]), torch.tensor([], dtype=torch.long), torch.tensor([4])],
                        greedy, max_new_tokens=4, progress=False)
    assert engine.active == [] and target.request_ids == ()
    (ok,) = engine.generate([torch.tensor([5, 6])], greedy, max_new_tokens=4, progress=False)
    assert len(ok.output_ids) == 4
    # abort a running request: its caches are freed and it is reported as aborted, with what it had
    a = engine.add_request(torch.tensor([1, 2, 3]), greedy, max_new_tokens=20)
    b = engine.add_request(torch.tensor([7, 8]), greedy, max_new_tokens=2)
    engine.step()
    engine.abort(a)
    assert a not in target.request_ids
    for _ in engine.stream():
        pass
    # b finished (not yet collected): aborting it changes nothing
    engine.abort(b)
    done = {c.request_id: c for c in engine.pop_finished()}
    assert done[a].finish_reason == "abort" and 1 <= len(done[a].output_ids) < 20
    assert done[b].finish_reason == "length" and len(done[b].output_ids) == 2
    assert engine.active == [] and target.request_ids == ()


def test_a_scheduler_returning_something_else_is_named():
    class Broken:
        name = "broken"
        lossless = True

        def lengths(self, confidence, valid_lengths, cost_model):
            return valid_lengths.tolist()  # a list, not a tensor of lengths

    engine = Engine(HFTarget(tiny_causal_lm()), dspark.get_drafter("ngram", vocab_size=32, gamma=3),
                    scheduler=Broken(), cost_model="sps-table")
    engine.add_request(torch.tensor([1, 2, 1, 2, 1]), SamplingParams.greedy(), max_new_tokens=4)
    with pytest.raises(TypeError, match=r"scheduler 'broken' must return integer lengths ℓ of shape \[R=1\], got list"):
        engine.step()


@pytest.mark.parametrize("gated", [False, True], ids=["ungated", "gated"])
@pytest.mark.parametrize("dname", ["dspark:vanilla-markov", "dflash", "eagle3"])
def test_drafts_equal_a_fresh_loop_fed_the_whole_context(model, dname, gated):
    """An independent oracle for the engine's feature bookkeeping (prefill features, per-round
    chunks, catch-up after gated rounds, requests joining mid-stream): every round's drafts equal
    those of a fresh drafting loop given, in one piece, the features of one prefill over the
    request's final sequence up to the anchor."""
    target = HFTarget(model)
    drafter = drafter_for(target, dname)
    engine = Engine(target, drafter, scheduler="full", cost_model=FLAT, clock=TickClock(),
                    draft_gate=gate_for("+gate") if gated else None)
    draft, seen = drafter.draft, []

    def spy(ctx):
        block = draft(ctx)
        for i, (rid, ids) in enumerate(zip(ctx.request_ids, ctx.token_ids)):
            seen.append((rid, ids.numel() - 1, block.tokens[i].clone(), block.draft_logits[i].clone(),
                         int(block.valid_lengths[i])))
        return block

    drafter.draft = spy
    rids, done = run_with_late_join(engine, [torch.tensor(p) for p in PROMPTS], 20)
    assert len(seen) > 10
    full = {rid: torch.tensor(done[rid].prompt_ids + done[rid].output_ids) for rid in rids}
    feats = {}
    target.set_capture_layers(drafter.target_layer_ids)  # the gate may have paused capture
    for rid, seq in full.items():
        out = target.prefill(["oracle"], [seq], logits=False)
        feats[rid] = torch.cat([out.hidden_states[k] for k in drafter.target_layer_ids], -1)[0]  # [n - 1, m·d]
        target.release("oracle")
    for rid, anchor, tokens, logits, valid in seen:
        drafter.release("oracle")
        ctx = dspark.protocols.DraftContext(
            ["oracle"], [full[rid][: anchor + 1]], [SamplingParams.greedy()], [torch.Generator()],
            features=TargetFeatures([feats[rid][:anchor]], [0]))
        ref = draft(ctx)
        n = min(valid, int(ref.valid_lengths[0]))  # a draft ends at its valid length (the room left)
        assert tokens[:n].tolist() == ref.tokens[0, :n].tolist(), f"{dname}: {rid} at anchor {anchor}"
        torch.testing.assert_close(logits[:n], ref.draft_logits[0, :n], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["head-max-prob", "stacked"])
def test_stacked_confidence_keeps_the_output_the_targets(model, kind):
    """A stacked confidence model (head-max-prob, or the calibrated `stacked` with squares) only
    changes which positions sps-greedy verifies: greedy outputs stay the target's, and a sampled
    two-token law stays the target's (χ²)."""
    from dspark.confidence import HeadMaxProbConfidence, StackedConfidence

    target = HFTarget(model)
    if kind == "head-max-prob":
        conf = HeadMaxProbConfidence([[0.6, 0.5, -0.4], [0.7, 0.6, -0.2], [0.7, 0.6, 0.0], [0.6, 0.7, 0.1]])
    else:
        conf = StackedConfidence(["head", "max-prob", "margin"],
                                 [[0.6, 0.5, 0.2, -0.1, -0.1, 0.0, -0.4 + 0.2 * j] for j in range(4)],
                                 [0.0, -1.0, 1.0], [1.0, 2.0, 1.5])
    engine = Engine(target, drafter_for(target, "dspark:vanilla-markov"), scheduler="sps-greedy", cost_model=FLAT,
                    confidence_model=conf, clock=TickClock())
    infos = record_rounds(engine)
    prompts = [torch.tensor(p) for p in PROMPTS]
    rids, done = run_with_late_join(engine, prompts, 24)
    for rid, p in zip(rids, prompts):
        assert done[rid].output_ids == greedy_decode(model, p, 24)
    assert any(sum(i.lengths) > 0 for i in infos if i.drafted)
    engine = Engine(target, drafter_for(target, "dspark:vanilla-markov"), scheduler="sps-greedy", cost_model=FLAT,
                    confidence_model=conf, seed=11, clock=TickClock())
    prompt, params = torch.tensor(CHI2_PROMPT), SamplingParams.random(1.0)
    out = engine.generate([prompt] * 1500, params, max_new_tokens=3, progress=False)
    tokens = torch.tensor([c.output_ids[:2] for c in out])  # [N, 2]
    assert_same_distribution(sequence_counts(tokens, V), exact_two_token_probs(model, prompt, params),
                             f"{kind}/sps-greedy/T=1", exact_support=False)


def test_the_engine_takes_the_drafters_own_confidence_model(model, tmp_path):
    """Engine(confidence_model=None) uses what the drafter's folder shipped (confidence.json), else
    draft-head; an explicit confidence_model wins."""
    from dspark.confidence import DraftHeadConfidence, HeadMaxProbConfidence, StackedConfidence
    from dspark.drafters.checkpoint import from_pretrained, save_pretrained

    target = HFTarget(model)
    d = drafter_for(target, "dspark:vanilla-markov")
    save_pretrained(d, tmp_path / "ck")
    assert isinstance(Engine(target, from_pretrained(tmp_path / "ck", target)).confidence_model, DraftHeadConfidence)
    stack = HeadMaxProbConfidence([[0.5, 0.5, 0.0]] * d.gamma)
    stack.save(tmp_path / "ck" / "confidence.json")
    loaded = from_pretrained(tmp_path / "ck", target)
    assert Engine(target, loaded).confidence_model == stack
    assert isinstance(Engine(target, loaded, confidence_model="draft-head").confidence_model, DraftHeadConfidence)
    assert isinstance(Engine(target, None).confidence_model, DraftHeadConfidence)
    calibrated = StackedConfidence(["head", "max-prob"], [[0.5, 0.5, 0.0, 0.0, 0.0]] * d.gamma, [0.0, 0.0], [1.0, 1.0])
    calibrated.save(tmp_path / "ck" / "confidence.json")
    loaded = from_pretrained(tmp_path / "ck", target)
    assert Engine(target, loaded).confidence_model == calibrated
    with pytest.raises(ValueError, match="calibrate them twice"):
        Engine(target, loaded, calibrator=dspark.get_calibrator("sts", temperatures=[2.0] * d.gamma))
    Engine(target, loaded, calibrator=dspark.get_calibrator("sts", temperatures=[2.0] * d.gamma),
           confidence_model="draft-head")


def test_an_error_inside_generate_leaves_no_request_behind(model):
    """A failure mid-generation (here the target's forward) takes this call's requests out of the
    engine and the target: the next call, and a new engine on the same target, start clean;
    ``while engine.active: engine.step()`` ends once every request has finished."""
    target = HFTarget(model)
    engine = Engine(target, drafter_for(target, "dflash"), scheduler=dspark.get_scheduler("full"), cost_model=FLAT,
                    clock=TickClock())
    real, calls = target.verify, []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return real(*args, **kw)

    target.verify = failing
    prompts = [torch.tensor(p) for p in PROMPTS]
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate(prompts, SamplingParams.greedy(), max_new_tokens=8, progress=False)
    assert engine.active == [] and target.request_ids == ()
    target.verify = real
    again = engine.generate(prompts, SamplingParams.greedy(), max_new_tokens=8, progress=False)
    assert [c.output_ids for c in again] == [greedy_decode(model, p, 8) for p in prompts]
    fresh = Engine(target, None, cost_model=FLAT, clock=TickClock())
    assert fresh.generate(prompts[:1], SamplingParams.greedy(), max_new_tokens=4, progress=False)[0].output_ids == \
        greedy_decode(model, prompts[0], 4)
    rid = engine.add_request(prompts[0], SamplingParams.greedy(), max_new_tokens=3)
    steps = 0
    while engine.active:
        engine.step()
        steps += 1
        assert steps < 10, "engine.active counted a finished request"
    assert [c.request_id for c in engine.pop_finished()] == [rid]
