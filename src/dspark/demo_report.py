"""``demo.md``: the demo's result (``demo.json``) as a page — the speed-up and how it was measured,
the start-up choices, the per-prompt table, the fp32 greedy identity and the sampling check."""

from __future__ import annotations

__all__ = ["demo_markdown"]


def demo_markdown(r: dict) -> str:
    sp, ch, mach = r["speed"], r["dtype_choice"], r["machine"]
    gate = sp["gate_rounds"]
    lines = [
        f"# dspark demo — SmolLM2-135M-Instruct, drafter `{r['drafter']}`"
        + (f" (calibrated: {r['calibration']})" if r.get("calibration") else ""),
        "",
        f"Command: `{r['command']}`",
        "",
        f"Machine: {mach['cores']}-core {mach['cpu']} — **{mach['kind']}** (flags: {' '.join(mach['flags']) or 'none'}; "
        f"ATen {mach['aten_capability']}; {mach['threads']} threads)"
        + (f"; target and drafter on **{r['device']}**." if r.get("device_type", "cpu") != "cpu" else "."),
        "",
        f"**Speed-up over the best plain decode: {sp['speedup_vs_best_plain']:.2f}×** "
        f"({sp['dtype']} {sp.get('step', 'eager')} step, plain decoding in {sp.get('plain_dtype', sp['dtype'])} "
        f"{sp.get('plain_step', 'eager')}, concurrency 1, {sp['prompts']} held-out prompts of {sp.get('prompt_file', 'eval_prompts.jsonl')} "
        f"× {sp['repeats']} repeats, median of summed "
        f"wall-clock times normalised to {r['max_new_tokens']} tokens; scheduler `{sp.get('scheduler', 'sps-greedy')}`; "
        f"mean τ {sp['mean_tau']:.2f}; draft gate "
        + (f"on: {gate['skipped']} of {gate['rounds']} rounds skipped the drafter)." if sp["draft_gate"] else "off)."),
        "",
        f"Start-up choice: {ch['reason']}.",
        "",
    ]
    if r.get("draft_runner"):
        dr = r["draft_runner"]
        lines += [f"Draft runner (raced at start-up): **{dr['runner']}** — "
                  + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in dr["overhead_seconds"].items())
                  + " beyond a plain round at one request"
                  + (f"; compiling took {dr['compile_seconds']:.0f} s" if dr["compile_seconds"] is not None else "")
                  + (f"; exporting to onnxruntime took {dr['export_seconds']:.1f} s"
                     if dr.get("export_seconds") is not None else "")
                  + ("" if not dr["notes"] else f" ({'; '.join(dr['notes'])})") + ".", ""]
    if r.get("vocab_race"):
        lines += [f"Draft vocabulary (raced at start-up): {r['vocab_race']['reason']}.", ""]
    if sp.get("gate_prior"):
        gp = sp["gate_prior"]
        lines += ["Draft gate prior (from the start-up measurements): survival s_1…s_γ = "
                  + " ".join(f"{v:.2f}" for v in gp["survival"]) + " (the fp32 identity rounds below), "
                  f"drafted-round overhead {1e3 * gp['draft_overhead']['1']:.1f} ms at one request "
                  f"({sp['dtype']}).", ""]
    lines += [
        "Verification step time by tokens verified (" + ch["dtype"] + "): "
        + ", ".join(f"{q}: {s * 1e3:.1f} ms" for q, s in ch["profile_step_seconds"].items()) + ".",
        "",
        "| system | median seconds per repeat |", "|---|---|",
    ]
    for k, v in sp["median_seconds"].items():
        lines.append(f"| {k} | {v:.2f} |")
    lines += ["", "| domain | τ | mean ℓ | drafted rounds | tokens | ms/token plain (engine) | ms/token DSpark |",
              "|---|---|---|---|---|---|---|"]
    for x in sp["per_prompt"]:
        lines.append(f"| {x['domain']} | {x['tau']:.2f} | {x['mean_verified']:.2f} | {x['drafted_rounds']}/{x['rounds']} | "
                     f"{x['new_tokens']} | {x['ms_per_token_plain']:.1f} | {x['ms_per_token_dspark']:.1f} |")
    lines += ["", f"The {sp['dtype']} outputs agree with the plain {sp.get('plain_dtype', sp['dtype'])} decode on "
              f"{100 * sp['prefix_agreement_with_plain']:.1f} % of the common prefix on average (outside fp32, "
              "different verify shapes and dtypes round differently; exact identity is checked in fp32 below).", "",
              "Greedy identity in fp32 (engine + drafter"
              + (f" {r['identity_drafter']}" if r.get("identity_drafter", r["drafter"]) != r["drafter"] else "")
              + " vs the target's own greedy decode), every draft verified "
              f"at full length: {r['identity_verified_drafts']} draft tokens verified, "
              f"{r['identity_accepted_drafts']} accepted.", "",
              "| domain | identical | tokens | τ | drafts verified | accepted | rounds with a rejection |",
              "|---|---|---|---|---|---|---|"]
    for x in r["greedy_identity_fp32"]:
        lines.append(f"| {x['domain']} | {'yes' if x['identical_to_target_greedy'] else 'NO'} | {x['new_tokens']} | "
                     f"{x['tau']:.2f} | {x['verified_drafts']} | {x['accepted_drafts']} | {x['rejected_drafts']} |")
    c = r["sampling_check"]
    lines += [
        "",
        f"Sampling check (T = 0.8, top-p 0.95, {c['samples']} draws, draft q at T = 1.6): acceptance "
        f"{c['acceptance_rate']:.3f} (Σ min(p, q) = {c['overlap_sum_min_p_q']:.3f}); total-variation "
        f"distance to p — committed tokens {c['tv_committed_vs_p']:.3f}, plain samples from p "
        f"{c['tv_plain_samples_vs_p']:.3f} (noise floor), draft samples {c['tv_draft_samples_vs_p']:.3f}.",
        "",
    ]
    return "\n".join(lines)
