"""Offline prompt sources for self-distillation, in three domains: math, code and chat.

Every source yields :class:`Prompt` values. Nothing is fetched from a network:

* ``math``  — arithmetic word problems generated from templates with seeded numbers and names;
* ``code``  — code-completion and explanation prompts built from *documented* functions of the
  Python standard library, or of installed PyPI packages (their signatures and the first sentence
  of their docstrings);
* ``chat``  — everyday assistant requests built from task templates × topics;
* ``jsonl`` — the user's own files: one object per line with a ``prompt`` (or ``messages``) field
  and an optional ``domain``.

Train/eval split is by prompt hash (:func:`prompt_hash`; a conversation's over all its turns), so a held-out prompt can never appear in
training data however the sources are re-generated or re-ordered.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from attrs import field, frozen

__all__ = ["Prompt", "DOMAINS", "prompt_hash", "is_heldout", "math_prompts", "code_prompts",
           "chat_prompts", "jsonl_prompts", "builtin_prompts", "split", "prompt_request"]

DOMAINS = ("math", "code", "chat")


def prompt_hash(text: str) -> str:
    """Stable hash of a prompt's text (sha1 hex), the key of the train/eval split."""
    return hashlib.sha1(text.strip().encode("utf-8")).hexdigest()


def is_heldout(text: str, eval_fraction: float) -> bool:
    """True when the prompt belongs to the held-out evaluation split."""
    return int(prompt_hash(text)[:8], 16) / 0xFFFFFFFF < eval_fraction


def _messages(value: Any) -> tuple[tuple[str, str], ...] | None:
    """Chat messages as ((role, content), ...): from dicts or pairs; None stays None."""
    if value is None:
        return None
    out = []
    for m in value:
        role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else tuple(m)
        if not isinstance(role, str) or not isinstance(content, str):
            raise ValueError(f"a chat message needs a string role and content, got {m!r}")
        out.append((role, content))
    if not out or out[-1][0] != "user":
        raise ValueError("a multi-turn prompt's messages must end with a user turn")
    return tuple(out)


@frozen
class Prompt:
    """A prompt: ``text`` (for a multi-turn prompt, its last user turn) and, optionally, the whole
    conversation as ``messages`` ((role, content) pairs ending with a user turn) — earlier
    assistant turns included, which the chat template renders before the new response."""

    text: str
    domain: str = field()
    messages: tuple[tuple[str, str], ...] | None = field(default=None, converter=_messages)

    @domain.validator
    def _check(self, _a: object, v: str) -> None:
        if not isinstance(v, str) or not v:
            raise ValueError(f"prompt domain must be a non-empty string, got {v!r}")

    @property
    def key(self) -> str:
        """Split and resume key: the text's hash, or for a conversation the hash of every turn."""
        if self.messages is None:
            return prompt_hash(self.text)
        return prompt_hash(json.dumps([list(m) for m in self.messages], ensure_ascii=False))

    @property
    def request(self) -> str | list[dict[str, str]]:
        """What the engine encodes: the text, or the conversation as chat-template messages."""
        if self.messages is None:
            return self.text
        return [{"role": r, "content": c} for r, c in self.messages]


def prompt_request(p: Any) -> Any:
    """``p.request`` when a prompt has one, else ``p.text`` (token-id prompts in tests, say)."""
    return getattr(p, "request", p.text)


# --------------------------------------------------------------------------------------------
# math
# --------------------------------------------------------------------------------------------

_NAMES = ["Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jonas", "Kemi",
          "Liam", "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor"]
_ITEMS = ["apples", "marbles", "books", "stickers", "pencils", "cookies", "coins", "cards", "shells",
          "stamps", "eggs", "balloons", "oranges", "tickets"]


