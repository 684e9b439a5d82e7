"""Compose a speculative-decoding pipeline from named parts: target, drafter, calibrator, cost
model, scheduler → ``dspark.Engine`` → generate, and check it against the target's greedy decode.

    python examples/custom_pipeline.py           # a tiny random Llama target, a second on any CPU
    python examples/custom_pipeline.py --real    # SmolLM2-135M-Instruct + the shipped default drafter

Every part is picked by name from the plugin registry (``dspark plugins`` lists them) or passed as
an object satisfying its protocol. On the tiny random target the drafter is untrained, so τ (mean
committed tokens per round) stays near 1; the point there is the wiring and the greedy identity.
With ``--real`` the shipped, calibrated drafter gives τ well above 1.
"""

from __future__ import annotations

import argparse

import torch

import dspark


def tiny_target(vocab_size: int = 16, seed: int = 0) -> dspark.HFTarget:
    """A random 4-layer Llama (hidden 32) wrapped as a batched dspark target."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                      initializer_range=0.3)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config.eos_token_id = None  # no tokenizer, no EOS: decode to max_new_tokens
    return dspark.HFTarget(model)


def greedy_reference(target: dspark.HFTarget, prompt: torch.Tensor, n: int) -> list[int]:
    """The target's own greedy decode (HF ``generate``), stopping at EOS as the engine does."""
    eos = getattr(target.tokenizer, "eos_token_id", None)
    out = target.model.generate(prompt[None], attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long),
                                max_new_tokens=n, do_sample=False, eos_token_id=eos,
                                pad_token_id=eos if eos is not None else 0)
    return out[0, prompt.numel():].tolist()


def build(real: bool):
    """(target, drafter, calibrator, prompts): the only part that differs between the two modes."""
    if real:
        from dspark.checkpoints import DEFAULT_DRAFTER, resolve_checkpoint
        from dspark.evaluation.drafter_specs import folder_calibrator

        target = dspark.load_target()  # SmolLM2-135M-Instruct, fp32 (needs the `target` extra)
        folder = resolve_checkpoint(DEFAULT_DRAFTER)  # the shipped default drafter (dspark-5l-xl)
        drafter = dspark.get_drafter("dspark", target=target, checkpoint=folder)
        # The folder's own calibration: none when its confidence model is calibrated already (a
        # `stacked` confidence.json), else its calibration.json.
        calibrator = folder_calibrator(folder) or dspark.get_calibrator("identity")
        prompts = ["Give me three tips for writing clear emails, one sentence each.",
                   "Write a Python function that returns the n-th Fibonacci number."]
        return target, drafter, calibrator, prompts
    target = tiny_target()
    torch.manual_seed(1)
    drafter = dspark.get_drafter("dspark", target=target, head="gated-markov", gamma=4, num_layers=2, rank=8)
    calibrator = dspark.get_calibrator("temperature", temperature=1.5)  # unfitted: a fixed softening
    prompts = [[3, 5, 7, 3, 5, 7, 3, 5], [1], [2, 9, 4, 4, 11, 2, 9, 4]]
    return target, drafter, calibrator, prompts


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct instead of a tiny random target")
    p.add_argument("--max-new-tokens", type=int, default=24)
    args = p.parse_args(argv)

    target, drafter, calibrator, prompts = build(args.real)
    engine = dspark.Engine(
        target,
        drafter,
        calibrator=calibrator,
        cost_model=dspark.get_cost_model("sps-table"),  # the shipped SmolLM2 CPU profile
        scheduler=dspark.get_scheduler("sps-greedy"),  # maximise τ·SPS(B), lossless
    )
    completions = engine.generate(prompts, dspark.SamplingParams.greedy(), args.max_new_tokens, progress=False)

    outputs = [c.output_ids for c in completions]
    references = [greedy_reference(target, engine.encode(pr), args.max_new_tokens) for pr in prompts]
    result = {
        "outputs": outputs,
        "references": references,
        "identical": outputs == references,
        "tau": [c.metrics["tau"] for c in completions],
        "metrics": [c.metrics for c in completions],
        "rounds": engine.rounds,
    }
    for i, c in enumerate(completions):
        print(f"request {i}: τ = {c.metrics['tau']:.2f} over {c.metrics['rounds']} rounds, "
              f"{len(c.output_ids)} tokens" + (f": {c.text!r}" if c.text is not None else ""))
    print("identical to the target's greedy decode:", result["identical"])
    return result


if __name__ == "__main__":
    main()
