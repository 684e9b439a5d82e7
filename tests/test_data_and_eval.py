"""Self-distillation data, held-out split, evaluation rounds and the metrics computed from them."""

from __future__ import annotations

import json

import pytest
import torch

import dspark
from dspark.data.prompts import (
    DOMAINS,
    Prompt,
    builtin_prompts,
    chat_prompts,
    code_prompts,
    is_heldout,
    jsonl_prompts,
    math_prompts,
    prompt_hash,
    split,
)
from dspark.data.selfdistill import generate_records, read_records
from dspark.engine import Engine
from dspark.evaluation.round_metrics import evaluate_rounds, threshold_sweep
from dspark.evaluation.rounds import Rounds, collect_rounds
from dspark.targets import HFTarget
from dspark.types import SamplingParams
from helpers import tiny_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")
V = 32


def test_builtin_sources_are_deterministic_distinct_and_per_domain():
    assert math_prompts(50, seed=1) == math_prompts(50, seed=1)
    assert math_prompts(50, seed=1) != math_prompts(50, seed=2)
    for make, dom in ((math_prompts, "math"), (code_prompts, "code"), (chat_prompts, "chat")):
        ps = make(100)
        assert len(ps) == 100 and len({p.text for p in ps}) == 100
        assert {p.domain for p in ps} == {dom}
    assert any("def " in p.text for p in code_prompts(300))  # completion prompts from stdlib docs
    assert {p.domain for p in builtin_prompts(5)} == set(DOMAINS)
    # documentation shipped inside an installed PyPI package is a prompt source too
    pkg = code_prompts(30, modules=["attrs", "tqdm"])
    assert pkg and any("attrs." in p.text or "tqdm." in p.text for p in pkg)
    with pytest.raises(ValueError, match="no_such_module"):
        code_prompts(5, modules=["no_such_module"])


def test_heldout_split_is_by_hash_and_disjoint():
    prompts = builtin_prompts(200)
    train, held = split(prompts + prompts[:10], 0.2)  # duplicates are dropped
    assert not {p.key for p in train} & {p.key for p in held}
    assert len(train) + len(held) == len({p.text for p in prompts})
    assert 0.1 < len(held) / (len(train) + len(held)) < 0.3
    # the decision depends on the text only, not on order or on the other prompts
    assert all(is_heldout(p.text, 0.2) for p in held)
    assert prompt_hash("  x ") == prompt_hash("x")
    with pytest.raises(ValueError, match="eval_fraction"):
        split(prompts, 1.0)


