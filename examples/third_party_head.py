"""A third-party sequential head in a DSpark drafter: ``tied-markov`` from examples/plugins/dspark-tiedhead.

    pip install -e examples/plugins/dspark-tiedhead      # optional: found through its entry point
    python examples/third_party_head.py

The head reuses the target's frozen token embedding and LM head, so it learns 3·d·r + r
parameters instead of the built-in Markov heads' 2·V·r + …. If the package is not installed this
example registers the module at run time (``dspark.plugins.register``) and unregisters it after.
It builds a DSpark drafter with ``head="tied-markov"`` on a tiny random Llama target, runs the
engine, checks the output against the target's greedy decode, and prints parameter counts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import dspark
import dspark.plugins

PLUGIN_SRC = Path(__file__).resolve().parents[1] / "plugins" / "dspark-tiedhead" / "src"
SMOLLM2 = {"vocab_size": 49152, "hidden_size": 576, "rank": 256}  # SmolLM2-135M at the default rank


def ensure_plugin() -> object | None:
    """The registered plugin module if this call registered it, None if the entry point did."""
    if "tied-markov" in dspark.plugins.registry()["sequential_heads"]:
        return None
    sys.path.insert(0, str(PLUGIN_SRC))
    import dspark_tiedhead

    dspark.plugins.register(dspark_tiedhead, name="tiedhead")
    return dspark_tiedhead


def tiny_target(vocab_size: int = 256, seed: int = 0) -> dspark.HFTarget:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                      initializer_range=0.3)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config.eos_token_id = None
    return dspark.HFTarget(model)


def head_parameters(vocab_size: int, hidden_size: int, rank: int) -> dict[str, int]:
    """Trainable parameters of each registered head at one shape (built on the meta device: no memory)."""
    with torch.device("meta"):
        return {name: dspark.get_sequential_head(name, vocab_size=vocab_size, hidden_size=hidden_size,
                                                 rank=rank).num_parameters()
                for name in ("tied-markov", "gated-markov", "vanilla-markov")}


def main(max_new_tokens: int = 16) -> dict:
    registered = ensure_plugin()
    try:
        row = next(r for r in dspark.list_plugins() if r["name"] == "tied-markov")
        target = tiny_target()
        torch.manual_seed(1)
        drafter = dspark.get_drafter("dspark", target=target, head="tied-markov", gamma=4, num_layers=2, rank=8)
        torch.nn.init.normal_(drafter.head.up.weight, std=0.2)  # as if trained: b ≠ 0
        engine = dspark.Engine(target, drafter, scheduler="sps-greedy", cost_model="sps-table")
        prompts = [torch.tensor([3, 5, 7, 3, 5, 7, 3, 5]), torch.tensor([1]), torch.tensor([200, 9, 4, 77])]
        completions = engine.generate(prompts, max_new_tokens=max_new_tokens, progress=False)
        references = [
            target.model.generate(p[None], attention_mask=torch.ones(1, p.numel(), dtype=torch.long),
                                  max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)[0, p.numel():].tolist()
            for p in prompts
        ]
        c = drafter.config
        result = {
            "plugin": row["plugin"],
            "registered_at_run_time": registered is not None,
            "head": drafter.head.name,
            "identical": [x.output_ids for x in completions] == references,
            "tau": [x.metrics["tau"] for x in completions],
            "params_tiny": head_parameters(c.vocab_size, c.layer.hidden_size, c.rank),
            "params_smollm2": head_parameters(**SMOLLM2),
        }
    finally:
        if registered is not None:
            dspark.plugins.unregister(registered)
    print(f"head {result['head']!r} from plugin {result['plugin']!r} "
          f"({'registered at run time' if registered else 'entry point'})")
    print("identical to the target's greedy decode:", result["identical"], "| τ per request:",
          [round(t, 2) for t in result["tau"]])
    for label, counts in (("tiny target (V=256, d=32, r=8)", result["params_tiny"]),
                          ("SmolLM2-135M (V=49152, d=576, r=256)", result["params_smollm2"])):
        print(f"{label}: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()))
    return result


if __name__ == "__main__":
    main()
