"""A battery of hostile and careless inputs: prints ``clear`` or ``defect`` per case.

    python scripts/bad_inputs.py            # every case, on a tiny target built in a temporary folder
    python scripts/bad_inputs.py -k convert # the cases whose name contains "convert"

A case is clear when the command ends in one sentence with exit code 2 or 3 (no traceback), deletes
nothing it did not write, and reuses no cache or resume made from other inputs. Each case is a few
lines below; the same behaviours are pinned by tests (tests/test_trust.py, tests/test_formats.py,
tests/test_api.py, tests/test_training.py, tests/test_engine.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "reference-drafters"  # the golden reference fixtures, as the tests read them
CASES: dict[str, Callable[[Path], tuple[bool, str]]] = {}


def case(fn: Callable[[Path], tuple[bool, str]]) -> Callable[[Path], tuple[bool, str]]:
    CASES[fn.__name__] = fn
    return fn


def dspark(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dspark", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


def one_sentence(proc: subprocess.CompletedProcess, codes: tuple[int, ...] = (2, 3)) -> tuple[bool, str]:
    err = proc.stderr.strip()
    ok = proc.returncode in codes and "Traceback" not in proc.stderr and err.count("\n") == 0 and bool(err)
    return ok, f"rc {proc.returncode}: {err.splitlines()[-1][:160] if err else '(nothing on stderr)'}"


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def fixture(name: str) -> Path:
    return FIXTURES / name


def user_folder(tmp: Path) -> Path:
    root = tmp / "work"
    shutil.copytree(fixture("deepspec-dspark-vanilla"), root / "ckpt")
    (root / "notes.txt").write_text("mine")
    (root / "data").mkdir()
    (root / "data" / "train.jsonl").write_text("{}\n")
    return root


@case
def convert_overwrite_into_the_parent_of_src(tmp: Path) -> tuple[bool, str]:
    root = user_folder(tmp)
    before = tree(root)
    ok, why = one_sentence(dspark("convert", "--drafter", str(root / "ckpt"), "--out", str(root), "--to", "speculators", "--overwrite"))
    return ok and tree(root) == before, why


@case
def convert_overwrite_into_the_current_folder(tmp: Path) -> tuple[bool, str]:
    root = user_folder(tmp)
    before = tree(root)
    ok, why = one_sentence(dspark("convert", "--drafter", "ckpt", "--out", ".", "--to", "speculators", "--overwrite", cwd=root))
    return ok and tree(root) == before, why


@case
def convert_overwrite_into_a_users_folder(tmp: Path) -> tuple[bool, str]:
    root = user_folder(tmp)
    before = tree(root)
    ok, why = one_sentence(dspark("convert", "--drafter", str(root / "ckpt"), "--out", str(root / "data"), "--to", "speculators",
                                  "--overwrite"))
    return ok and tree(root) == before, why


def edited_checkpoint(tmp: Path, config=None, weights=None) -> Path:
    from safetensors.torch import load_file, save_file

    src = tmp / "edited"
    shutil.copytree(fixture("deepspec-dflash"), src)
    if config:
        cfg = json.loads((src / "config.json").read_text())
        config(cfg)
        (src / "config.json").write_text(json.dumps(cfg))
    if weights:
        st = load_file(str(src / "model.safetensors"))
        weights(st)
        save_file(st, str(src / "model.safetensors"), metadata={"format": "pt"})
    return src


def _a_layer_key(st: dict) -> str:
    return next(k for k in sorted(st) if "layers" in k and k.endswith(".weight"))


@case
def convert_a_checkpoint_missing_a_tensor(tmp: Path) -> tuple[bool, str]:
    src = edited_checkpoint(tmp, weights=lambda st: st.pop(_a_layer_key(st)))
    return one_sentence(dspark("convert", "--drafter", str(src), "--out", str(tmp / "out"), "--to", "speculators"))


@case
def convert_a_checkpoint_with_int32_weights(tmp: Path) -> tuple[bool, str]:
    import torch

    def int32(st: dict) -> None:
        k = _a_layer_key(st)
        st[k] = st[k].to(torch.int32)

    src = edited_checkpoint(tmp, weights=int32)
    return one_sentence(dspark("convert", "--drafter", str(src), "--out", str(tmp / "out"), "--to", "speculators"))


@case
def convert_a_config_with_a_hostile_size(tmp: Path) -> tuple[bool, str]:
    src = edited_checkpoint(tmp, config=lambda cfg: cfg.update(intermediate_size=10**9, hidden_size=10**9))
    return one_sentence(dspark("convert", "--drafter", str(src), "--out", str(tmp / "out"), "--to", "speculators"))


@case
def export_opset_999(tmp: Path) -> tuple[bool, str]:
    proc = subprocess.run([sys.executable, "-m", "dspark.export", "--help"], capture_output=True, text=True)
    if "--opset" not in proc.stdout:
        return False, "python -m dspark.export has no --opset"
    from dspark.export.exporter import check_opset
    from dspark.export.manifest import ExportError

    try:
        check_opset(999)
    except ExportError as err:
        return "\n" not in str(err), str(err)
    return False, "opset 999 accepted"


def manifest_case(tmp: Path, graphs) -> tuple[bool, str]:
    from dspark.export.manifest import FORMAT, MANIFEST_NAME, ExportError, read_manifest

    (tmp / MANIFEST_NAME).write_text(json.dumps({"format": FORMAT, "format_version": 1, "graphs": graphs}))
    try:
        read_manifest(tmp)
    except ExportError as err:
        return "\n" not in str(err), str(err)[:160]
    except Exception as err:  # noqa: BLE001 - what the battery looks for
        return False, f"raw {type(err).__name__}: {err}"
    return False, "accepted"


@case
def manifest_with_graphs_as_a_list(tmp: Path) -> tuple[bool, str]:
    return manifest_case(tmp, [{"file": "a.onnx"}])


@case
def manifest_with_a_file_outside_the_folder(tmp: Path) -> tuple[bool, str]:
    return manifest_case(tmp, {"backbone": {"file": "../../../etc/passwd", "sha256": "0"}})


def data_line(tmp: Path, line: str) -> tuple[bool, str]:
    from dspark.data.selfdistill import read_records

    path = tmp / "train.jsonl"
    path.write_text(line + "\n")
    try:
        read_records(path, vocab_size=32)
    except ValueError as err:
        return str(err).startswith(f"{path}:1:"), str(err)[:160]
    except Exception as err:  # noqa: BLE001
        return False, f"raw {type(err).__name__}: {err}"
    return False, "accepted"


@case
def train_jsonl_line_that_is_a_list(tmp: Path) -> tuple[bool, str]:
    return data_line(tmp, "[1, 2, 3]")


@case
def train_jsonl_temperature_hot(tmp: Path) -> tuple[bool, str]:
    return data_line(tmp, '{"key": "k", "domain": "d", "prompt": "p", "prompt_ids": [1], "response_ids": [2, 3], '
                          '"temperature": "hot"}')


@case
def train_jsonl_ids_outside_the_vocabulary(tmp: Path) -> tuple[bool, str]:
    return data_line(tmp, '{"key": "k", "domain": "d", "prompt": "p", "prompt_ids": [1], "response_ids": [2, 99]}')


@case
def hf_folder_with_only_a_pickle(tmp: Path) -> tuple[bool, str]:
    (tmp / "m").mkdir()
    (tmp / "m" / "config.json").write_text('{"model_type": "llama"}')
    (tmp / "m" / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")
    return one_sentence(dspark("profile", "--target", str(tmp / "m"), "--out", str(tmp / "p.json")))


@case
def plugins_json_into_a_closed_pipe(tmp: Path) -> tuple[bool, str]:
    proc = subprocess.run(f"{sys.executable} -m dspark plugins --json | head -1", shell=True, capture_output=True,
                          text=True, timeout=120)
    return "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr.strip()[:160] or "quiet"


@case
def generate_with_a_missing_checkpoint(tmp: Path) -> tuple[bool, str]:
    return one_sentence(dspark("generate", "hi", "--drafter", str(tmp / "nope")))


@case
def generate_with_an_unknown_scheduler(tmp: Path) -> tuple[bool, str]:
    return one_sentence(dspark("generate", "hi", "--scheduler", "sps-argmaks"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-k", default="", help="run only the cases whose name contains this")
    args = p.parse_args(argv)
    defects = 0
    for name, fn in CASES.items():
        if args.k not in name:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            try:
                ok, why = fn(Path(tmp))
            except Exception as err:  # noqa: BLE001 - a case that crashes is a defect of the battery's subject
                ok, why = False, f"raised {type(err).__name__}: {err}"
        defects += not ok
        print(f"{'clear ' if ok else 'DEFECT'}  {name:<48} {why}", flush=True)
    print(f"{defects} defect(s)")
    return 1 if defects else 0


if __name__ == "__main__":
    sys.exit(main())
