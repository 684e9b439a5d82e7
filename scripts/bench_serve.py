"""Throughput through ``dspark serve`` against the engine's own, in one run, same prompts.

    python scripts/bench_serve.py                       # smollm2-135m with the shipped drafter
    python scripts/bench_serve.py --target DIR --drafter ngram --max-tokens 64

The engine is built exactly as ``dspark serve`` builds it (``dspark.serve.cli.build_engine``; the
serve options after ``--`` or the ones below go to it). The same token-id prompts run in waves of
``--concurrency`` requests: ``Engine.generate`` on the engine directly, and ``--concurrency``
concurrent streams of ``/v1/completions`` (token-id prompts, greedy) through the official
``openai`` client against the server on loopback (uvicorn in a thread of this process, as
``dspark serve`` runs it; the client in a subprocess, as a real client is not in the server's
interpreter, though it shares the machine's cores). One warm-up run each, then ``--repeats``
alternating repeats; tokens per second are committed tokens over wall-clock seconds, the medians
compared (target: server ≥ 0.95 × engine). Both runs are greedy, so their outputs are checked
equal too. Prints the machine, the figures and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _client(url: str) -> int:
    """The client subprocess: the waves from the first stdin line, one timed run per "go" line,
    each answered with one JSON line (seconds, tokens, texts)."""
    import openai

    job = json.loads(sys.stdin.readline())
    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)

    async def one(x: list[int]) -> tuple[str, int]:
        s = await client.completions.create(model="bench", prompt=x, max_tokens=job["max_tokens"], temperature=0,
                                            stream=True, stream_options={"include_usage": True})
        text, used = [], 0
        async for c in s:
            text += [ch.text for ch in c.choices]
            if c.usage is not None:
                used = c.usage.completion_tokens
        return "".join(text), used

    async def run() -> dict:
        t, total, outs = time.perf_counter(), 0, []
        for w in job["waves"]:
            done = await asyncio.gather(*(one(x) for x in w))
            total += sum(u for _, u in done)
            outs += [s for s, _ in done]
        return {"seconds": time.perf_counter() - t, "total": total, "outs": outs}

    async def serve_commands() -> None:
        for line in sys.stdin:
            if line.strip() == "go":
                print(json.dumps(await run()), flush=True)
        await client.close()

    asyncio.run(serve_commands())
    return 0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--client":
        return _client(sys.argv[2])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--waves", type=int, default=2, help="waves of --concurrency requests per measurement")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args, serve_args = p.parse_known_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    import uvicorn

    import dspark
    from dspark.cli import build_parser
    from dspark.data.prompts import prompt_request
    from dspark.evaluation.inputs import eval_prompts
    from dspark.serve.app import create_app
    from dspark.serve.cli import build_engine

    sargs = build_parser().parse_args(["serve", *[a for a in serve_args if a != "--"]])
    t0 = time.perf_counter()
    engine = build_engine(sargs)
    print(f"engine built in {time.perf_counter() - t0:.0f} s", flush=True)
    n = args.concurrency * args.waves
    from dspark.data.natural.common import SHIPPED_EVAL

    prompts = eval_prompts(str(SHIPPED_EVAL), per_domain=n)[:n]
    ids = [engine.encode(prompt_request(q)).tolist() for q in prompts]
    waves = [ids[i:i + args.concurrency] for i in range(0, n, args.concurrency)]
    greedy = dspark.SamplingParams.greedy()

    def run_engine() -> tuple[float, int, list[list[int]]]:
        t, total, outs = time.perf_counter(), 0, []
        for w in waves:
            done = engine.generate(w, greedy, max_new_tokens=args.max_tokens, progress=False)
            total += sum(len(c.output_ids) for c in done)
            outs += [c.text for c in done]
        return time.perf_counter() - t, total, outs

    app = create_app(engine, "bench")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    client = subprocess.Popen([sys.executable, __file__, "--client", f"http://127.0.0.1:{sock.getsockname()[1]}/v1"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    client.stdin.write(json.dumps({"waves": waves, "max_tokens": args.max_tokens}) + "\n")

    def run_server() -> tuple[float, int, list[str]]:
        client.stdin.write("go\n")
        client.stdin.flush()
        r = json.loads(client.stdout.readline())
        return r["seconds"], r["total"], r["outs"]

    rates: dict[str, list[float]] = {"engine": [], "server": []}
    print("warm-up ...", flush=True)
    run_engine()
    run_server()
    same, ref = [], []
    for rep in range(args.repeats):
        order = [("engine", run_engine), ("server", run_server)]
        for name, fn in order if rep % 2 == 0 else order[::-1]:
            r0 = engine.rounds
            seconds, total, outs = fn()
            rates[name].append(total / seconds)
            print(f"  repeat {rep + 1} {name:6s}: {total} tokens in {seconds:.2f} s = {total / seconds:.1f} tok/s, "
                  f"{engine.rounds - r0} rounds", flush=True)
            if name == "engine":
                ref = outs
            else:
                same.append(sum(a == b for a, b in zip(outs, ref)))
    client.stdin.close()
    client.wait(60)
    server.should_exit = True
    thread.join(30)
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = med["server"] / med["engine"]
    # each repeat's server run against its own engine run, side by side: robust to the machine's
    # speed drifting between repeats (other jobs on a shared machine)
    paired = [s_ / e for s_, e in zip(rates["server"], rates["engine"])]
    gate = engine.draft_gate
    print(f"\nmachine: {_cpu()}, {torch.get_num_threads()} torch threads; model {sargs.model}, drafter {sargs.drafter}, "
          f"{args.concurrency} concurrent requests x {args.waves} waves, {args.max_tokens} new tokens, "
          f"{args.repeats} repeats (median)")
    model = getattr(engine.target, "model", None)
    dtype = next(model.parameters()).dtype if model is not None else "?"
    # greedy outputs agree exactly in fp32; in bf16 a different batch composition (requests joining a
    # round apart) can flip a near-tie, so there the count is information, not a check
    print(f"engine: {med['engine']:.1f} tok/s   server: {med['server']:.1f} tok/s   ratio: {ratio:.3f} "
          f"(target >= 0.95); per-repeat ratios {', '.join(f'{x:.3f}' for x in paired)}, median "
          f"{statistics.median(paired):.3f}; target dtype {dtype}; identical greedy outputs per repeat: "
          f"{', '.join(f'{k}/{len(ids)}' for k in same)}"
          + (f"; the draft gate skipped {gate.skipped_rounds} of {engine.rounds} rounds" if gate else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