def _math_one(rng: random.Random) -> str:
    n1, n2 = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    a, b, c = rng.randint(12, 95), rng.randint(2, 40), rng.randint(1, 11)
    kind = rng.randrange(12)
    if kind == 0:
        return (f"{n1} has {a} {item}. {n1} buys {b} more and then gives {c} to {n2}. "
                f"How many {item} does {n1} have now?")
    if kind == 1:
        return f"What is {a * b} divided by {b}? Explain each step."
    if kind == 2:
        return f"Calculate {a} × {b} + {c} and show your working."
    if kind == 3:
        x = rng.randint(2, 15)
        return f"Solve for x: {c}x + {b} = {c * x + b}."
    if kind == 4:
        return f"A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?"
    if kind == 5:
        return f"A train travels {a * c} km in {c} hours. What is its average speed in km per hour?"
    if kind == 6:
        return f"{n1} saves ${b} every week. How much money will {n1} have saved after {c + 3} weeks?"
    if kind == 7:
        p = rng.choice([10, 15, 20, 25, 30, 40, 50])
        return f"A jacket costs ${a * 2}. It is on sale for {p}% off. What is the sale price?"
    if kind == 8:
        return (f"{n1} and {n2} share {a * 2} {item} in the ratio {c}:{c + 1}. "
                f"How many {item} does each of them get?")
    if kind == 9:
        return f"What is {c}/{c + 2} + 1/{b}? Give the answer as a simplified fraction."
    if kind == 10:
        return (f"There are {a} students in a class and {b} of them are absent today. "
                f"What percentage of the class is present?")
    return f"Find the sum of all whole numbers from 1 to {a}. Explain the method you use."


def math_prompts(n: int, seed: int = 0) -> list[Prompt]:
    """``n`` distinct arithmetic word problems (deterministic for a seed)."""
    rng, seen, out = random.Random(f"math-{seed}"), set(), []
    for _ in range(50 * n + 100):
        text = _math_one(rng)
        if text not in seen:
            seen.add(text)
            out.append(Prompt(text, "math"))
            if len(out) == n:
                break
    return out


# --------------------------------------------------------------------------------------------
# code (documented functions of the standard library)
# --------------------------------------------------------------------------------------------

_CODE_MODULES = ["string", "textwrap", "itertools", "functools", "collections", "statistics", "math",
                 "json", "re", "os.path", "shutil", "heapq", "bisect", "fnmatch", "difflib", "calendar",
                 "html", "base64", "random", "glob", "csv", "urllib.parse", "ipaddress", "fractions",
                 "datetime", "uuid", "pathlib", "operator", "copy", "pprint", "secrets", "tempfile",
                 "gzip", "zipfile", "hashlib", "colorsys", "shlex", "posixpath", "keyword", "dataclasses"]


def _documented_functions(modules: Iterable[str] = _CODE_MODULES) -> list[tuple[str, str, str, str]]:
    """(module, name, signature, first docstring sentence) for documented public functions."""
    rows = []
    for modname in modules:
        try:
            mod = importlib.import_module(modname)
        except ImportError as exc:
            raise ValueError(f"cannot build code prompts from module {modname!r}: {exc}") from None
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isbuiltin(obj)):
                continue
            doc = inspect.getdoc(obj) or ""
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                continue
            first = " ".join(doc.strip().split("\n\n")[0].split())
            if len(first) < 20 or len(first) > 300 or len(sig) > 80:
                continue
            rows.append((modname, name, sig, first))
    return rows


def code_prompts(n: int, seed: int = 0, modules: Iterable[str] | None = None) -> list[Prompt]:
    """Up to ``n`` code prompts from documented functions (three phrasings each): of the standard
    library by default, or of any importable ``modules`` — e.g. the documentation shipped inside
    installed PyPI packages (``["numpy", "torch.nn.functional"]``)."""
    rows = _documented_functions(modules if modules is not None else _CODE_MODULES)
    out = []
    for modname, name, sig, doc in rows:
        out.append(Prompt(f"Write a Python function `{name}{sig}` that does the following: {doc}", "code"))
        out.append(Prompt(f"Complete this Python function:\n\n```python\ndef {name}{sig}:\n"
                          f'    """{doc}"""\n```', "code"))
        out.append(Prompt(f"Explain what `{modname}.{name}` does in Python and show a short example.", "code"))
    random.Random(f"code-{seed}").shuffle(out)
    return list(dict.fromkeys(out))[:n]  # os.path and posixpath document the same functions


# --------------------------------------------------------------------------------------------
# chat
# --------------------------------------------------------------------------------------------

