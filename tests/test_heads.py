"""Sequential heads and the confidence head (dspark.heads): teacher forcing, identity init, export."""

from __future__ import annotations

import inspect

import pytest
import torch

import dspark
from dspark.heads import (
    HEAD_KINDS,
    ConfidenceHead,
    GatedMarkovHead,
    HeadConfig,
    RNNHead,
    VanillaMarkovHead,
    build_head,
)

V, D, RANK, R, GAMMA = 50, 12, 8, 3, 5


def _inputs(seed: int = 0, gamma: int = GAMMA):
    g = torch.Generator().manual_seed(seed)
    prev = torch.randint(0, V, (R, gamma), generator=g)  # [R, γ]
    hidden = torch.randn(R, gamma, D, generator=g)  # [R, γ, d]
    base = torch.randn(R, gamma, V, generator=g)  # [R, γ, V]
    return prev, hidden, base


def _head(kind: str, seed: int = 0, randomise_up: bool = True):
    torch.manual_seed(seed)
    head = build_head(kind, V, D, RANK)
    if randomise_up:
        with torch.no_grad():
            head.w_up.weight.normal_()
    return head


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_forward_equals_looped_step(kind):
    head = _head(kind)
    prev, hidden, base = _inputs()
    with torch.no_grad():
        full = head(prev, hidden, base)  # [R, γ, V]
        state, steps = None, []
        for j in range(GAMMA):
            logits, state = head.step(prev[:, j], hidden[:, j], base[:, j], state)
            steps.append(logits)
            if kind == "rnn":
                assert state.shape == (R, RANK)
            else:
                assert state is None
    assert full.shape == (R, GAMMA, V)
    torch.testing.assert_close(full, torch.stack(steps, dim=1), rtol=1e-5, atol=1e-5)


def test_rnn_state_threads_through_positions():
    head = _head("rnn")
    prev, hidden, base = _inputs()
    with torch.no_grad():
        full = head(prev, hidden, base)
        # Position 2 from a fresh s_0 differs from position 2 after s_1: the state matters.
        fresh, _ = head.step(prev[:, 1], hidden[:, 1], base[:, 1])
        explicit, _ = head.step(prev[:, 0], hidden[:, 0], base[:, 0], torch.zeros(R, RANK))
        implicit, _ = head.step(prev[:, 0], hidden[:, 0], base[:, 0])
    assert not torch.allclose(fresh, full[:, 1])
    torch.testing.assert_close(explicit, implicit, rtol=0, atol=0)


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_zero_initialised_up_projection_is_identity(kind):
    head = _head(kind, randomise_up=False)
    assert torch.count_nonzero(head.w_up.weight) == 0
    prev, hidden, base = _inputs()
    with torch.no_grad():
        assert torch.equal(head(prev, hidden, base), base)
        logits, _ = head.step(prev[:, 0], hidden[:, 0], base[:, 0])
    assert torch.equal(logits, base[:, 0])


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_output_depends_on_previous_token(kind):
    head = _head(kind)
    prev, hidden, base = _inputs()
    other = (prev + 1) % V
    with torch.no_grad():
        assert not torch.allclose(head(prev, hidden, base), head(other, hidden, base))


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_dependence_on_hidden_state(kind):
    head = _head(kind)
    prev, hidden, base = _inputs()
    with torch.no_grad():
        same = torch.allclose(head(prev, hidden, base), head(prev, hidden + 1.0, base))
    assert same == (kind in ("vanilla-markov", "silu-markov"))  # the Markov heads read only x̂_{j−1}


def test_bf16_base_logits_keep_their_dtype():
    head = _head("gated-markov")
    prev, hidden, base = _inputs()
    with torch.no_grad():
        out = head(prev, hidden.bfloat16(), base.bfloat16())
    assert out.dtype == torch.bfloat16


def test_forward_rejects_mismatched_shapes():
    head = _head("vanilla-markov")
    prev, hidden, base = _inputs()
    with pytest.raises(ValueError, match=r"hidden \[R, γ, d=12\]"):
        head(prev, hidden[..., :-1], base)


def test_prev_embedding_and_confidence_head():
    head = _head("gated-markov")
    prev, hidden, _ = _inputs()
    emb = head.prev_embedding(prev)
    assert emb.shape == (R, GAMMA, RANK)
    assert torch.equal(emb, head.w_down.weight[prev])
    conf = ConfidenceHead(D, RANK)
    logits = conf(hidden, emb)
    assert logits.shape == (R, GAMMA)
    assert conf(hidden[:, 0], emb[:, 0]).shape == (R,)
    assert conf.num_parameters() == D + RANK + 1


