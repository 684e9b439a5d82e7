"""The compiled bf16 target step by GEMM kernel and token count: which of inductor's product kernels
pays at one request's q = 1 … 8 tokens, with every weight streamed from memory as in decoding.

    python scripts/gemm_rows.py --out RUNS/gemm_rows --gemm template --widths 8,1,2,4,6,5,3
    python scripts/gemm_rows.py --out RUNS/gemm_rows_static --gemm template --graph static --widths 8,6

``--gemm``: ``onednn`` (inductor's default: every product on oneDNN's packed bf16 kernels),
``template`` (inductor's C++ GEMM template wherever it applies, untimed) or ``autotune`` (inductor
times both for each product, weight hot in the cache, at the graph's first size). ``--graph
dynamic``: one graph for every q > 1 (torch specialises q = 1), its kernels chosen at the first
width given; ``static``: a graph per width. Each graph has weight freezing and the C++ wrapper, as
``dspark.fast.compile`` compiles them. The step is :class:`dspark.fast.llama.LlamaStep` on the real
SmolLM2-135M (bf16) over a 160-token past in a 192-slot buffer; each width is timed as the
fastest of 5 × 20 calls after 10 warm-up calls. Writes ``gemm_rows.json`` and ``gemm_rows.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

log = logging.getLogger("gemm_rows")

_BACKENDS = {"onednn": None, "template": "CPP", "autotune": "CPP,ATEN"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--gemm", choices=tuple(_BACKENDS), default="template")
    p.add_argument("--graph", choices=("dynamic", "static"), default="dynamic")
    p.add_argument("--widths", default="8,1,2,4")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    widths = [int(w) for w in args.widths.split(",")]
    if not widths or min(widths) < 1:
        p.error(f"--widths must be positive token counts, got {args.widths!r}")
    args.out.mkdir(parents=True, exist_ok=True)

    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as fx_config

    from dspark.fast.compile import AUTOTUNE_OPTIONS, CPU_OPTIONS
    from dspark.fast.llama import LlamaStep
    from dspark.models import load_causal_lm
    from dspark.profiling import device_name

    model, _ = load_causal_lm("smollm2-135m", torch.bfloat16, "cpu")
    step = LlamaStep(model)
    for key, value in CPU_OPTIONS.items():
        setattr(inductor_config, key, value)
    if _BACKENDS[args.gemm] is not None:
        for key, value in {**AUTOTUNE_OPTIONS, "max_autotune_gemm_backends": _BACKENDS[args.gemm]}.items():
            setattr(inductor_config, key, value)
    fx_config.use_duck_shape = False
    dynamo_config.recompile_limit = 64
    if args.graph == "static":
        dynamo_config.automatic_dynamic_shapes = False  # every width its own graph; the past stays dynamic
    run = torch.compile(step, dynamic=True if args.graph == "dynamic" else None, fullgraph=True)
    L, H_kv, d = len(step.layers), step.kv_heads, step.head_dim

    def inputs(q: int, T: int, length: int) -> tuple:
        past = torch.zeros(L, 2, 1, H_kv, T + 64, d, dtype=torch.bfloat16)[:, :, :, :, :T]
        valid = torch.arange(T)[None] < length
        if args.graph == "static":
            torch._dynamo.mark_dynamic(past, 4)
            torch._dynamo.mark_dynamic(valid, 1)
        return torch.randint(0, 1000, (1, q)), (length + torch.arange(q))[None], past, valid, (), True

    rows = []
    with torch.inference_mode():
        for q in widths:
            t0 = time.perf_counter()
            run(*inputs(q, 192, 160))
            compile_s = time.perf_counter() - t0
            run(*inputs(q, 256, 200))  # another past length: compiles nothing
            a = inputs(q, 192, 160)
            for _ in range(10):
                run(*a)
            times = []
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(20):
                    run(*a)
                times.append((time.perf_counter() - t) / 20 * 1e3)
            rows.append({"q": q, "ms": min(times), "median_ms": sorted(times)[2], "compile_s": compile_s})
            log.info("%s %s q=%d: %.2f ms (median %.2f; compiling %.0f s)", args.gemm, args.graph, q,
                     min(times), sorted(times)[2], compile_s)
    result = {"machine": device_name(None), "gemm": args.gemm, "graph": args.graph,
              "torch": torch.__version__, "rows": rows}
    (args.out / "gemm_rows.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"{result['machine']}, torch {result['torch']}: bf16 step, GEMM {args.gemm}, {args.graph} graph", "",
             "| q | ms | median ms | compiling s |", "|---|---|---|---|"]
    lines += [f"| {r['q']} | {r['ms']:.2f} | {r['median_ms']:.2f} | {r['compile_s']:.0f} |" for r in rows]
    (args.out / "gemm_rows.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
