"""Draft-gate settings side by side on the demo's speed prompts (concurrency 1, dtype chosen by measurement).

    python scripts/experiments/gate_ab.py '{"nogate": null, "m100": {"margin": 1.0}, "m105": {"margin": 1.05}}' 3

Each variant is a JSON object of DraftGate keyword arguments (null: no gate). HF ``generate``
("hf") and the engine without a drafter ("plain") run next to them, prompt by prompt; every system
keeps its engine (and gate state) across repeats, as ``dspark demo`` does. Prints the seconds per
repeat and, last, each system's speed-up over the best plain decode (median over repeats).
Run with ``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`` to make an AVX-512-BF16 CPU behave
like an AVX2-only one (bf16 emulated).
"""
import json
import statistics
import sys
import time

import torch

from dspark.autotune import choose_dtype
from dspark.checkpoints import DEFAULT_DRAFTER, resolve_checkpoint
from dspark.demo import _encode
from dspark.drafters.checkpoint import from_pretrained
from dspark.engine import Engine
from dspark.evaluation.drafter_specs import folder_calibrator
from dspark.evaluation.inputs import eval_prompts
from dspark.gating import DraftGate
from dspark.models import load_causal_lm
from dspark.speculative import plain_generate
from dspark.targets import HFTarget
from dspark.types import SamplingParams


def main(variants: dict, reps: int = 3, new_tokens: int = 96) -> dict[str, float]:
    model, tok = load_causal_lm("smollm2-135m", torch.float32)
    ids = [_encode(tok, p.text) for p in eval_prompts(None, 2)]
    choice, target = choose_dtype(model, tok, context=100, gamma=7)
    del model
    model, cost = target.model, choice.cost_model()
    print(choice.reason)
    folder = resolve_checkpoint(DEFAULT_DRAFTER)
    calibrator = folder_calibrator(folder) or "identity"  # none under the stacked confidence.json

    def engine(gate):
        t = HFTarget(model, tok)
        if gate == "plain":
            return Engine(t, None, cost_model=cost)
        return Engine(t, from_pretrained(folder, t), cost_model=cost, calibrator=calibrator,
                      draft_gate=DraftGate(**gate) if gate is not None else None)

    systems = {"hf": None, "plain": engine("plain"), **{name: engine(kw) for name, kw in variants.items()}}
    totals: dict[str, list[float]] = {k: [] for k in systems}
    for rep in range(reps):
        sums = dict.fromkeys(systems, 0.0)
        for x in ids:
            for name, e in systems.items():
                t0 = time.perf_counter()
                if e is None:
                    plain_generate(model, x, new_tokens, tok.eos_token_id)
                else:
                    e.generate([x], SamplingParams.greedy(), new_tokens, progress=False)
                sums[name] += time.perf_counter() - t0
        for name, v in sums.items():
            totals[name].append(v)
        print(rep, {k: round(v, 2) for k, v in sums.items()}, flush=True)
    med = {k: statistics.median(v) for k, v in totals.items()}
    base = min(med["hf"], med["plain"])
    speedups = {k: round(base / v, 3) for k, v in med.items()}
    print(speedups)
    return speedups


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 3)