def test_confidence_head_cannot_read_the_draft_token():
    # Stopping-rule property: the logit at j reads h_j and x̂_{j-1} only, never x̂_j.
    params = list(inspect.signature(ConfidenceHead.forward).parameters)
    assert params == ["self", "hidden", "prev_emb"]
    conf = ConfidenceHead(D, RANK)
    prev, hidden, _ = _inputs()
    emb = _head("rnn").prev_embedding(prev)
    with pytest.raises(TypeError):
        conf(hidden, emb, prev)  # no slot for x̂_j
    with pytest.raises(ValueError, match="rank must be a positive int"):
        ConfidenceHead(D, 0)


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_registered_by_name_and_protocol_conforming(kind):
    head = dspark.get_sequential_head(kind, vocab_size=V, hidden_size=D)
    assert isinstance(head, dspark.SequentialHead)
    assert head.name == kind
    assert head.config == HeadConfig(kind, V, D, 256)
    assert type(head).from_config(head.config).config == head.config


def test_parameter_counts():
    emb_up = 2 * V * RANK
    assert VanillaMarkovHead(V, D, RANK).num_parameters() == emb_up
    assert GatedMarkovHead(V, D, RANK).num_parameters() == emb_up + (D + RANK) * RANK + RANK
    assert RNNHead(V, D, RANK).num_parameters() == emb_up + (2 * RANK + D) * 3 * RANK + 3 * RANK


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "rnn", "vocab_size": V, "hidden_size": D, "rank": 0}, "rank must be a positive int"),
        ({"kind": "rnn", "vocab_size": V, "hidden_size": D, "rank": -3}, "rank must be a positive int"),
        ({"kind": "rnn", "vocab_size": 0, "hidden_size": D}, "vocab_size must be a positive int"),
        ({"kind": "rnn", "vocab_size": V, "hidden_size": 2.0}, "hidden_size must be a positive int"),
        ({"kind": "lstm", "vocab_size": V, "hidden_size": D}, "unknown sequential head kind 'lstm'"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HeadConfig(**kwargs)
    with pytest.raises(ValueError, match=message):
        build_head(**kwargs)


def test_config_validation_through_registry_and_from_config():
    with pytest.raises(ValueError, match="rank must be a positive int"):
        dspark.get_sequential_head("rnn", vocab_size=V, hidden_size=D, rank=0)
    with pytest.raises(ValueError, match="is kind 'rnn', config says 'gated-markov'"):
        RNNHead.from_config(HeadConfig("gated-markov", V, D))


class _Step(torch.nn.Module):
    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, prev, hidden, base, state):
        return self.head.step(prev, hidden, base, state)


def _step_args(kind, batch, seed=0, with_state=False):
    prev, hidden, base = (t[:batch, 0] for t in _inputs(seed))
    state = torch.zeros(batch, RANK) if with_state else None
    return prev, hidden, base, state


@pytest.mark.parametrize(
    ("kind", "with_state"),
    [("vanilla-markov", False), ("gated-markov", False), ("rnn", False), ("rnn", True)],
)
def test_step_exports_with_dynamic_batch(kind, with_state):
    head = _head(kind).eval()
    batch = torch.export.Dim("R", min=1, max=4096)
    shapes = ({0: batch}, {0: batch}, {0: batch}, {0: batch} if with_state else None)
    ep = torch.export.export(
        _Step(head), _step_args(kind, 3, with_state=with_state), dynamic_shapes=shapes
    )
    with torch.no_grad():
        for size, seed in ((3, 0), (2, 1)):  # another batch size than exported with
            args = _step_args(kind, size, seed, with_state)
            got, got_state = ep.module()(*args)
            want, want_state = head.step(*args)
            torch.testing.assert_close(got, want)
            if kind == "rnn":
                torch.testing.assert_close(got_state, want_state)
            else:
                assert got_state is None


@pytest.mark.filterwarnings("ignore:`torch.jit.trace.*:DeprecationWarning")
def test_rnn_step_jit_traces_with_explicit_state():
    head = _head("rnn").eval()
    with torch.no_grad():
        traced = torch.jit.trace(_Step(head), _step_args("rnn", 3, with_state=True))
        args = _step_args("rnn", 2, seed=1, with_state=True)
        for got, want in zip(traced(*args), head.step(*args)):
            torch.testing.assert_close(got, want)