_TOPICS = ["photosynthesis", "the water cycle", "time management", "learning a new language",
           "healthy breakfast ideas", "saving money", "the solar system", "climate change",
           "how vaccines work", "starting a vegetable garden", "preparing for a job interview",
           "the history of the internet", "recycling at home", "getting better sleep",
           "public speaking", "making friends in a new city", "the French Revolution",
           "volcanoes", "electric cars", "remote work", "reading more books", "meditation",
           "the human heart", "training for a 5k run", "baking bread", "caring for a puppy",
           "the Roman Empire", "renewable energy", "writing a cover letter", "planning a trip to Japan",
           "staying motivated", "learning to play guitar", "the importance of bees", "black holes",
           "cooking pasta", "first aid basics", "the stock market", "digital privacy",
           "ocean tides", "chess openings", "organising a birthday party", "houseplants",
           "the Great Wall of China", "artificial intelligence", "drinking enough water",
           "dinosaurs", "rainbows", "teamwork", "studying for exams", "composting"]
_TASKS = ["Can you explain {t} in simple terms?", "Give me three practical tips about {t}.",
          "Write a short poem about {t}.", "What are the pros and cons of {t}?",
          "Write a friendly email inviting a colleague to a talk about {t}.",
          "Summarize the main ideas of {t} in one paragraph.",
          "What are some common misconceptions about {t}?",
          "Tell me an interesting fact about {t}.",
          "How would you explain {t} to a ten-year-old?",
          "Write a short story for children that involves {t}.",
          "List five questions someone might ask about {t}, with short answers.",
          "I want to learn about {t}. Where should I start?"]


def chat_prompts(n: int, seed: int = 0) -> list[Prompt]:
    """Up to ``n`` everyday assistant requests (task template × topic)."""
    out = [Prompt(task.format(t=topic), "chat") for topic in _TOPICS for task in _TASKS]
    random.Random(f"chat-{seed}").shuffle(out)
    return out[:n]


# --------------------------------------------------------------------------------------------
# user files, the built-in mix, the split
# --------------------------------------------------------------------------------------------


def jsonl_lines(path: str | Path, missing: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of the non-blank lines of a JSONL file; FileNotFoundError(missing)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(missing)
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
            if line.strip():
                yield lineno, line


def jsonl_prompts(path: str | Path, default_domain: str = "user") -> Iterator[Prompt]:
    """Prompts from a JSONL file: ``{"prompt": str, "domain"?: str}`` or ``{"messages": [...]}``
    (a conversation ending with a user turn; every turn is kept for the chat template)."""
    for lineno, line in jsonl_lines(path, f"prompt file {path} does not exist"):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: each line must be a JSON object")
        text, messages = row.get("prompt"), None
        if text is None and isinstance(row.get("messages"), list):
            rows = row["messages"]
            last = max((i for i, m in enumerate(rows) if isinstance(m, dict) and m.get("role") == "user"),
                       default=None)  # the prompt ends at the last user turn
            try:
                messages = _messages(rows[:last + 1]) if last is not None else None
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: bad 'messages' ({exc})") from None
            text = messages[-1][1] if messages else None
            if messages is not None and len(messages) == 1:
                messages = None  # one user turn: the same prompt as {"prompt": ...}
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{path}:{lineno}: needs a non-empty 'prompt' string (or user 'messages')")
        yield Prompt(text, str(row.get("domain") or default_domain), messages)


def builtin_prompts(per_domain: int, seed: int = 0, domains: Iterable[str] = DOMAINS,
                    code_modules: Iterable[str] | None = None) -> list[Prompt]:
    """The built-in mix: ``per_domain`` prompts from each of the generated sources."""
    makers = {"math": math_prompts, "code": lambda n, s: code_prompts(n, s, code_modules), "chat": chat_prompts}
    out = []
    for d in domains:
        if d not in makers:
            raise ValueError(f"unknown built-in domain {d!r}; known: {', '.join(makers)}")
        out.extend(makers[d](per_domain, seed))
    return out


def split(prompts: Iterable[Prompt], eval_fraction: float) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held-out) by prompt hash, de-duplicated by text."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction!r}")
    train, held, seen = [], [], set()
    for p in prompts:
        if p.key in seen:
            continue
        seen.add(p.key)
        (held if int(p.key[:8], 16) / 0xFFFFFFFF < eval_fraction else train).append(p)  # = is_heldout(p.text), one turn
    return train, held
