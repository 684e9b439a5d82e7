"""Self-distillation data: the *target* writes the responses, batched through the engine.

A record (one JSON line) is ``{"key", "domain", "prompt", "prompt_ids", "response_ids",
"finish_reason", "temperature"}`` (plus ``"messages"`` for a multi-turn prompt, whose ``prompt`` is
its last user turn): ``prompt_ids`` is the chat-templated prompt, every turn included, ``response_ids``
what the target generated. The training loss mask is the response: positions of
``prompt_ids + response_ids`` at or after ``len(prompt_ids)``.

Generation is continuous batching (up to ``concurrency`` requests in flight; a finished one is
written at once and replaced), so an interrupted run loses at most the requests in flight and a
re-run skips every key already in the output file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from attrs import frozen

from dspark.data.prompts import Prompt, prompt_request
from dspark.types import SamplingParams

__all__ = ["Record", "read_records", "done_keys", "generate_records", "write_prompts"]


@frozen
class Record:
    key: str
    domain: str
    prompt: str
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    finish_reason: str | None = None
    temperature: float = 0.0
    messages: tuple[tuple[str, str], ...] | None = None  # a multi-turn prompt's turns

    @property
    def ids(self) -> list[int]:
        return list(self.prompt_ids) + list(self.response_ids)

    def to_dict(self) -> dict[str, Any]:
        out = {"key": self.key, "domain": self.domain, "prompt": self.prompt,
               "prompt_ids": list(self.prompt_ids), "response_ids": list(self.response_ids),
               "finish_reason": self.finish_reason, "temperature": self.temperature}
        if self.messages is not None:
            out["messages"] = [{"role": r, "content": c} for r, c in self.messages]
        return out


def read_records(path: str | Path, vocab_size: int | None = None) -> list[Record]:
    """Every record of a data file, with errors naming the file and line (token ids checked
    against ``vocab_size`` when given)."""
    from dspark.data.prompts import jsonl_lines

    out = []
    for lineno, line in jsonl_lines(path, f"training data {path} does not exist (build it with `dspark data`)"):
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise TypeError(f"a JSON {type(row).__name__}, not an object")
            msgs = row.get("messages")
            rec = Record(row["key"], row["domain"], row["prompt"], tuple(row["prompt_ids"]),
                         tuple(row["response_ids"]), row.get("finish_reason"), float(row.get("temperature", 0.0)),
                         tuple((m["role"], m["content"]) for m in msgs) if msgs else None)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            if lineno > 1 and not line.endswith("\n"):
                break  # a torn last line from an interrupted run: ignore it
            what = f"field {exc.args[0]!r} is missing" if isinstance(exc, KeyError) else str(exc).splitlines()[0]
            raise ValueError(f"{path}:{lineno}: not a dspark data record ({what})") from None
        if not rec.prompt_ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in rec.ids):
            raise ValueError(f"{path}:{lineno}: prompt_ids/response_ids must be non-empty integer lists")
        if vocab_size is not None and not all(0 <= t < vocab_size for t in rec.ids):
            bad = next(t for t in rec.ids if not 0 <= t < vocab_size)
            raise ValueError(f"{path}:{lineno}: token id {bad} is outside the target's vocabulary [0, {vocab_size})")
        out.append(rec)
    return out


def done_keys(path: str | Path) -> set[str]:
    path = Path(path)
    return {r.key for r in read_records(path)} if path.is_file() else set()


def write_prompts(path: str | Path, prompts: Sequence[Prompt]) -> None:
    """Held-out prompts as JSONL (``{"prompt", "domain", "key"}``, or ``{"messages", ...}`` for a
    conversation), readable by ``jsonl_prompts``."""
    with Path(path).open("w", encoding="utf-8") as fh:
        for p in prompts:
            msgs = getattr(p, "messages", None)
            head = {"messages": [{"role": r, "content": c} for r, c in msgs]} if msgs else {"prompt": p.text}
            fh.write(json.dumps({**head, "domain": p.domain, "key": p.key}) + "\n")


def generate_records(
    engine: Any,
    prompts: Sequence[Prompt],
    sampling: SamplingParams,
    *,
    max_new_tokens: int = 128,
    concurrency: int = 32,
    progress: bool = True,
) -> Iterator[Record]:
    """Yield one :class:`Record` per prompt as soon as the target has finished it."""
    from tqdm import tqdm

    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    pending = list(prompts)[::-1]
    by_rid: dict[str, Prompt] = {}
    with tqdm(total=len(pending), desc="self-distilling", unit="resp", disable=not progress) as bar:
        while pending or by_rid:
            while pending and len(by_rid) < concurrency:
                p = pending.pop()
                rid = engine.add_request(prompt_request(p), sampling, max_new_tokens=max_new_tokens,
                                         request_id=p.key)  # a conversation: every turn is templated
                by_rid[rid] = p
            engine.step()
            for c in engine.pop_finished():
                p = by_rid.pop(c.request_id)
                bar.update(1)
                yield Record(p.key, p.domain, p.text, tuple(c.prompt_ids), tuple(c.output_ids),
                             c.finish_reason, sampling.temperature, getattr(p, "messages", None))