def test_jsonl_prompts_and_their_errors(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "hi", "domain": "chat"}) + "\n\n"
                 + json.dumps({"messages": [{"role": "user", "content": "yo"}]}) + "\n")
    assert [(p.text, p.domain) for p in jsonl_prompts(f)] == [("hi", "chat"), ("yo", "user")]
    f.write_text('{"prompt": ""}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1: needs a non-empty 'prompt'"):
        list(jsonl_prompts(f))
    f.write_text("{oops\n")
    with pytest.raises(ValueError, match="not valid JSON"):
        list(jsonl_prompts(f))
    with pytest.raises(FileNotFoundError):
        list(jsonl_prompts(tmp_path / "missing.jsonl"))
    f.write_bytes(json.dumps({"prompt": "ok"}).encode() + b"\n" + b'{"prompt": "caf\xe9"}\n')  # Latin-1
    with pytest.raises(ValueError, match=r"p.jsonl:2: not UTF-8 text"):
        list(jsonl_prompts(f))


@pytest.fixture(scope="module")
def target():
    return HFTarget(tiny_causal_lm(vocab_size=V))


class _IdPrompt:
    """A prompt whose text is token ids (the tiny target has no tokenizer)."""

    def __init__(self, ids, domain):
        self.text, self.domain, self.key = ids, domain, prompt_hash(str(ids))


def test_generate_records_writes_the_targets_own_greedy_continuations(target):
    prompts = [Prompt("a", "math"), Prompt("b", "code"), Prompt("c", "chat")]
    engine = Engine(target, None)
    engine.encode = lambda p, chat=True: torch.tensor([1 + ord(p) % 7, 3, 5])
    recs = list(generate_records(engine, prompts, SamplingParams.greedy(), max_new_tokens=6, concurrency=2,
                                 progress=False))
    assert sorted(r.domain for r in recs) == ["chat", "code", "math"]
    for r in recs:
        ids = torch.tensor([list(r.prompt_ids)])
        ref = target.model.generate(ids, max_new_tokens=6, do_sample=False)[0, 3:].tolist()
        assert list(r.response_ids) == ref


def test_read_records_names_the_bad_line(tmp_path):
    f = tmp_path / "train.jsonl"
    f.write_text('{"key": "k", "domain": "d", "prompt": "p", "prompt_ids": [1], "response_ids": [2, 3]}\n{"key": 1}\n')
    with pytest.raises(ValueError, match="train.jsonl:2"):
        read_records(f)
    with pytest.raises(FileNotFoundError, match="dspark data"):
        read_records(tmp_path / "none.jsonl")


def test_collect_rounds_and_metrics_agree_with_the_engine(target):
    torch.manual_seed(3)
    drafter = dspark.get_drafter("dspark", target=target, gamma=4, num_layers=1, rank=8)
    prompts = [_IdPrompt([1, 2, 3, i], "math" if i % 2 else "code") for i in range(4)]
    rounds = collect_rounds(target, drafter, prompts, SamplingParams.greedy(), max_new_tokens=12,
                            concurrency=3, progress=False)
    n = len(rounds.domain)
    assert rounds.confidence_logits.shape == (n, 4)
    assert (rounds.verified == rounds.proposed).all()  # `full` verifies every valid position
    assert rounds.new_tokens == 4 * 12
    assert int((rounds.accepted + 1).sum()) >= rounds.new_tokens  # committed (last round may be cut)
    res = evaluate_rounds(rounds, dspark.get_calibrator("sts").fit(rounds.confidence_logits, rounds.accepted,
                                                                   rounds.verified), thresholds=[0.0, 0.5, 1.01])
    assert set(res["domains"]) == {"math", "code"}
    assert res["overall"]["tau"] == pytest.approx(float((rounds.accepted + 1).float().mean()))
    assert res["overall"]["verify_rate"] == pytest.approx(1.0)
    sweep = res["overall"]["threshold_sweep"]
    assert sweep[0]["verified"] == int(rounds.proposed.sum())  # θ = 0 verifies everything
    assert sweep[-1]["verified"] == 0 and sweep[-1]["tau"] == 1.0  # θ > 1 verifies nothing
    assert Rounds.from_dict(json.loads(json.dumps(rounds.to_dict()))).accepted.tolist() == rounds.accepted.tolist()


def test_collect_rounds_records_the_named_confidence_model(target):
    """The same greedy rounds with the max-prob proxy: identical accept counts, logits that are
    logit(max softmax(Ũ_j)) of each draft position, not the head's."""
    torch.manual_seed(3)
    drafter = dspark.get_drafter("dspark", target=target, gamma=4, num_layers=1, rank=8)
    prompts = [_IdPrompt([1, 2, 3, i], "math") for i in range(3)]
    kw = dict(max_new_tokens=8, concurrency=2, progress=False)
    head = collect_rounds(target, drafter, prompts, SamplingParams.greedy(), **kw)
    proxy = collect_rounds(target, drafter, prompts, SamplingParams.greedy(), confidence_model="max-prob", **kw)
    assert torch.equal(head.accepted, proxy.accepted) and head.prompt == proxy.prompt
    assert not torch.allclose(head.confidence_logits, proxy.confidence_logits)
    p = torch.sigmoid(proxy.confidence_logits)
    assert ((p > 0) & (p <= 1)).all()  # a largest probability over the vocabulary: above 1/V
    assert (p >= 1.0 / target.vocab_size - 1e-6).all()


def test_collect_rounds_sends_a_multi_turn_prompt_as_its_whole_conversation(target, monkeypatch):
    """A held-out follow-up ("explain step 2") is only meaningful after its earlier turns: the
    engine must get the conversation, not the last user turn alone (calibration and eval prompts
    include such prompts)."""
    seen = []

    def encode(self, prompt, chat=True):
        seen.append(prompt)
        return torch.tensor([1, 2, 3])

    monkeypatch.setattr(Engine, "encode", encode)
    turns = (("user", "What is 3 + 4?"), ("assistant", "7."), ("user", "And times 2?"))
    prompts = [Prompt("And times 2?", "math", messages=turns), Prompt("Hi", "chat")]
    drafter = dspark.get_drafter("dspark", target=target, gamma=4, num_layers=1, rank=8)
    collect_rounds(target, drafter, prompts, SamplingParams.greedy(), max_new_tokens=4, progress=False)
    assert seen == [[{"role": r, "content": c} for r, c in turns], "Hi"]


def test_threshold_sweep_counts():
    a = torch.tensor([[0.9, 0.6, 0.3], [0.8, 0.2, 0.1]])
    acc = torch.tensor([1, 3])
    (s,) = threshold_sweep(a, acc, [0.5])
    assert s["verified"] == 3 and s["accepted"] == 1 + 1 and s["rejected_verified"] == 1


def test_calibration_prompts_skip_the_evaluation_prompts(tmp_path):
    from dspark.data.selfdistill import write_prompts
    from dspark.evaluation.inputs import eval_prompts

    f = tmp_path / "eval_prompts.jsonl"
    write_prompts(f, builtin_prompts(6))
    evaluation = eval_prompts(str(f), 2)
    calibration = eval_prompts(str(f), 3, skip=2)
    assert len(evaluation) == 6 and len(calibration) == 9
    assert not {p.key for p in evaluation} & {p.key for p in calibration}
    assert eval_prompts(str(f), 2) == evaluation  # stable order
