"""``dspark serve``: an OpenAI-compatible HTTP server on the speculative :class:`dspark.Engine`.

On a CPU, dspark's own engine is the only way to serve a DSpark drafter (vLLM runs it only on its
GPU runner), so this package puts the engine behind the OpenAI API: one background thread owns the
engine and batches every connection's requests (:mod:`dspark.serve.loop`), the FastAPI app
validates, tokenizes and streams (:mod:`dspark.serve.app`, :mod:`dspark.serve.schemas`,
:mod:`dspark.serve.text`), and :mod:`dspark.serve.cli` builds the engine for the command line.
Needs the ``serve`` extra (fastapi, uvicorn); docs/serve.md is the guide.
"""

from __future__ import annotations

__all__ = ["create_app", "EngineLoop"]


def __getattr__(name: str):
    # fastapi is imported only when the app is asked for: `dspark --help` works without the extra
    if name == "create_app":
        from dspark.serve.app import create_app

        return create_app
    if name == "EngineLoop":
        from dspark.serve.loop import EngineLoop

        return EngineLoop
    raise AttributeError(name)
