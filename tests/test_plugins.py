"""The plugin system: every hook, loud failures, entry points, and the CLI listing."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import pytest
import torch

import dspark
from dspark import plugins
from dspark.hookspecs import hookimpl
from dspark.plugins import EXTENSION_POINTS, PluginError
from dspark.types import DraftBlock


@pytest.fixture
def plugin_module():
    """Register a throw-away plugin module for one test, then unregister it."""
    registered = []

    def _register(**hooks):
        mod = types.ModuleType("dspark_test_plugin")
        for name, fn in hooks.items():
            setattr(mod, name, hookimpl(fn))
        plugins.register(mod, name="test-plugin", version="9.9")
        registered.append(mod)
        return mod

    yield _register
    for mod in registered:
        plugins.unregister(mod)


# Minimal implementations of each protocol ---------------------------------------------------


class EchoDrafter:
    name, gamma, vocab_size = "echo", 2, 5
    target_layer_ids, timings, confidence_model = (), {}, None

    def draft(self, context):
        R = len(context.request_ids)
        tokens = torch.stack([ids[-1:].repeat(2) for ids in context.token_ids])
        q = torch.nn.functional.one_hot(tokens, 5).float()
        return DraftBlock(tokens=tokens, q=q, valid_lengths=torch.full((R,), 2))

    def release(self, request_id):
        pass


class ZeroHead:
    name = "zero"

    def step(self, prev_tokens, hidden, base_logits, state=None):
        return base_logits, state

    def forward(self, prev_tokens, hidden, base_logits):
        return base_logits

    def prev_embedding(self, prev_tokens):
        return torch.zeros(*prev_tokens.shape, 4)


class HalfConfidence:
    name, calibrated = "half", False

    def confidence_logits(self, block):
        return torch.zeros(block.tokens.shape)


class ClampCalibrator:
    name = "clamp"

    def calibrate(self, z):
        return torch.sigmoid(z).clamp(0.1, 0.9)

    def fit(self, z, accepted, verified=None):
        return self

    def to_dict(self):
        return {"name": self.name}

    def save(self, path):
        Path(path).write_text(json.dumps(self.to_dict()))


class FlatCost:
    name, accounting = "flat", "packed"

    def sps(self, B):
        return torch.full(B.shape, 10.0, dtype=torch.float64)

    def step_seconds(self, B):
        return 1 / self.sps(B)

    def batch_size(self, lengths):
        return int(lengths.numel() + lengths.sum())

    def admission_batch_sizes(self, R, positions):
        return R + torch.arange(positions.numel() + 1)


class NoneScheduler:
    name, lossless = "none", True

    def lengths(self, confidence, valid_lengths, cost_model=None):
        return torch.zeros(confidence.shape[0], dtype=torch.long)


def WideDFlash():  # noqa: N802 (a zero-argument factory, registered like a class)
    """A third party's kind: DFlash's module, graphs, round and recipe, 2 draft layers by default."""
    from dspark.drafters.kinds import NeuralKind

    return NeuralKind("wide-dflash", "DFlash with two draft layers", "dspark.drafters.dflash.model:BlockDrafter",
                      defaults={"num_layers": 2}, uses_mask_token=True,
                      train_forward="dspark.drafters.dflash.training:block_forward",
                      train_loss="dspark.drafters.dflash.training:BlockLoss",
                      loss_weights={"lambda_ce": 1.0, "lambda_l1": 0.0, "lambda_conf": 0.0})


IMPLS = {
    "drafters": ("register_drafters", "echo", EchoDrafter, dspark.get_drafter),
    "drafter_kinds": ("register_drafter_kinds", "wide-dflash", WideDFlash, dspark.get_drafter_kind),
    "sequential_heads": ("register_sequential_heads", "zero", ZeroHead, dspark.get_sequential_head),
    "confidence_models": ("register_confidence_models", "half", HalfConfidence, dspark.get_confidence_model),
    "calibrators": ("register_calibrators", "clamp", ClampCalibrator, dspark.get_calibrator),
    "cost_models": ("register_cost_models", "flat", FlatCost, dspark.get_cost_model),
    "schedulers": ("register_schedulers", "none", NoneScheduler, dspark.get_scheduler),
}


def test_every_extension_point_has_a_test_implementation():
    assert set(IMPLS) == set(EXTENSION_POINTS)


@pytest.mark.parametrize("kind", sorted(IMPLS))
def test_each_hook_registers_lists_and_builds(kind, plugin_module):
    hook, name, cls, getter = IMPLS[kind]

    def impl(register):
        register(name, cls, description="from the test plugin")

    impl.__name__ = hook
    plugin_module(**{hook: impl})
    obj = getter(name)
    assert isinstance(obj, EXTENSION_POINTS[kind].protocol)
    row = next(r for r in dspark.list_plugins() if r["kind"] == kind and r["name"] == name)
    assert row == {"kind": kind, "name": name, "plugin": "test-plugin", "distribution": None,  # registered at run time
                   "version": "9.9", "description": "from the test plugin"}


def test_unregister_removes_the_names(plugin_module):
    def register_schedulers(register):
        register("none", NoneScheduler)

    mod = plugin_module(register_schedulers=register_schedulers)
    assert dspark.get_scheduler("none")
    plugins.unregister(mod)
    with pytest.raises(ValueError, match="unknown scheduler 'none'"):
        dspark.get_scheduler("none")
    plugins.register(mod, name="test-plugin")  # the fixture unregisters it again


def test_misspelled_hook_fails_loudly_and_suggests(plugin_module):
    def register_shedulers(register):
        register("none", NoneScheduler)

    with pytest.raises(PluginError, match="unknown hook 'register_shedulers'.*did you mean 'register_schedulers'"):
        plugin_module(register_shedulers=register_shedulers)
    assert not plugins.get_plugin_manager().has_plugin("test-plugin")


def test_duplicate_name_names_both_plugins(plugin_module):
    def register_schedulers(register):
        register("sps-greedy", NoneScheduler)

    with pytest.raises(PluginError, match="scheduler 'sps-greedy' is registered twice: by plugin 'dspark' and by plugin 'test-plugin'"):
        plugin_module(register_schedulers=register_schedulers)
    assert dspark.get_scheduler("sps-greedy").name == "sps-greedy"  # registry intact


def test_object_not_satisfying_the_protocol(plugin_module):
    class NotAScheduler:
        name = "bad"

    def register_schedulers(register):
        register("bad", NotAScheduler)

    with pytest.raises(PluginError, match="plugin 'test-plugin' registered scheduler 'bad'.*Scheduler protocol.*missing: lengths"):
        plugin_module(register_schedulers=register_schedulers)


def test_factory_returning_a_non_conforming_object(plugin_module):
    def register_cost_models(register):
        register("liar", lambda **kw: object())

    plugin_module(register_cost_models=register_cost_models)
    with pytest.raises(PluginError, match="cost model 'liar' from plugin 'test-plugin'.*CostModel protocol"):
        dspark.get_cost_model("liar")


def test_plugin_raising_while_registering(plugin_module):
    def register_calibrators(register):
        raise RuntimeError("boom")

    with pytest.raises(PluginError, match="plugin 'test-plugin' failed in register_calibrators: RuntimeError: boom"):
        plugin_module(register_calibrators=register_calibrators)


def test_bad_name_rejected(plugin_module):
    def register_schedulers(register):
        register("Bad Name", NoneScheduler)

    with pytest.raises(PluginError, match="names must be lowercase"):
        plugin_module(register_schedulers=register_schedulers)


def test_entry_point_plugin_is_loaded_and_can_be_disabled(monkeypatch):
    """The examples/plugins/dspark-budget package is installed (CI installs it) and found by entry point."""
    rows = {(r["kind"], r["name"]): r for r in dspark.list_plugins()}
    assert rows[("schedulers", "token-budget")]["plugin"] == "budget"
    assert rows[("schedulers", "token-budget")]["version"] == "0.1.0"
    assert rows[("cost_models", "affine")]["plugin"] == "budget"
    sched = dspark.get_scheduler("token-budget", max_tokens=6)
    c = torch.tensor([[0.9, 0.8, 0.7], [0.95, 0.1, 0.1]])
    s = sched.schedule(c, cost_model=dspark.get_cost_model("affine"))
    assert s.batch_size <= 6 and s.lengths.tolist() == [3, 1]
    try:
        for value in ("1", "budget"):
            monkeypatch.setenv("DSPARK_DISABLE_PLUGINS", value)
            plugins.reset()
            names = {r["name"] for r in dspark.list_plugins()}
            assert "token-budget" not in names and "sps-greedy" in names
            # asking for a disabled plugin's name says the plugins are disabled
            with pytest.raises(ValueError, match="disabled by DSPARK_DISABLE_PLUGINS: .*budget"):
                dspark.get_scheduler("token-budget")
        # a misspelled name is an error, not silently ignored (the plugin it meant stays enabled)
        monkeypatch.setenv("DSPARK_DISABLE_PLUGINS", "bugdet")
        plugins.reset()
        with pytest.raises(PluginError, match="names 'bugdet', which is no installed plugin.*did you mean 'budget'"):
            dspark.list_plugins()
    finally:
        monkeypatch.delenv("DSPARK_DISABLE_PLUGINS")
        plugins.reset()


def test_entry_point_that_fails_to_load_names_the_plugin(monkeypatch):
    import importlib.metadata as md

    broken = md.EntryPoint(name="broken", value="dspark_no_such_module", group="dspark")
    real = md.entry_points
    monkeypatch.setattr(md, "entry_points", lambda group=None: [broken] if group == "dspark" else real(group=group))
    plugins.reset()
    try:
        with pytest.raises(PluginError, match=r"plugin 'broken' \(dspark_no_such_module\) failed to load.*DSPARK_DISABLE_PLUGINS=broken"):
            dspark.list_plugins()
    finally:
        monkeypatch.undo()
        plugins.reset()


def test_cli_lists_every_builtin_and_the_plugin_package(capsys):
    from dspark.cli import main

    assert main(["plugins", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["plugins"]  # one JSON object
    got = {(r["kind"], r["name"]) for r in rows}
    for expected in [("schedulers", "sps-greedy"), ("schedulers", "full"), ("schedulers", "fixed"),
                     ("schedulers", "threshold"), ("schedulers", "sps-argmax"),
                     ("cost_models", "sps-table"), ("cost_models", "roofline"),
                     ("calibrators", "sts"), ("calibrators", "temperature"), ("calibrators", "identity"),
                     ("confidence_models", "max-prob"), ("drafters", "ngram"),
                     ("schedulers", "token-budget"), ("cost_models", "affine")]:
        assert expected in got
    # each row names the distribution that installed it: dspark itself, or the plugin's package
    budget = next(r for r in rows if r["name"] == "token-budget")
    assert budget["distribution"] and budget["distribution"] != "dspark"
    assert {r["distribution"] for r in rows if r["plugin"] == "dspark"} == {"dspark"}
    assert main(["plugins"]) == 0
    listing = capsys.readouterr().out
    assert "token-budget" in listing and f"from {budget['distribution']}" in listing


def test_hooks_doc_lists_every_hook_and_builtin():
    """docs/plugins.md documents every hook and every built-in name; this keeps it in sync."""
    doc = (Path(__file__).parents[1] / "docs" / "plugins.md").read_text()
    documented_hooks = set(re.findall(r"^### `(register_[a-z_]+)`", doc, flags=re.M))
    assert documented_hooks == {p.hook for p in EXTENSION_POINTS.values()}
    for row in dspark.list_plugins():
        if row["plugin"] == "dspark":
            assert f"`{row['name']}`" in doc, f"docs/plugins.md does not mention {row['kind']} {row['name']!r}"



def test_a_bad_option_is_one_sentence_without_attrs_internals():
    with pytest.raises(ValueError) as err:
        dspark.get_scheduler("threshold", mode="bogus")
    assert str(err.value) == ("scheduler 'threshold' (plugin 'dspark'): 'mode' must be in ('step', 'survival') "
                              "(got 'bogus')")



def test_specific_errors_keep_their_type_through_the_registry(tmp_path):
    from dspark.cost_models import ProfileError

    bad = tmp_path / "p.json"
    bad.write_text('{"points": []}')
    with pytest.raises(ProfileError, match="cost model 'sps-table'"):
        dspark.get_cost_model("sps-table", profile=bad)


def test_a_plugin_drafter_kind_drafts_trains_and_is_lossless(plugin_module):
    """A kind registered by a plugin goes through the same config rules, drafting loop and
    training recipe as the built-ins: its drafter's greedy output equals the target's."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from dspark.builtins import neural_drafter_factory
    from dspark.targets import HFTarget
    from dspark.training.trainer import TrainConfig

    def register_drafter_kinds(register):
        register("wide-dflash", WideDFlash)

    def register_drafters(register):
        register("wide-dflash", neural_drafter_factory("wide-dflash"))

    plugin_module(register_drafter_kinds=register_drafter_kinds, register_drafters=register_drafters)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128)
    target = HFTarget(AutoModelForCausalLM.from_config(cfg).eval())
    drafter = dspark.get_drafter("wide-dflash", target=target, gamma=3)
    assert drafter.config.kind == "wide-dflash" and drafter.config.num_layers == 2
    assert drafter.config.mask_token_id == 63  # the kind's rule: the last vocabulary id
    assert TrainConfig.for_kind("wide-dflash").lambda_ce == 1.0
    with pytest.raises(ValueError, match="wide-dflash has no sequential head"):
        dspark.get_drafter("wide-dflash", target=target, head="gated-markov")
    prompt = torch.tensor([1, 5, 9, 2, 7])
    plain = target.model.generate(prompt[None], max_new_tokens=12, do_sample=False)[0, 5:].tolist()
    out = dspark.Engine(target, drafter, scheduler="full").generate([prompt], max_new_tokens=12, progress=False)
    assert out[0].output_ids == plain


def test_unknown_drafter_kind_names_the_known_ones():
    from dspark.drafters.config import DrafterConfig

    with pytest.raises(ValueError, match="unknown drafter kind 'dspak'; known: dflash, dspark, eagle3"):
        DrafterConfig(kind="dspak", vocab_size=64, layer=dict(hidden_size=32, num_heads=4, num_kv_heads=2,
                      head_dim=8, intermediate_size=64), target=dict(name="t", vocab_size=64, hidden_size=32,
                      num_layers=4), target_layer_ids=(1,))
