"""The target step on each path (eager HF forward, dspark's packed step, compiled) side by side:
step times for R requests × q tokens, the memory-traffic floor, fp32 greedy identity.

    python scripts/step_paths.py --out reports/step_paths                       # CPU, the real target
    python scripts/step_paths.py --device cuda --shape-only --out DIR           # a GPU, no weights needed

``--shape-only`` builds a randomly initialised model of the target's shape (SmolLM2-135M: 30
layers, d = 576, 9 query / 3 K/V heads, vocabulary 49152, tied embeddings): step times depend on
shapes only, so a machine without the weights measures the same thing. The identity check then
compares each path's greedy decode with HF ``generate`` on that random model.

For each path the verification step of one request (and of R requests) over ``--context`` tokens
is timed for every q of ``--widths`` (median of ``--repeats`` after a warm-up); compiling is
timed separately. Writes ``step_paths.json`` and ``step_paths.md`` (the table it prints).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger("step_paths")

SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                     rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


def shaped_model(dtype: torch.dtype, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SMOLLM2_SHAPE, initializer_range=0.02)
    return LlamaForCausalLM(config).to(dtype).to(device).eval()


def time_step(target, R: int, q: int, context: int, repeats: int, device: str) -> float:
    g = torch.Generator().manual_seed(0)
    ids = [f"t{i}" for i in range(R)]
    target.prefill(ids, [torch.randint(target.vocab_size, (context + 1,), generator=g) for _ in ids], logits=False)
    keep = torch.full((R,), context)
    times = []
    try:
        for i in range(repeats + 2):
            tokens = torch.randint(target.vocab_size, (R, q), generator=g)
            if device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            target.verify(ids, tokens, torch.full((R,), q - 1))
            if device != "cpu":
                torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - t0)
            target.rollback(ids, keep)
    finally:
        for rid in ids:
            target.release(rid)
    return statistics.median(times)


def greedy_identical(model, tok_free_prompt: torch.Tensor, target, n: int) -> bool:
    from dspark.engine import Engine
    from dspark.types import SamplingParams

    ids = tok_free_prompt[None].to(model.device)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
    (c,) = Engine(target, None).generate([tok_free_prompt], SamplingParams.greedy(), max_new_tokens=n,
                                         progress=False)
    return c.output_ids == ref


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="reports/step_paths")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--paths", default="eager,packed,compiled")
    p.add_argument("--requests", default="1,8")
    p.add_argument("--widths", default="1,2,4,8")
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--identity-tokens", type=int, default=32, help="fp32 greedy identity check length (0: skip)")
    p.add_argument("--shape-only", action="store_true", help="random weights of SmolLM2-135M's shape")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from dspark.autotune import Machine
    from dspark.fast import build_target
    from dspark.models import load_causal_lm
    from dspark.profiling import device_name, traffic_floor

    paths = args.paths.split(",")
    Rs = [int(x) for x in args.requests.split(",")]
    widths = [int(x) for x in args.widths.split(",")]
    dtype = getattr(torch, args.dtype)
    if args.shape_only:
        model = shaped_model(dtype, args.device)
    else:
        model, _ = load_causal_lm("smollm2-135m", dtype, args.device)
    floor = traffic_floor(model)
    result = {"date": time.strftime("%Y-%m-%d"), "device": args.device, "dtype": args.dtype,
              "machine": Machine.current().to_dict(), "context": args.context, "shape_only": args.shape_only,
              "traffic_floor": floor, "torch": torch.__version__, "steps": {}, "build_seconds": {},
              "identity_fp32": {}, "command": "python scripts/step_paths.py " + " ".join(argv or sys.argv[1:])}
    for path in paths:
        t0 = time.perf_counter()
        target = build_target(model, None, path=path)
        result["build_seconds"][path] = time.perf_counter() - t0
        result["device_name"] = device_name(target)
        if target.path != path:
            result["steps"][path] = f"fell back to {target.path}"
            continue
        rows = {}
        for R in Rs:
            for q in widths:
                t1 = time.perf_counter()
                rows[f"{R}x{q}"] = time_step(target, R, q, args.context, args.repeats, args.device)
                log.info("%s R=%d q=%d: %.2f ms (%.0f s with compiles)", path, R, q, rows[f"{R}x{q}"] * 1e3,
                         time.perf_counter() - t1)
        result["steps"][path] = rows
    if args.identity_tokens:
        ref32 = shaped_model(torch.float32, args.device) if args.shape_only else \
            load_causal_lm("smollm2-135m", torch.float32, args.device)[0]
        prompt = torch.arange(5, 45)
        for path in paths:
            target = build_target(ref32, None, path=path)
            result["identity_fp32"][path] = greedy_identical(ref32, prompt, target, args.identity_tokens)
            log.info("fp32 greedy identity, %s: %s", path, result["identity_fp32"][path])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_paths.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (out / "step_paths.md").write_text(f"# Target step by path — {result['date']}\n\nCommand: `{result['command']}`\n\n"
                                       + md + "\n")
    print(md)
    return 0


def markdown(r: dict) -> str:
    timed = {p: rows for p, rows in r["steps"].items() if isinstance(rows, dict)}
    shapes = list(next(iter(timed.values()))) if timed else []
    lines = [f"{r['device_name']}, {r['dtype']}, context {r['context']}, torch {r['torch']} ({r['date']}); "
             f"memory-traffic floor {r['traffic_floor']['floor_seconds'] * 1e3:.2f} ms "
             f"({r['traffic_floor']['weight_bytes'] / 1e6:.0f} MB at "
             f"{r['traffic_floor']['bandwidth_bytes_per_second'] / 1e9:.0f} GB/s)", "",
             "| path | build s | " + " | ".join(f"R×q {s} ms" for s in shapes) + " | fp32 greedy = HF |",
             "|---|---|" + "---|" * len(shapes) + "---|"]
    for p, rows in r["steps"].items():
        cells = [f"{rows[s] * 1e3:.2f}" for s in shapes] if isinstance(rows, dict) else [rows] * len(shapes)
        lines.append(f"| {p} | {r['build_seconds'][p]:.1f} | " + " | ".join(cells)
                     + f" | {r['identity_fp32'].get(p, '—')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
