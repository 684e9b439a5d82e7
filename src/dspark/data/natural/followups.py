"""Multi-turn chat prompts: follow-ups to the target's own recorded responses."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from dspark.data.natural.common import NaturalItem, _rng, source_key
from dspark.data.prompts import Prompt, jsonl_lines

# --------------------------------------------------------------------------------------------
# multi-turn: follow-ups to the target's own responses
# --------------------------------------------------------------------------------------------

_FOLLOWUPS = {
    "any": ["Can you give a concrete example?", "Shorter, please.", "Why is that?", "How would I do that in Python?",
            "Can you explain that more simply?", "What's the most important point here?",
            "Could you put that in a bulleted list?", "Are there any downsides?", "Is that always true?",
            "What would you recommend for a beginner?", "Thanks! Can you sum that up in one sentence?",
            "What's a common mistake people make with this?", "How does that compare to the alternatives?",
            "Can you rephrase that for a ten-year-old?", "What should I do next?", "Could you double-check that?",
            "Give me a real-world analogy.", "Make it more formal.", "Can you turn that into a short checklist?",
            "I don't follow the second part. Can you go over it again?", "Where can I learn more about this?",
            "OK, and what if I'm short on time?", "Can you expand on that a bit?"],
    "code": ["Can you add comments to the code?", "How would I test this?", "What's the time complexity?",
             "Can you make it handle empty input?", "Rewrite it without any imports.",
             "What happens if the input is very large?", "Can you show the same thing in JavaScript?",
             "Is there a more Pythonic way to write it?"],
    "math": ["Can you check the answer another way?", "What if the numbers were doubled?",
             "Explain the second step again.", "Can you write that as a single equation?",
             "How would I compute that in Python?", "Is there a quicker way to get the answer?"],
}


def load_followups(path: str | Path, decode: Callable[[list[int]], str] | None = None,
                   seed: int = 0) -> list[NaturalItem]:
    """Two-turn conversations from a ``dspark data`` output file (``train.jsonl``): each record's
    prompt (or ``messages``), the target's own response as the assistant turn (its ``response``
    text, else ``decode(response_ids)``), and a follow-up user turn."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"follow-ups file {path} does not exist (give a train.jsonl written by `dspark data`)")
    out = []
    for lineno, line in jsonl_lines(path, f"follow-ups file {path} does not exist"):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if not line.endswith("\n"):
                break  # a torn last line from an interrupted run
            raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}:{lineno}: not a dspark data record (needs 'prompt' and 'response_ids')")
        reply = row.get("response")
        if not isinstance(reply, str):
            ids = row.get("response_ids")
            if not isinstance(ids, list):
                raise ValueError(f"{path}:{lineno}: not a dspark data record (needs 'prompt' and 'response_ids')")
            if decode is None:
                raise ValueError(f"{path}: records hold token ids only; decoding them needs the target's tokenizer")
            reply = decode(ids)
        reply = reply.strip()
        if len(reply) < 20:
            continue
        history = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        first = next((m["content"] for m in history if m.get("role") == "user"), row["prompt"])
        key = row.get("key") or hashlib.sha1(first.encode("utf-8")).hexdigest()
        r = _rng("followup", seed, key)
        domain = row.get("domain") if row.get("domain") in _FOLLOWUPS else "any"
        pool = _FOLLOWUPS["any"] + _FOLLOWUPS.get(domain, []) * 2 if domain != "any" else _FOLLOWUPS["any"]
        turns = [*history, {"role": "assistant", "content": reply}, {"role": "user", "content": r.choice(pool)}]
        prompt = Prompt(turns[-1]["content"], "chat", messages=tuple((m["role"], m["content"]) for m in turns))
        out.append(NaturalItem(prompt, f"turns/{key}", source_key(first)))
    return out
