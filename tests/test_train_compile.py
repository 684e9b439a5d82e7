"""Training through torch.compile (``TrainConfig.compile``, :mod:`dspark.training.compiled`): the
compiled objective's loss terms and gradients are the eager ones for batches of different lengths
(with no second compile), a compiled Trainer takes the eager Trainer's steps, and where compiling
is impossible training goes on eagerly after one logged sentence."""

from __future__ import annotations

import logging

import pytest
import torch

from dspark.training.batches import build_batch, global_batch
from dspark.training.compiled import CompiledObjective
from dspark.training.trainer import TrainConfig, TrainData, Trainer, _Objective
from test_training import DRAFTERS, ddp_equals_one_process, frozen_tiny_model, make, tiny_data

pytestmark = pytest.mark.usefixtures("one_thread")
TIGHT = dict(rtol=1e-5, atol=1e-6)  # fp32: inductor may only reorder sums


@pytest.fixture(scope="module")
def model():
    return frozen_tiny_model()


@pytest.fixture(scope="module")
def sequences():
    return tiny_data(8)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch (dynamo's code cache and counters emptied; inductor's
    on-disk cache may still spare the C++ builds)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _batches(data, cfg, layer_ids):
    """Two micro-batches of different padded lengths."""
    out, lengths = [], set()
    for step in range(20):
        b = build_batch(data, cfg, step, global_batch(cfg, step, len(data)), list(range(cfg.seqs_per_step)), layer_ids)
        if b.ids.shape[1] not in lengths:
            out.append(b)
            lengths.add(b.ids.shape[1])
        if len(out) == 2:
            return out
    raise AssertionError("the tiny data gave no two batch lengths")


def _run(fn, drafter, batch):
    """(outputs detached, {name: grad}) of one forward + backward from zero gradients."""
    drafter.zero_grad(set_to_none=True)
    total, nums, den, a_sum, cnt = fn(batch)
    total.backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    return (total.detach(), nums, den, a_sum, cnt), grads


@pytest.mark.parametrize("name", ["dspark-gated", pytest.param("eagle3", marks=pytest.mark.slow)])
def test_compiled_objective_equals_eager(model, sequences, name):
    from torch._dynamo.utils import counters

    seqs, pls = sequences
    d = make(model, name, seqs)
    with torch.no_grad():  # a trained-looking drafter: no zero-initialised weight hides a gradient
        for p in d.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    cfg = TrainConfig.for_kind(DRAFTERS[name][0], seqs_per_step=3, anchors_per_seq=4)
    data = TrainData(seqs, pls, model=model, teacher="full")
    objective = _Objective(d, cfg)
    compiled = CompiledObjective(objective)
    assert not compiled.eager, compiled.why_eager
    for i, batch in enumerate(_batches(data, cfg, d.target_layer_ids)):
        want, want_grads = _run(objective, d, batch)
        # the second length reuses the first length's graphs (dynamic sizes): a recompile fails
        with torch.compiler.set_stance("fail_on_recompile") if i else torch.compiler.set_stance("default"):
            got, got_grads = _run(compiled, d, batch)
        assert counters["stats"]["unique_graphs"] >= 1  # compiled code ran, not a silent eager fallback
        torch.testing.assert_close(got[0], want[0], **TIGHT)
        assert set(got[1]) == set(want[1])
        for key in want[1]:
            torch.testing.assert_close(got[1][key], want[1][key], **TIGHT)
        for g, w in zip(got[2:], want[2:]):
            torch.testing.assert_close(g, w, **TIGHT)
        assert set(got_grads) == set(want_grads) and want_grads
        for n, w in want_grads.items():
            torch.testing.assert_close(got_grads[n], w, **TIGHT, msg=lambda m, n=n: f"{n}: {m}")


def _train(model, sequences, compile, steps=2):
    seqs, pls = sequences
    d = make(model, "dspark-gated", seqs)
    cfg = TrainConfig.for_kind("dspark", steps=steps, seqs_per_step=4, anchors_per_seq=4, lr=3e-3,
                               checkpoint_every=1000, compile=compile)
    trainer = Trainer(d, TrainData(seqs, pls, model=model, teacher="full"), cfg, "unused", progress=False)
    for _ in range(steps):
        trainer.train_step()
    return trainer


@pytest.mark.slow  # a second compile (~40 s on one core)
def test_compiled_trainer_takes_the_eager_steps(model, sequences):
    eager = _train(model, sequences, compile=False)
    compiled = _train(model, sequences, compile=True)
    assert compiled.compiled is not None and not compiled.compiled.eager, compiled.compiled.why_eager
    assert eager.compiled is None
    for a, b in zip(compiled.log, eager.log):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    for (n, p), q in zip(compiled.drafter.named_parameters(), eager.drafter.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def _eager_fallback(model, sequences, caplog, match):
    with caplog.at_level(logging.WARNING, logger="dspark.training.compiled"):
        trainer = _train(model, sequences, compile=True)
    said = [r for r in caplog.records if r.name == "dspark.training.compiled"]
    assert len(said) == 1 and match in said[0].getMessage() and "training runs eager" in said[0].getMessage()
    assert "\n" not in said[0].getMessage()
    assert trainer.compiled.eager and trainer.step == 2
    eager = _train(model, sequences, compile=False)
    for p, q in zip(trainer.drafter.parameters(), eager.drafter.parameters()):
        assert torch.equal(p, q)  # the fallback is the eager path, gradients of the trial dropped


def test_no_compiler_trains_eagerly_after_one_sentence(model, sequences, caplog, monkeypatch):
    import dspark.fast.compile as fc

    def unavailable(device):
        raise fc.CompileUnavailable(f"torch.compile cannot run on {device.type} here (no C++ compiler)")

    monkeypatch.setattr(fc, "check_compiler", unavailable)
    _eager_fallback(model, sequences, caplog, "no C++ compiler")


def test_a_failing_first_compiled_call_trains_eagerly_after_one_sentence(model, sequences, caplog, monkeypatch):
    def broken(fn, **_):
        def call(*args, **kwargs):
            raise RuntimeError("inductor said no\nsecond line")

        return call

    import dspark.fast.compile as fc

    monkeypatch.setattr(fc, "check_compiler", lambda device: None)  # its own torch.compile is not the one failing
    monkeypatch.setattr(torch, "compile", broken)
    _eager_fallback(model, sequences, caplog, "RuntimeError: inductor said no")


def test_compile_must_be_a_bool():
    with pytest.raises(ValueError, match="TrainConfig.compile must be True or False"):
        TrainConfig(compile="yes")


@pytest.mark.slow
def test_ddp_compiled_equals_one_eager_process(tmp_path):
    """torchrun, 2 CPU processes (gloo) with --compile (each compiles the objective inside DDP) ==
    1 eager process."""
    import json

    stderr = ddp_equals_one_process(tmp_path, two_args=("--compile",), steps=3, port=29519)
    assert "training runs eager" not in stderr  # both ranks trained compiled
    assert json.loads((tmp_path / "two" / "train.json").read_text())["train"]["compile"] is True
