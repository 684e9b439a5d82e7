"""The FastAPI app: OpenAI-compatible completions and chat (streaming or not), models, health,
metrics.

Handlers only validate, tokenize and wait: the :class:`~dspark.serve.loop.EngineLoop` thread
owns the engine, so requests from any number of connections share its batched rounds. A client
that goes away (the stream's task is cancelled, or a non-streaming caller disconnects) aborts its
request, so the engine and the target drop its caches at once instead of generating for nobody.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from dspark.engine import encode_prompt
from dspark.serve.loop import EngineLoop, Finished, RequestHandle, Tokens
from dspark.serve.schemas import APIError, GenerationRequest, error_json, parse_body
from dspark.serve.text import TextStream

__all__ = ["create_app"]

log = logging.getLogger("dspark.serve")

_DISCONNECT_POLL = 0.25  # seconds between checks that a non-streaming client is still there


class _EngineFailed(Exception):
    pass


class _Stream(StreamingResponse):
    """A stream that aborts its request however the response ends: a client gone before the
    body generator ever started leaves no generator ``finally`` to do it."""

    def __init__(self, content: Any, on_close: Any) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def create_app(engine: Any, model_name: str, *, loop: EngineLoop | None = None) -> FastAPI:
    """An app serving ``engine`` under ``model_name``; its engine loop starts and stops with the
    app's lifespan (``app.state.loop``)."""
    loop = loop or EngineLoop(engine)
    target = engine.target
    tok = target.tokenizer
    if tok is None:
        raise ValueError("serving needs a target with a tokenizer")

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        loop.start()
        log.info("serving %s (context window %d)", model_name, target.max_context)
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="dspark", lifespan=lifespan)
    app.state.loop = loop
    app.state.model_name = model_name
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.to_json(), status_code=exc.status)

    def prepare(req: GenerationRequest) -> tuple[Any, int]:
        """Model check, tokenization and the context-window checks → (ids, max_tokens)."""
        if req.model != model_name:
            raise APIError(f"The model '{req.model}' does not exist; this server serves '{model_name}'.",
                           status=404, param="model", code="model_not_found")
        if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], int):
            bad = [t for t in req.prompt if not 0 <= t < target.vocab_size]
            if bad:
                raise APIError(f"Token id {bad[0]} in 'prompt' is outside the vocabulary (0..{target.vocab_size - 1}).",
                               param="prompt")
        try:
            ids = encode_prompt(tok, req.prompt, chat=req.chat)
        except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer without a chat template
            raise APIError(f"The prompt could not be tokenized: {str(exc).splitlines()[0] if str(exc) else exc!r}",
                           param="messages" if req.chat else "prompt") from None
        n, ctx = int(ids.numel()), target.max_context
        if n == 0:
            raise APIError("The prompt is empty after tokenization.", param="prompt")
        if n >= ctx:
            raise APIError(f"The prompt has {n} tokens but the context window is {ctx}, with room needed for at "
                           "least one new token.", param="messages" if req.chat else "prompt",
                           code="context_length_exceeded")
        max_tokens = req.max_tokens if req.max_tokens is not None else ctx - n
        if n + max_tokens > ctx:
            raise APIError(f"The prompt's {n} tokens plus max_tokens {max_tokens} exceed the context window of "
                           f"{ctx}.", param="max_tokens", code="context_length_exceeded")
        return ids, max_tokens

    async def body_of(request: Request, chat: bool) -> GenerationRequest:
        try:
            raw = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError("The request body is not valid JSON.") from None
        return parse_body(raw, chat)

    async def deltas(handle: RequestHandle, text: TextStream, count: list[int]) -> AsyncIterator[tuple[str, str | None]]:
        """(text delta, finish_reason or None) until the request ends; aborts it if left early."""
        try:
            async for ev in handle.events():
                if isinstance(ev, Tokens):
                    count[0] += len(ev.ids)
                    piece = text.push(ev.ids)
                    if text.stopped:  # a stop string: the engine need not go on
                        loop.abort(handle.rid)
                        yield piece, "stop"
                        return
                    if piece:
                        yield piece, None
                elif isinstance(ev, Finished):
                    if ev.reason in ("error", "abort"):
                        raise _EngineFailed(ev.message or "the request was aborted by the server")
                    yield text.flush(), ev.reason
                    return
        finally:
            if not handle.finished:
                loop.abort(handle.rid)

    def usage(handle: RequestHandle, count: list[int]) -> dict[str, int]:
        return {"prompt_tokens": handle.prompt_len, "completion_tokens": count[0],
                "total_tokens": handle.prompt_len + count[0]}

    async def run(request: Request, chat: bool) -> Response:
        req = await body_of(request, chat)
        ids, max_tokens = prepare(req)
        prefix = "chatcmpl" if chat else "cmpl"
        try:
            handle = loop.submit(ids, req.sampling, max_tokens, req.seed, prefix=f"{prefix}-{uuid.uuid4().hex[:12]}")
        except RuntimeError as exc:
            raise APIError(f"The request cannot be served now: {exc}.", status=503, kind="server_error") from None
        text, count = TextStream(tok, req.stop), [0]
        base = {"id": handle.rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": model_name}
        if req.stream:
            def close() -> None:
                if not handle.finished:
                    loop.abort(handle.rid)

            return _Stream(sse(handle, text, count, base, chat, req.include_usage), close)
        task = asyncio.ensure_future(collect(handle, text, count))
        while not task.done():
            await asyncio.wait({task}, timeout=_DISCONNECT_POLL)
            if not task.done() and await request.is_disconnected():
                task.cancel()  # its generator aborts the request
                log.info("%s: client disconnected; request aborted", handle.rid)
                return Response(status_code=499)
        try:
            out, finish = task.result()
        except _EngineFailed as exc:
            return JSONResponse(error_json(str(exc), "server_error"), status_code=500)
        body = {**base, "object": "chat.completion" if chat else "text_completion", "usage": usage(handle, count)}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out}, "finish_reason": finish,
                      "logprobs": None}
        else:
            choice = {"index": 0, "text": out, "finish_reason": finish, "logprobs": None}
        return JSONResponse({**body, "choices": [choice]})

    async def collect(handle: RequestHandle, text: TextStream, count: list[int]) -> tuple[str, str]:
        parts, finish = [], "length"
        gen = deltas(handle, text, count)
        try:
            async for piece, reason in gen:
                parts.append(piece)
                finish = reason or finish
        finally:
            await gen.aclose()
        return "".join(parts), finish

    def chunk(base: dict, chat: bool, piece: str | None, finish: str | None) -> str:
        if chat:
            delta = {} if piece is None else {"content": piece}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": piece or "", "finish_reason": finish, "logprobs": None}
        return f"data: {json.dumps({**base, 'choices': [choice]})}\n\n"

    async def sse(handle: RequestHandle, text: TextStream, count: list[int], base: dict, chat: bool,
                  include_usage: bool) -> AsyncIterator[str]:
        gen = deltas(handle, text, count)
        try:
            if chat:
                first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                         "logprobs": None}
                yield f"data: {json.dumps({**base, 'choices': [first]})}\n\n"
            async for piece, reason in gen:
                if piece:
                    yield chunk(base, chat, piece, None)
                if reason is not None:
                    yield chunk(base, chat, None, reason)
            if include_usage:
                yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage(handle, count)})}\n\n"
        except _EngineFailed as exc:
            yield f"data: {json.dumps(error_json(str(exc), 'server_error'))}\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            log.info("%s: client disconnected mid-stream; request aborted", handle.rid)
            raise
        finally:
            await gen.aclose()
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await run(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "dspark", "max_model_len": target.max_context}]}

    @app.get("/health")
    async def health() -> Response:
        alive = loop.alive
        return JSONResponse({"status": "ok" if alive else "engine loop not running"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics(format: str = "prometheus") -> Response:
        m = loop.metrics()
        if format == "json":
            return JSONResponse(m)
        return PlainTextResponse(_prometheus(m), media_type="text/plain; version=0.0.4")

    return app


_PROM = {  # metric → (Prometheus name, type, help)
    "tau": ("dspark_tau", "gauge", "tokens committed per request per verification round, since start"),
    "tokens_per_second": ("dspark_tokens_per_second", "gauge", "tokens committed per second, last 10 s"),
    "tokens_committed": ("dspark_tokens_committed_total", "counter", "tokens committed"),
    "rounds": ("dspark_rounds_total", "counter", "engine rounds (one batched verification each)"),
    "draft_gate_skips": ("dspark_draft_gate_skips_total", "counter", "rounds the draft gate ran without drafting"),
    "queue_depth": ("dspark_queue_depth", "gauge", "requests waiting to join the batch"),
    "active_requests": ("dspark_active_requests", "gauge", "requests in the batch"),
    "requests_total": ("dspark_requests_total", "counter", "requests admitted to the engine"),
}


def _prometheus(m: dict[str, Any]) -> str:
    lines = []
    for key, (name, kind, text) in _PROM.items():
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {float(m[key]):g}"]
    lines += ["# HELP dspark_requests_finished_total requests finished, by reason",
              "# TYPE dspark_requests_finished_total counter"]
    lines += [f'dspark_requests_finished_total{{reason="{r}"}} {n}' for r, n in sorted(m["requests_finished"].items())]
    return "\n".join(lines) + "\n"
