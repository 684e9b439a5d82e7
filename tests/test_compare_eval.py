"""scripts/compare_eval.py: per-prompt τ and the paired bootstrap interval, on rounds files whose
answer is known by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rounds(path: Path, prompt, accepted, domain) -> None:
    path.write_text(json.dumps({"prompt": prompt, "accepted": accepted, "domain": domain}))


def _compare(tmp_path: Path, *labels: str):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_eval.py"), str(tmp_path), *labels],
                          capture_output=True, text=True)


def test_compare_eval_by_hand(tmp_path):
    (tmp_path / "rounds").mkdir()
    dom = ["code", "code", "math", "math", "math"]
    # prompt 0 has two rounds, prompt 1 three; τ of a prompt = mean of (accepted + 1)
    _rounds(tmp_path / "rounds" / "a-T0.0.json", [0, 0, 1, 1, 1], [0, 2, 1, 1, 4], dom)  # τ 2.0, 3.0
    _rounds(tmp_path / "rounds" / "b-T0.0.json", [0, 0, 1, 1, 1], [1, 3, 2, 2, 5], dom)  # τ 3.0, 4.0
    out = _compare(tmp_path, "a", "b")
    assert out.returncode == 0, out.stderr
    assert "| code | 1 | 2.000 | 3.000 | +1.000 |" in out.stdout
    assert "| math | 1 | 3.000 | 4.000 | +1.000 |" in out.stdout
    # every per-prompt difference is +1, so every resample's mean and both interval ends are +1
    assert "mean +1.000 τ, bootstrap 95 % interval [+1.000, +1.000] (2 prompts); b ahead on 2, behind on 0" in out.stdout


def test_compare_eval_names_a_missing_run(tmp_path):
    (tmp_path / "rounds").mkdir()
    out = _compare(tmp_path, "a", "b")
    assert out.returncode == 2 and "no rounds file" in out.stderr and "a-T0.0.json" in out.stderr
