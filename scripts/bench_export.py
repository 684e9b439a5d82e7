"""Drafter latency per round: PyTorch eager vs ONNX Runtime, side by side in one run.

    python scripts/bench_export.py [--target smollm2-135m|random] [--kind dspark|dflash|eagle3]
                                   [--requests 1 4 16] [--past 128] [--rounds 9] [--threads N]

A random-initialised drafter of the target's shape (DrafterConfig.for_target defaults: DSpark =
5 draft layers + gated-Markov head + confidence head, γ = 7) is bound to the target's embedding
and LM head, exported to ONNX, and loaded as an OrtDrafter. For each batch size R, every request
gets a context of ``--past`` tokens (random target features), one untimed round ingests it, then
``--rounds`` steady-state rounds each commit 2 tokens per request (1 accepted + 1 recovered, so
2 new context positions) and time ``draft()`` of both drafters on identical inputs, alternating
which goes first. Reported: the median round time, and the sequential head's share. Latency only
depends on shapes, so random weights measure what a trained drafter would. Writes
``OUT/results.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import dspark
from dspark.export import OrtDrafter, compare_drafters, export_onnx
from dspark.protocols import DraftContext, TargetFeatures
from dspark.types import SamplingParams


def load_model(spec: str):
    if spec == "random":  # SmolLM2-135M's shape, random weights (no download, no GGUF)
        from transformers import AutoModelForCausalLM, LlamaConfig

        cfg = LlamaConfig(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, intermediate_size=1536, tie_word_embeddings=True,
                          max_position_embeddings=8192, rope_theta=100000.0)
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg).eval()
    from dspark.models import load_causal_lm

    return load_causal_lm(spec)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m", help="'smollm2-135m', 'random' (its shape), an HF folder")
    ap.add_argument("--kind", default="dspark", choices=["dspark", "dflash", "eagle3"])
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--past", type=int, default=128, help="context tokens per request")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for both (default: torch's)")
    ap.add_argument("--out", default="out/bench_export")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    out = Path(args.out)

    model = load_model(args.target)
    torch.manual_seed(1)
    drafter = dspark.get_drafter(args.kind, target=SimpleNamespace(model=model, name=args.target))
    with torch.no_grad():
        for p in drafter.parameters():
            if p.ndim > 1:
                torch.nn.init.normal_(p, std=0.02)  # incl. the zero-initialised W_up
    t0 = time.perf_counter()
    export_onnx(drafter, out / "onnx", target_spec=args.target)
    t_export = time.perf_counter() - t0
    t0 = time.perf_counter()
    ort = OrtDrafter.from_dir(out / "onnx", threads=threads)
    t_load = time.perf_counter() - t0
    parity = compare_drafters(drafter, ort)
    print(f"export {t_export:.1f} s, ORT session load {t_load:.1f} s; parity: {parity.summary()}")

    F_in = len(drafter.target_layer_ids) * drafter.config.layer.hidden_size
    V = drafter.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows = []
    for R in args.requests:
        rids = [f"b{R}-{i}" for i in range(R)]
        toks = [torch.randint(0, V, (args.past + 1,), generator=gen) for _ in rids]
        feats = [torch.randn(args.past, F_in, generator=gen) for _ in rids]
        times: dict[str, list[float]] = {"eager": [], "ort": []}
        head: dict[str, list[float]] = {"eager": [], "ort": []}
        for rnd in range(args.rounds + 1):
            ctx = DraftContext(rids, toks, [SamplingParams()] * R, features=TargetFeatures(feats))
            order = [("eager", drafter), ("ort", ort)]
            if rnd % 2:
                order.reverse()
            blocks = {}
            for name, d in order:
                t0 = time.perf_counter()
                blocks[name] = d.draft(ctx)
                dt = time.perf_counter() - t0
                if rnd:  # round 0 ingests the whole context: not a steady-state round
                    times[name].append(dt)
                    head[name].append(d.timings.get("sequential_head", 0.0))
            assert torch.equal(blocks["eager"].tokens, blocks["ort"].tokens), "greedy drafts differ"
            a = blocks["eager"].tokens
            toks = [torch.cat([t, a[i, :1], torch.randint(0, V, (1,), generator=gen)]) for i, t in enumerate(toks)]
            feats = [torch.randn(2, F_in, generator=gen) for _ in rids]
        for rid in rids:
            drafter.release(rid)
            ort.release(rid)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        med_head = {k: statistics.median(v) * 1e3 for k, v in head.items()}
        rows.append({"requests": R, "past": args.past, "eager_ms": med["eager"], "ort_ms": med["ort"],
                     "speedup": med["eager"] / med["ort"], "eager_head_ms": med_head["eager"],
                     "ort_head_ms": med_head["ort"]})

    c = drafter.config
    desc = (f"{args.kind} drafter (random-init, {c.num_layers if args.kind != 'eagle3' else 1} "
            f"layer(s), d={c.layer.hidden_size}, V={V}, γ={c.gamma}"
            + (f", {c.head} head r={c.rank}, confidence" if c.head else "") + f"), target {args.target}")
    print(f"\n{desc}; {platform.processor() or platform.machine()}, {threads} thread(s), torch "
          f"{torch.__version__}, onnxruntime {__import__('onnxruntime').__version__}; median of {args.rounds} rounds\n")
    print("| R | context | PyTorch eager | ONNX Runtime | speed-up | head: eager / ORT |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['requests']} | {r['past']} | {r['eager_ms']:.1f} ms | {r['ort_ms']:.1f} ms | "
              f"{r['speedup']:.2f}× | {r['eager_head_ms']:.1f} / {r['ort_head_ms']:.1f} ms |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({
        "description": desc, "threads": threads, "rounds": args.rounds, "torch": torch.__version__,
        "onnxruntime": __import__("onnxruntime").__version__, "parity": parity.summary(), "rows": rows,
        "export_seconds": t_export, "ort_load_seconds": t_load,
    }, indent=2) + "\n")


if __name__ == "__main__":
    main()
