"""The draft round's memory-traffic floor (``NeuralDrafter.round_weight_bytes``, ``dspark profile
--drafter``): the bytes of weights every drafting round reads at least once.

The oracle watches real rounds: every aten product (mm, addmm, bmm, ...) the drafter runs while it
drafts, recorded with a dispatch mode, and the drafter's tensors among their operands. The weights
that every round multiplied by are the floor, less what a kind declares a round may skip
(``round_may_skip``: DSpark's cached Markov-head rows).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import dspark
from dspark.engine import Engine
from dspark.profiling import distinct_bytes
from dspark.targets import HFTarget
from dspark.types import SamplingParams
from helpers import tiny_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = {
    "dspark-gated": dict(kind="dspark", num_layers=2, gamma=4, rank=16, head="gated-markov"),
    "dspark-rnn": dict(kind="dspark", num_layers=1, gamma=4, rank=16, head="rnn"),
    "dflash": dict(kind="dflash", num_layers=2, gamma=4),
    "eagle3": dict(kind="eagle3", gamma=4),
    "dspark-dv": dict(kind="dspark", num_layers=1, gamma=4, rank=16, head="vanilla-markov", draft_vocab_size=41),
}
PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "mv", "matmul", "linear", "_linear_pointwise"}


class ProductOperands(TorchDispatchMode):
    """The storages of every tensor operand of the products run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in PRODUCTS:
            for a in tree_leaves((args, kwargs or {})):
                if isinstance(a, torch.Tensor):
                    self.storages.add(a.untyped_storage().data_ptr())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", sorted(KINDS))
def test_the_round_floor_is_what_every_round_multiplies_by(name):
    target = HFTarget(tiny_causal_lm(vocab_size=64, max_positions=96, tied=name.endswith("dv")))
    cfg = dict(KINDS[name])
    torch.manual_seed(1)
    drafter = dspark.get_drafter(cfg.pop("kind"), target=target, **cfg)
    rounds: list[set[int]] = []
    draft = drafter.draft

    def watched(context):
        with ProductOperands() as seen:
            block = draft(context)
        rounds.append(seen.storages)
        return block

    drafter.draft = watched
    engine = Engine(target, drafter, scheduler=dspark.get_scheduler("fixed", k=2), cost_model=None)
    engine.generate([torch.tensor([3, 9, 4, 1, 7])], SamplingParams.greedy(), max_new_tokens=12, progress=False)
    assert len(rounds) >= 3
    every = set.intersection(*rounds)
    tensors = list(drafter.parameters()) + [drafter._lm_head, drafter._embed]
    skipped = {id(p) for m in drafter.round_may_skip for p in getattr(drafter, m).parameters()}
    # matrices only: a product's bias is a vector of a few bytes, as are the norms the floor leaves out
    read = [t for t in tensors if t.ndim >= 2 and t.untyped_storage().data_ptr() in every and id(t) not in skipped]
    assert read, "no weight seen in a product: the oracle watches nothing"
    assert drafter.round_weight_bytes() == distinct_bytes(read)


def test_profile_reports_the_draft_round_floor(tmp_path, capsys):
    """`dspark profile --drafter` on a tiny target folder and a saved tiny drafter: the floor is in
    the report, in bytes the drafter counts, over the bandwidth the step's floor measured."""
    import json

    from dspark.cli import main
    from dspark.drafters.checkpoint import save_pretrained
    from helpers import save_tiny_target

    model = tiny_causal_lm(num_layers=2, init_range=0.02, keep_eos=True)
    save_tiny_target(tmp_path / "tiny", model)
    drafter = dspark.get_drafter("dflash", target=HFTarget(model), num_layers=1, gamma=3)
    save_pretrained(drafter, tmp_path / "drafter")
    out = tmp_path / "p.json"
    assert main(["profile", "--target", str(tmp_path / "tiny"), "--out", str(out), "--requests", "1",
                 "--widths", "1,4", "--contexts", "16", "--repeats", "2", "--quiet",
                 "--drafter", str(tmp_path / "drafter")]) == 0
    report = json.loads(out.with_suffix(".floor.json").read_text())
    floor = report["draft_traffic_floor"]
    assert floor["weight_bytes"] == drafter.round_weight_bytes() > 0
    assert floor["bandwidth_bytes_per_second"] == report["traffic_floor"]["bandwidth_bytes_per_second"]
    assert floor["floor_seconds"] == pytest.approx(floor["weight_bytes"] / floor["bandwidth_bytes_per_second"])
    assert set(report["draft_round_seconds"]) == {"1"}
    assert "draft round floor" in capsys.readouterr().out


def test_a_misspelled_skip_fails_loudly_and_an_absent_part_is_nothing_to_skip(monkeypatch):
    target = HFTarget(tiny_causal_lm(vocab_size=64, max_positions=96))
    headless = dspark.get_drafter("dspark", target=target, num_layers=1, gamma=4, head=None, confidence=False)
    assert headless.head is None and headless.round_weight_bytes() > 0
    monkeypatch.setattr(type(headless), "round_may_skip", ("haed",))
    with pytest.raises(AttributeError, match="names 'haed'"):
        headless.round_weight_bytes()
