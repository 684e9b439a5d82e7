"""`dspark export-target`: a target written as a plain HF folder (config with architectures,
safetensors weights, tokenizer and chat template, generation config) that transformers loads with
identical logits, written all or nothing into a folder dspark may replace (dspark.outdir). The real
GGUF-loaded SmolLM2 is tested in tests/test_interop_speculators.py (slow)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dspark.cli import main as cli_main
from dspark.models import export_hf_folder, load_causal_lm
from helpers import save_tiny_target, tiny_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def src(tmp_path):
    return save_tiny_target(tmp_path / "src", tiny_causal_lm("llama", vocab_size=64, max_positions=64))


def _logits(model, ids):
    with torch.inference_mode():
        return model(ids).logits


def test_export_target_loads_with_identical_logits(src, tmp_path, capsys):
    out = tmp_path / "hf"
    assert cli_main(["export-target", "--target", str(src), "--out", str(out)]) == 0
    assert "HF folder" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert (out / "model.safetensors").is_file() and (out / "generation_config.json").is_file()
    assert (out / ".dspark-output").is_file()
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    mine, _ = load_causal_lm(str(src))
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert torch.equal(_logits(theirs, ids), _logits(mine, ids))
    assert AutoTokenizer.from_pretrained(out)("t3 t5")["input_ids"] == [3, 5]


def test_architectures_come_from_the_model_class_and_the_chat_template_travels(src, tmp_path):
    """A GGUF-loaded model's config has ``architectures`` None: the class names it."""
    model, tok = load_causal_lm(str(src))
    model.config.architectures = None
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    out = export_hf_folder(model, tok, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert AutoTokenizer.from_pretrained(out).chat_template == tok.chat_template


def test_export_target_never_replaces_a_folder_dspark_did_not_write(src, tmp_path, capsys):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep")
    rc = cli_main(["export-target", "--target", str(src), "--out", str(user), "--overwrite"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "not written by dspark" in err
    assert [p.name for p in user.iterdir()] == ["notes.txt"]
    out = tmp_path / "hf"
    assert cli_main(["export-target", "--target", str(src), "--out", str(out)]) == 0
    assert cli_main(["export-target", "--target", str(src), "--out", str(out)]) == 2  # exists: only with --overwrite
    assert cli_main(["export-target", "--target", str(src), "--out", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mine", "src"]  # nothing left beside it
    rc = cli_main(["export-target", "--target", str(src), "--out", str(src), "--overwrite"])
    assert rc == 2 and "input" in capsys.readouterr().err
