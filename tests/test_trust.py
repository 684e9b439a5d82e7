"""Bad input gets one sentence and exit code 2 (user) or 3 (environment), never a traceback and
never a file outside the folder it names (issue: trust with the user's files and runs)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dspark.cli import main as cli_main
from dspark.export.manifest import FORMAT, FORMAT_VERSION, MANIFEST_NAME, ExportError, read_manifest


def _manifest(tmp_path, **fields):
    body = {"format": FORMAT, "format_version": FORMAT_VERSION,
            "graphs": {"backbone": {"file": "backbone.onnx", "sha256": "0" * 64}}, **fields}
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(body))
    return tmp_path


@pytest.mark.parametrize("fields, match", [
    ({"graphs": [{"file": "backbone.onnx"}]}, "graphs must be an object"),
    ({"graphs": {"backbone": {"sha256": "0"}}}, "backbone.file must be a file name"),
    ({"graphs": {"backbone": {"file": "../../../etc/passwd", "sha256": "0"}}}, "inside the export folder"),
    ({"graphs": {"backbone": {"file": "/etc/passwd", "sha256": "0"}}}, "inside the export folder"),
    ({"graphs": {"backbone": {"file": "b.onnx"}}}, "has no sha256"),
    ({"graphs": {"backbone": {"file": "b.onnx", "sha256": "0", "external_data": {"../x": "0"}}}}, "external_data"),
    ({"engines": {"backbone": {"file": "sub/b.plan", "sha256": "0"}}}, "engines.backbone.file"),
    ({"graph_variants": ["fp16"]}, "graph_variants must be an object"),
])
def test_a_hostile_manifest_is_one_sentence(tmp_path, fields, match):
    with pytest.raises(ExportError, match=match) as err:
        read_manifest(_manifest(tmp_path, **fields))
    assert "\n" not in str(err.value)
    read_manifest(_manifest(tmp_path))  # the well-formed one reads


def test_a_manifest_that_is_not_an_object(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text("[1, 2]")
    with pytest.raises(ExportError, match="not a dspark export manifest"):
        read_manifest(tmp_path)


def test_an_opset_the_exporter_cannot_write_is_refused_before_any_load():
    from dspark.export.exporter import check_opset

    with pytest.raises(ExportError, match="opset 999 is newer than the exporter here knows"):
        check_opset(999)
    with pytest.raises(ExportError, match="too old"):
        check_opset(9)
    check_opset(17)


def test_cli_errors_are_one_line_with_their_exit_code(tmp_path, capsys):
    """A user's mistake: 2. With --debug the traceback is shown (the exception propagates)."""
    missing = str(tmp_path / "nope")
    assert cli_main(["convert", "--drafter", missing, "--out", str(tmp_path / "out"), "--to", "speculators"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dspark convert: error:") and err.count("\n") == 1
    with pytest.raises(Exception):  # noqa: B017 - whatever the library raised, unwrapped
        cli_main(["--debug", "convert", "--drafter", missing, "--out", str(tmp_path / "out"), "--to", "speculators"])


def test_a_closed_pipe_is_not_an_error():
    """`dspark plugins --json | head -1`: the reader leaves early; no BrokenPipe trace, exit 0."""
    proc = subprocess.run(f"{sys.executable} -m dspark plugins --json | head -1", shell=True,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "{" and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


@pytest.mark.parametrize("line, match", [
    ('[1, 2, 3]', r"train.jsonl:2: not a dspark data record \(a JSON list, not an object\)"),
    ('{"key": "k", "domain": "chat", "prompt": "p", "prompt_ids": [1], "response_ids": [2, 3], "temperature": "hot"}',
     r"train.jsonl:2: not a dspark data record \(could not convert string to float: 'hot'\)"),
    ('{"key": "k", "domain": "chat", "prompt": "p", "response_ids": [2, 3]}',
     r"train.jsonl:2: not a dspark data record \(field 'prompt_ids' is missing\)"),
])
def test_a_bad_training_record_names_its_file_and_line(tmp_path, line, match):
    from dspark.data.selfdistill import read_records

    good = '{"key": "a", "domain": "chat", "prompt": "p", "prompt_ids": [1, 2], "response_ids": [3, 4]}'
    path = tmp_path / "train.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(ValueError, match=match):
        read_records(path)


def test_token_ids_outside_the_vocabulary_name_the_line(tmp_path):
    from dspark.data.selfdistill import read_records

    path = tmp_path / "train.jsonl"
    path.write_text('{"key": "a", "domain": "chat", "prompt": "p", "prompt_ids": [1, 2], "response_ids": [3, 99]}\n')
    assert len(read_records(path)) == 1  # no vocabulary given: the structure only
    with pytest.raises(ValueError, match=r"train.jsonl:1: token id 99 is outside the target's vocabulary \[0, 32\)"):
        read_records(path, vocab_size=32)


@pytest.mark.parametrize("body", ["not json", "[1]", '{"fit": {}}', '{"fit": [1], "test": 2}'])
def test_calibrate_reuse_rounds_on_a_malformed_file_is_one_sentence(tmp_path, body):
    import dspark

    (tmp_path / "calibration_rounds.json").write_text(body)
    with pytest.raises(ValueError, match=r"--reuse-rounds: .* is not a calibration rounds file .*run without"):
        dspark.calibrate(checkpoint="dspark-5l-xl", out=tmp_path, reuse_rounds=True, quiet=True)


def test_an_hf_folder_with_only_pickle_weights_is_refused_before_loading(tmp_path):
    from dspark.models import load_causal_lm

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00.")
    with pytest.raises(ValueError, match=r"holds no .safetensors weights \(only pytorch_model.bin: pickle files"):
        load_causal_lm(str(tmp_path))


def test_every_command_has_a_one_line_summary_in_dspark_help(capsys):
    from dspark.cli import COMMANDS, SUMMARIES

    assert set(SUMMARIES) == set(COMMANDS), "a command without a summary line, or a summary without a command"
    with pytest.raises(SystemExit):
        cli_main(["--help"])
    out = capsys.readouterr().out
    for name, summary in SUMMARIES.items():
        assert len(summary) <= 72 and "\n" not in summary, name
        assert summary.split()[0] in out, name


def test_every_command_follows_the_one_convention():
    """--target, --drafter NAME|DIR, --out as options (no positional file or model arguments but
    generate's prompts); -v / -q everywhere; --json on every command that reports."""
    from dspark.cli import COMMANDS, build_parser
    from dspark.cli_docs import _subcommands

    for name, sub in _subcommands(build_parser()).items():
        flags = {s for a in sub._actions for s in a.option_strings}
        assert {"-v", "-q"} <= flags, name
        assert ("--json" in flags) == COMMANDS[name].reports, name
        assert not flags & {"--model", "--checkpoint", "--onnx", "--log-level"}, name
        positional = [a.dest for a in sub._actions if not a.option_strings]
        assert positional == (["prompts"] if name == "generate" else []), name


def test_dspark_export_is_a_real_subcommand(tmp_path, capsys):
    """`dspark export` declares the options of python -m dspark.export (once, in dspark.export.cli)
    and fails like it: one line naming the command, exit 2, before any model loads."""
    with pytest.raises(SystemExit):
        cli_main(["export", "--help"])
    out = capsys.readouterr().out
    assert "--out OUT_DIR" in out and "--profile NAME|FILE" in out
    assert cli_main(["export", "--drafter", str(tmp_path / "nope"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope" in err
    assert err.startswith("dspark export: error: ")  # the command the user typed, not the module's name



@pytest.mark.parametrize("entry", ["dspark export", "python -m dspark.export"])
def test_minus_q_silences_notices_and_minus_v_adds_debug_lines(tmp_path, capsys, entry):
    """The export logs its first step (INFO) before the target fails to load, so no model loads:
    -q leaves only the error line; -v adds the dspark command line's DEBUG line of its options."""
    from dspark.export.cli import main as export_main

    main, argv = (cli_main, ["export"]) if entry == "dspark export" else (export_main, [])
    argv += ["--drafter", "dflash", "--out", str(tmp_path / "out"), "--target", str(tmp_path / "no-model")]

    def stderr(*flags):
        assert main([*argv, *flags]) == 2
        return capsys.readouterr().err.splitlines()

    def notices(lines):  # the step's start and its duration
        return [line for line in lines if line.startswith("[1/")]

    def debug(lines):
        return [line for line in lines if line.startswith("dspark export with ")]

    default, quiet, verbose = stderr(), stderr("-q"), stderr("-v")
    assert notices(default)[0].endswith(f"loading target {tmp_path / 'no-model'} …"), default
    assert len(quiet) == 1 and "cannot load target" in quiet[0] and quiet[0] == default[-1]
    assert notices(verbose)[0] == notices(default)[0] and not debug(default)
    if entry == "dspark export":
        (line,) = debug(verbose)
        assert "checkpoint='dflash'" in line and "verbose=1" in line
    assert not (tmp_path / "out").exists()
