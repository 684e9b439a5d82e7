"""The one thread that owns the :class:`dspark.Engine` behind the server.

The engine is not thread-safe and its ``step()`` is a blocking torch forward, so it cannot run on
the HTTP event loop: a single background thread takes submissions and aborts from a command
queue between rounds, steps every active request together (continuous batching across HTTP
requests), and hands each round's committed tokens to the waiting handlers through their asyncio
queues (``call_soon_threadsafe``). Handlers never touch the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from typing import Any

import torch
from attrs import define, field, frozen

from dspark.types import SamplingParams

__all__ = ["EngineLoop", "RequestHandle", "Tokens", "Finished"]

log = logging.getLogger("dspark.serve")


@frozen
class Tokens:
    """Committed token ids of one round for one request."""

    ids: list[int]


@frozen
class Finished:
    """The request left the engine: ``reason`` is the engine's ("stop", "length", "abort") or
    "error" with ``message``."""

    reason: str
    message: str = ""


@define
class RequestHandle:
    """What a handler holds for one submitted request: its id, prompt length and the queue of
    :class:`Tokens` / :class:`Finished` events the engine thread fills."""

    rid: str
    prompt_len: int
    queue: asyncio.Queue
    aloop: asyncio.AbstractEventLoop
    finished: bool = False

    async def events(self):
        """The events until (and including) the :class:`Finished` one. Rounds that queued up
        while the reader was busy come as one :class:`Tokens`: a slow client then gets fewer,
        larger chunks instead of falling further behind (and the server encodes fewer)."""
        while True:
            ev = await self.queue.get()
            ids: list[int] = []
            while isinstance(ev, Tokens):
                ids += ev.ids
                if self.queue.empty():
                    break
                ev = self.queue.get_nowait()
            if ids:
                yield Tokens(ids)
            if isinstance(ev, Finished):
                self.finished = True
                yield ev
                return


def _put_all(batch: list[tuple[asyncio.Queue, Tokens | Finished]]) -> None:
    for queue, event in batch:
        queue.put_nowait(event)


@define
class _Submission:
    handle: RequestHandle
    ids: torch.Tensor
    sampling: SamplingParams
    max_tokens: int
    seed: int | None


@define
class _Counters:
    """Totals the metrics endpoint reports (written by the engine thread, read under the lock)."""

    rounds: int = 0
    request_rounds: int = 0  # Σ over rounds of the requests verified in that round
    committed: int = 0  # tokens committed
    step_seconds: float = 0.0
    requests: int = 0
    finished: dict[str, int] = field(factory=dict)
    active: int = 0
    recent: deque = field(factory=lambda: deque(maxlen=4096))  # (time, tokens) per round


class EngineLoop:
    """Owns ``engine`` on a daemon thread (module docstring). ``submit`` and ``abort`` are safe
    to call from any thread; tokens arrive on the handle's queue in the submitter's event loop."""

    def __init__(self, engine: Any, *, rate_window: float = 10.0, admit_window: float = 0.01) -> None:
        self.engine = engine
        self.rate_window = rate_window
        # An idle engine that gets a request waits this long for more before its first round: a
        # burst of clients then starts in one batch instead of the first running a round alone
        # and the rest finishing a round after it (a tail round at a smaller batch).
        self.admit_window = admit_window
        self._cond = threading.Condition()
        self._pending: list[_Submission] = []
        self._aborts: list[str] = []
        self._handles: dict[str, RequestHandle] = {}  # engine thread only
        self._ids = itertools.count()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._stats = _Counters()
        self._started = time.monotonic()

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort whatever still runs and join the thread (the engine is left with no request)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        """The engine thread runs (it ends on ``stop`` or on an unexpected error)."""
        return self._thread is not None and self._thread.is_alive()

    # -- handler side -------------------------------------------------------------------
    def submit(self, ids: torch.Tensor, sampling: SamplingParams, max_tokens: int,
               seed: int | None = None, prefix: str = "req") -> RequestHandle:
        """Queue a request (token ids, already validated); call from a running event loop."""
        aloop = asyncio.get_running_loop()
        handle = RequestHandle(f"{prefix}-{next(self._ids)}", int(ids.numel()), asyncio.Queue(), aloop)
        with self._cond:
            if self._stop or not self.alive:  # nobody would ever answer it
                raise RuntimeError("the engine is not running (the server is shutting down or failed)")
            self._pending.append(_Submission(handle, ids, sampling, max_tokens, seed))
            self._cond.notify_all()
        return handle

    def abort(self, rid: str) -> None:
        """Have the engine drop a request (its client left); a finished or unknown id is a no-op."""
        with self._cond:
            self._aborts.append(rid)
            self._cond.notify_all()

    def metrics(self) -> dict[str, Any]:
        """τ, tokens/s, draft-gate skips, queue depth, active requests (docs/serve.md)."""
        gate = getattr(self.engine, "draft_gate", None)
        with self._cond:
            s = self._stats
            now = time.monotonic()
            recent = sum(n for t, n in s.recent if now - t <= self.rate_window)
            return {
                "tau": s.committed / s.request_rounds if s.request_rounds else 0.0,
                "tokens_per_second": recent / self.rate_window,
                "tokens_per_busy_second": s.committed / s.step_seconds if s.step_seconds else 0.0,
                "tokens_committed": s.committed,
                "rounds": s.rounds,
                "draft_gate_skips": int(getattr(gate, "skipped_rounds", 0)) if gate is not None else 0,
                "queue_depth": len(self._pending),
                "active_requests": s.active,
                "requests_total": s.requests,
                "requests_finished": dict(s.finished),
                "uptime_seconds": now - self._started,
            }

    # -- engine thread ------------------------------------------------------------------
    def _deliver(self, handle: RequestHandle, event: Tokens | Finished) -> None:
        self._deliver_all([(handle, event)])

    def _deliver_all(self, items: list[tuple[RequestHandle, Tokens | Finished]]) -> None:
        """One wake-up of each handler event loop per round, not one per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for handle, event in items:
            by_loop.setdefault(handle.aloop, []).append((handle.queue, event))
        for aloop, batch in by_loop.items():
            try:
                aloop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that event loop is closed: nobody is listening
                pass

    def _take_commands(self) -> tuple[list[_Submission], list[str]] | None:
        with self._cond:
            while not (self._stop or self._pending or self._aborts or self._handles):
                self._cond.wait()
            if self._pending and not self._handles and self.admit_window > 0:
                deadline = time.monotonic() + self.admit_window
                while not self._stop and (left := deadline - time.monotonic()) > 0:
                    self._cond.wait(left)  # woken by each submission; keeps waiting out the window
            if self._stop:
                return None
            subs, aborts = self._pending, self._aborts
            self._pending, self._aborts = [], []
            return subs, aborts

    def _run(self) -> None:
        try:
            while (cmds := self._take_commands()) is not None:
                subs, aborts = cmds
                gone = set(aborts)
                for s in subs:
                    if s.handle.rid in gone:  # left before it joined
                        self._deliver(s.handle, Finished("abort"))
                        continue
                    self._add(s)
                for rid in gone & self._handles.keys():
                    self.engine.abort(rid)
                if self.engine.active:
                    self._step()
                self._collect()
        except Exception:  # never expected: fail every waiting request rather than leave it hanging
            log.exception("the engine loop failed")
            self._fail_all("the engine loop failed; see the server log")
            raise
        finally:
            self._shutdown()

    def _add(self, s: _Submission) -> None:
        try:
            self.engine.add_request(s.ids, s.sampling, max_new_tokens=s.max_tokens, request_id=s.handle.rid,
                                    chat=False, seed=s.seed)
        except Exception as exc:  # a request the checks before submission let through
            log.warning("request %s refused by the engine: %s", s.handle.rid, exc)
            self._deliver(s.handle, Finished("error", str(exc)))
            return
        self._handles[s.handle.rid] = s.handle
        with self._cond:
            self._stats.requests += 1

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outs = self.engine.step()
        except Exception:
            log.exception("engine step failed; aborting its %d requests", len(self._handles))
            self._fail_all("the engine failed while generating; see the server log")
            return
        seconds = time.perf_counter() - t0
        n, items = 0, []
        for o in outs:
            handle = self._handles.get(o.request_id)
            n += len(o.new_tokens)
            if handle is not None and o.new_tokens:
                items.append((handle, Tokens(list(o.new_tokens))))
        self._deliver_all(items)
        with self._cond:
            s = self._stats
            s.rounds += 1
            s.request_rounds += len(outs)
            s.committed += n
            s.step_seconds += seconds
            s.recent.append((time.monotonic(), n))

    def _collect(self) -> None:
        done = self.engine.pop_finished()
        ended = [(self._handles.pop(c.request_id, None), c.finish_reason) for c in done]
        with self._cond:  # counted before the handlers hear of it: a client then reads settled metrics
            for _, reason in ended:
                self._stats.finished[reason] = self._stats.finished.get(reason, 0) + 1
            self._stats.active = len(self._handles)
        self._deliver_all([(handle, Finished(reason)) for handle, reason in ended if handle is not None])

    def _fail_all(self, message: str) -> None:
        for rid, handle in list(self._handles.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - a broken request must not keep the others waiting
                log.exception("could not abort %s", rid)
            self._deliver(handle, Finished("error", message))
        try:
            self.engine.pop_finished()
        except Exception:  # noqa: BLE001
            log.exception("could not collect the failed requests")
        self._handles.clear()

    def _shutdown(self) -> None:
        with self._cond:
            pending, self._pending = self._pending, []
        for s in pending:
            self._deliver(s.handle, Finished("error", "the server is shutting down"))
        self._fail_all("the server is shutting down")
        with self._cond:
            self._stats.active = 0
