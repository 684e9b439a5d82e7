"""Natural prompts for self-distillation, built from real text that installed packages ship.

Templated prompts (:mod:`dspark.data.prompts`) overstate a drafter's acceptance on real traffic:
their phrasing repeats, so the drafter learns the template. This module builds prompts from real
text instead, with nothing fetched from a network:

* ``chat`` — paragraphs of documentation: the long descriptions (READMEs) in
  ``*.dist-info/METADATA``, ``.md`` / ``.rst`` / ``.txt`` files inside installed packages, and module
  docstrings of the standard library and installed packages. A paragraph that passes
  :func:`junk_reason` (length 200–1200 characters; no tables, badges, bare links, code, license
  boilerplate, changelogs or non-English text) becomes one of many requests about it ("Summarize this for a
  beginner", "What problem does this solve?", "Rewrite this more clearly", …); headings and package
  summaries become free-standing questions ("How do I install attrs?").
  With a ``dspark data`` output file (:func:`load_followups`), multi-turn conversations too: a
  recorded prompt, the *target's own* response as the assistant turn, and a follow-up user turn.
  (Such a conversation's first turn was a prompt of the run that recorded it, so a held-out
  conversation is new only from its second turn on.)
* ``code`` — functions of 5–40 lines taken with :mod:`ast` from ``.py`` files of the standard
  library and installed packages (tests, vendored copies and dunder methods left out): explain,
  complete (signature, docstring and the first statements given), write a unit test, find a bug, add type hints, rewrite more readably, implement from the
  docstring.
* ``math`` — word problems from a compositional generator: 13 scenario frames (shopping, travel,
  recipes, percentages, ages, areas, work rates, interest, units, probability, sequences, averages
  and clock times), each with several question types and phrasings (question first, question
  last, conversational, imperative) over seeded numbers; plus unit-conversion questions about
  numbers quoted from documentation sentences.

Every :class:`NaturalItem` has a *source unit* (the distribution for documentation, the file for
code, frame + seed + index for a math problem, the first turn's key for a conversation) and a
*source key* (a hash of the real text it was built from). The train/eval split is by a stable hash
of the unit — so no held-out prompt shares a package, file or conversation with a training prompt —
and a source text that occurs in a held-out unit never appears in training either (for code and
math, whose sources are too large to enumerate, by a hash band of the source key; see
:func:`item_side`). Units hashed below ``max(eval_fraction, RESERVED_FRACTION)`` never train, so the
shipped eval set (``natural_eval.jsonl``, built at ``RESERVED_FRACTION``) stays held out whatever
``--eval-fraction`` a later run uses; its source keys are excluded from training explicitly too.

Everything is deterministic given ``seed`` and the installed packages (hashes are sha1, never
Python's ``hash()``).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import json
import random
import re
import sys
import sysconfig
import textwrap
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from attrs import frozen

from dspark.data.prompts import DOMAINS, Prompt, jsonl_lines

__all__ = ["NaturalItem", "RESERVED_FRACTION", "SHIPPED_EVAL", "band", "source_key", "item_side",
           "junk_reason", "natural_items", "natural_split", "load_followups", "shipped_eval_keys"]

RESERVED_FRACTION = 0.1  # units hashed below this never train (the shipped eval set lives there)
SHIPPED_EVAL = Path(__file__).with_name("natural_eval.jsonl")
_OWN = ("dspark",)  # this project's own distributions change with every commit: not a source


@frozen
class NaturalItem:
    prompt: Prompt
    unit: str  # what the split is keyed on: distribution, file, math frame + index, first turn
    source: str  # source_key() of the real text the prompt was built from
    rank: int = 0  # 1: a second request about the same source (training only, after every first one)


def band(key: str) -> float:
    """A stable position in [0, 1) for a string (sha1)."""
    return int(hashlib.sha1(key.encode("utf-8")).hexdigest()[:8], 16) / 2**32


def source_key(text: str) -> str:
    """Hash of a source text, insensitive to case, indentation and line wrapping."""
    return hashlib.sha1(" ".join(text.lower().split()).encode("utf-8")).hexdigest()[:16]


def item_side(unit: str, source: str, eval_fraction: float, reserved: set[str] | None = None) -> str | None:
    """``"eval"``, ``"train"`` or ``None`` (neither) for an item of ``unit`` built from ``source``.

    Held out: the unit hashes below ``eval_fraction``. Training: the unit hashes at or above
    ``max(eval_fraction, RESERVED_FRACTION)``, and the source text occurs in no held-out unit —
    checked exactly against ``reserved`` (every source key of the reserved units) for sources that
    can be enumerated whole, else by a hash band of the source key itself (held-out items then
    need a low source band, training items a high one)."""
    cut = max(eval_fraction, RESERVED_FRACTION)
    u = band("unit:" + unit)
    if reserved is None:
        s = band("source:" + source)
        return "eval" if u < eval_fraction and s < cut else "train" if u >= cut and s >= cut else None
    return "eval" if u < eval_fraction else "train" if u >= cut and source not in reserved else None


@functools.lru_cache(maxsize=4)
def shipped_eval_keys(path: str = str(SHIPPED_EVAL)) -> frozenset[str]:
    """Source keys of the shipped natural eval set (never used for training)."""
    if not Path(path).is_file():
        return frozenset()
    return frozenset(json.loads(line).get("source", "") for _, line in jsonl_lines(path, path))


def _rng(*parts: object) -> random.Random:
    return random.Random(":".join(map(str, parts)))


# --------------------------------------------------------------------------------------------
# documentation: paragraphs, headings, summaries
# --------------------------------------------------------------------------------------------

_STOP = frozenset("the a an of to and in is are be for that this it with as on by or can you your "
                  "from not if which when will use used using its at has have was we into".split())
_LICENSE = re.compile(r"permission is hereby granted|licensed under|without warrant|warranties|"
                      r"copyright \(c\)|copyright ©|all rights reserved|redistribution and use|"
                      r"terms of the .{0,20}license|provided \"as is\"|gnu general public", re.I)
_URL = re.compile(r"https?://\S+|www\.\S+")
_CODE_LINE = re.compile(r"^\s*(>>>|\$ |\.\.\. |import |from \S+ import|def |class |pip install|[{}\]])")


def _clean(text: str) -> str:
    """Markdown / reStructuredText inline markup to plain text."""
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    text = re.sub(r"!\[[^\]]*\]\([^)]*\)", " ", text)  # images
    text = re.sub(r"\[([^\]]+)\]\([^)]*\)", r"\1", text)  # [text](url)
    text = re.sub(r"`([^`<]+?)\s*<[^>]+>`__?", r"\1", text)  # rst `text <url>`_
    text = re.sub(r":[a-z:]+:`~?([^`]+)`", r"`\1`", text)  # rst roles
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    text = re.sub(r"\*\*([^*]+)\*\*|__([^_]+)__", lambda m: m.group(1) or m.group(2), text)
    text = re.sub(r"</?(?:p|a|img|div|br|h\d|span|b|i|em|strong|picture|source|sup|sub|details|summary|table|"
                  r"tr|td|th|ul|ol|li|code|pre|center|hr|kbd)\b[^>]*>", " ", text, flags=re.I)  # html tags
    return text


def junk_reason(text: str) -> str | None:
    """Why a paragraph is not usable as the basis of a prompt, or ``None`` when it is."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    low = text.lower()
    if any(ln.lstrip().startswith(("|", "+-", "+=")) for ln in lines) or re.search(r"^[=\- ]{8,}$", text, re.M) \
            or len(re.findall(r"\S {3,}\S", re.sub(r"(?m)^\s*(?:[-*+]|\d+[.)])\s+", "", text))) >= 2:  # columns
        return "table"
    if "shields.io" in low or "[![" in text or ".. image::" in low or "badge" in low or ".. |" in text:
        return "badge"
    n_url = len(_URL.findall(text))
    if n_url >= 3 or (n_url and len(_URL.sub("", text).strip()) < 0.6 * len(text)):
        return "urls"
    if not 200 <= len(text) <= 1200:
        return "length"
    if text.lstrip().startswith((".. ", "::")) or sum(bool(_CODE_LINE.match(ln)) or ln.startswith("    ")
                                                     for ln in lines) > len(lines) / 3:
        return "code"
    if sum(c in "{}[]()=<>;_\\/*#|@$" for c in text) > 0.06 * len(text):
        return "code"
    if _LICENSE.search(text):
        return "license"
    letters = [c for c in text if c.isalpha()]
    words = re.findall(r"[A-Za-z']+", low)
    if len(words) < 30:
        return "length"
    if sum(not c.isascii() for c in letters) > 0.03 * len(letters) or sum(w in _STOP for w in words) < 0.15 * len(words):
        return "language"
    if re.match(r"\s*v?\d+\.\d+", text) or re.search(r"\b(changelog|release notes)\b", low) \
            or len(re.findall(r"(?:^|\s)(?:#\d{2,}|@[A-Za-z][\w-]+)\b", text)) >= 2:  # issue / user references
        return "changelog"
    if text.rstrip().endswith((":", ",")):
        return "fragment"  # introduces a list or an example that is not part of it
    return None


_RST_UNDERLINE = re.compile(r"^([=\-~^*+#`'\"])\1{2,}\s*$")


def _paragraphs(doc: str) -> list[tuple[str, str]]:
    """(heading, paragraph) of a Markdown or reStructuredText document; code blocks dropped."""
    doc = re.sub(r"(?ms)^\s*(```|~~~).*?^\s*\1[^\n]*$", "\n", doc.replace("\r\n", "\n"))  # fenced code
    doc = re.sub(r"(?s)\A---\n.*?\n---\n", "", doc)  # YAML front matter
    lines = doc.split("\n")
    out, heading, block = [], "", []

    def flush() -> None:
        if block:
            bullets = sum(ln.lstrip().startswith(("- ", "* ", "+ ")) or bool(re.match(r"\s*\d+[.)] ", ln))
                          for ln in block)
            joiner = "\n" if bullets >= 2 else " "
            out.append((heading, joiner.join(ln.strip() if joiner == " " else ln.rstrip() for ln in block)))
            block.clear()

    i = 0
    while i < len(lines):
        ln = lines[i]
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if m := re.match(r"^\s{0,3}#{1,6}\s+(.+?)\s*#*\s*$", ln):
            flush()
            heading = _clean(m.group(1)).strip()
        elif ln.strip() and _RST_UNDERLINE.match(nxt) and len(nxt.strip()) >= len(ln.strip()) \
                and not _RST_UNDERLINE.match(ln):
            flush()
            heading, i = _clean(ln).strip(), i + 1
        elif not ln.strip() or _RST_UNDERLINE.match(ln):
            flush()
        else:
            block.append(ln)
        i += 1
    flush()
    return [(h, _clean(p).strip()) for h, p in out]


def _docstring(path: Path) -> str:
    """The module docstring of a ``.py`` file (read from its head only), or ''."""
    try:
        with path.open(encoding="utf-8") as fh:
            head = fh.read(20000)
    except (OSError, UnicodeDecodeError):
        return ""
    m = re.match(r'(?:\s*#[^\n]*\n|\s*\n)*\s*[rRuU]?("""|\'\'\')(.*?)\1', head, re.S)
    return textwrap.dedent(m.group(2)).strip() if m else ""


@frozen
class _Doc:
    unit: str
    name: str  # how a prompt names the subject: "attrs", "the Python `json` module"
    summary: str
    sections: tuple[tuple[str, str], ...]  # (heading, usable paragraph)
    headings: tuple[str, ...]


def _skip_path(parts: Sequence[str]) -> bool:
    return any(p in ("tests", "test", "testing", "_vendor", "vendor", "vendored", "__pycache__", "examples",
                     "idlelib", "lib2to3", "turtledemo", "pydoc_data", "encodings", "ensurepip",
                     "site-packages") or p.startswith(_OWN) or p.endswith(".dist-info")
               for p in parts)


_DOC_SKIP = re.compile(r"license|licence|copying|notice|authors|changelog|changes|history|news|"
                       r"record|entry_points|top_level|requires|dependency_links|sources|installer|"
                       r"requested|wheel|third.?party|privacy|security|readme\.txt$", re.I)


def _dist_doc(dist: importlib.metadata.Distribution, name: str) -> _Doc:
    meta = dist.metadata
    texts = [meta.get_payload() or meta.get("Description") or ""]
    modules = []
    for f in dist.files or ():
        parts = Path(str(f)).parts
        if _skip_path(parts[:-1]) or ".." in parts:
            continue
        if f.suffix in (".md", ".rst", ".txt") and not _DOC_SKIP.search(f.name):
            try:
                texts.append(Path(dist.locate_file(f)).read_text(encoding="utf-8")[:200_000])
            except (OSError, UnicodeDecodeError):
                pass
        elif f.suffix == ".py":
            modules.append(f)
    for f in sorted(modules, key=lambda f: (len(f.parts), str(f)))[:400]:  # shallow modules first
        texts.append(_docstring(Path(dist.locate_file(f))))
    return _make_doc(f"docs/{name}", name, meta.get("Summary") or "", texts)


def _make_doc(unit: str, name: str, summary: str, texts: Iterable[str]) -> _Doc:
    sections, headings, seen = [], [], set()
    for text in texts:
        for heading, para in _paragraphs(text):
            key = source_key(para)
            if key not in seen and junk_reason(para) is None:
                seen.add(key)
                sections.append((heading, para))
            if heading and heading not in headings:
                headings.append(heading)
    return _Doc(unit, name, " ".join(summary.split()), tuple(sections), tuple(headings))


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=1)
def _docs() -> tuple[_Doc, ...]:
    """Every documentation unit: one per installed distribution, one per stdlib top-level module."""
    out, seen = [], set()
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: str(d.metadata["Name"] or "").lower()):
        name = str(dist.metadata["Name"] or "")
        norm = re.sub(r"[-_.]+", "-", name).lower()
        if not name or norm in seen or norm.startswith(_OWN):
            continue
        seen.add(norm)
        out.append(_dist_doc(dist, name))
    std = _stdlib_dir()
    for mod in sorted(getattr(sys, "stdlib_module_names", ())):
        if mod.startswith("_") or _skip_path([mod]):
            continue
        files = [std / f"{mod}.py"] if (std / f"{mod}.py").is_file() else \
            sorted(f for f in (std / mod).rglob("*.py") if not _skip_path(f.relative_to(std).parts[:-1]))[:60] \
            if (std / mod / "__init__.py").is_file() else []
        if files:
            out.append(_make_doc(f"docs/stdlib/{mod}", f"the Python `{mod}` module", "",
                                 (_docstring(f) for f in files)))
    return tuple(out)


_PARA_TASKS = [
    "Summarize this for a beginner:\n\n{p}",
    "{p}\n\nWhat problem does this solve?",
    "Rewrite this more clearly:\n\n{p}",
    "Here is part of the documentation of {name}:\n\n{p}\n\nGive an example of using it.",
    "I found this in the documentation of {name} and I don't get it. Can you explain it in plain English?\n\n{p}",
    "{p}\n\nWhat are the key points here?",
    "Turn this into three short bullet points:\n\n{p}",
    "Explain this to someone who is new to programming:\n\n\"{p}\"",
    "What does this passage mean?\n\n{p}",
    "Here's a passage from some documentation:\n\n{p}\n\nWhat questions might a new user still have after "
    "reading it?",
    "{p}\n\nIs anything in this text unclear or ambiguous? How would you improve it?",
    "Write a one-sentence summary of the following.\n\n{p}",
    "Based on this description, when would I want to use {name}?\n\n{p}",
    "Can you make this shorter without losing anything important?\n\n{p}",
    "{p}\n\nCould you explain the same idea with an everyday analogy?",
    "My colleague sent me this:\n\n> {p}\n\nWhat is it saying, and why does it matter?",
    "Read the following and tell me what the main takeaway is.\n\n{p}",
    "Write a short FAQ (three questions with answers) based on this text:\n\n{p}",
    "{p}\n\nWhat are the trade-offs or limitations hinted at here?",
]
_TERM_TASKS = [
    "In the passage below, what does `{term}` refer to?\n\n{p}",
    "{p}\n\nWhat is `{term}` here, and how is it used?",
]
_SUMMARY_TASKS = [
    "What is {name}? Its description says: \"{s}\" What would I use it for?",
    "I keep seeing {name} in requirements files. It's described as \"{s}\" Is it something I need?",
    "Explain what {name} does (\"{s}\") and give a small example.",
    "Someone described {name} to me as \"{s}\" Can you tell me more?",
    "What are some alternatives to {name} (\"{s}\"), and how do they compare?",
]
_HEADING_KINDS = [
    (r"install", ["How do I install {name}?", "What's the easiest way to set up {name} on my machine?"]),
    (r"usage|quick ?start|getting started|tutorial|basic|example|how to use|overview",
     ["How do I get started with {name}? Show me a minimal example.",
      "Can you walk me through a first small program that uses {name}?"]),
    (r"feature|highlight|why|key idea|philosophy",
     ["What are the main features of {name}?", "Why would someone choose {name} over the alternatives?"]),
    (r"config|setting|option|customi[sz]",
     ["How do I configure {name}?", "What configuration options does {name} offer, and which matter most?"]),
    (r"perform|benchmark|speed",
     ["How fast is {name}, and what affects its performance?"]),
    (r"contribut|licen|credit|author|sponsor|support|changelog|history|citation|acknowledg|maintain|release|"
     r"contact|table of contents|links?$|status|news|badges?|community|funding|project|documentation|"
     r"resources|help|faq|see also|further reading|references|todo|roadmap|notes?$|deprecat", []),
]
_SECTION_TASK = "This is from the \"{h}\" section of the documentation of {name}:\n\n{p}\n\nExplain it briefly."
_TOPIC_TASKS = [
    "In {name}, what is meant by \"{h}\"?",
    "Can you explain \"{h}\" in {name}, with an example?",
    "What should I know about {h} when using {name}?",
    "I'm reading the documentation of {name}. What is the section \"{h}\" about, and when would I need it?",
]


def _heading_tasks(h: str) -> list[str]:
    """Question templates for a heading: a question heading as it is, a known kind of section
    (installation, usage, …) by its kind, any other short topical heading as a topic."""
    if h.endswith("?") and 3 <= len(h.split()) <= 14:
        return ["{h}", "Question about {name}: {h}"]
    for pat, tasks in _HEADING_KINDS:
        if re.search(pat, h, re.I):
            return tasks
    topical = 2 <= len(h.split()) <= 7 and re.fullmatch(r"[\w ,'&()/+.-]+", h) and not h[0].isdigit()
    return _TOPIC_TASKS if topical else []


def _term(p: str, r: random.Random) -> str | None:
    terms = [t for t in re.findall(r"`([^`\n]+)`", p) if 2 <= len(t) <= 40 and not t.isdigit()]
    return r.choice(terms) if terms else None


def _doc_items(doc: _Doc, seed: int) -> Iterator[NaturalItem]:
    """The chat prompts of one documentation unit: its paragraphs, then headings and summary."""
    for heading, para in doc.sections:
        key = source_key(para)
        r = _rng("para", seed, key)
        term, x = _term(para, r), r.random()
        tmpl = r.choice(_TERM_TASKS) if term and x < 0.2 else \
            _SECTION_TASK if heading and 2 <= len(heading.split()) <= 8 and x > 0.9 else r.choice(_PARA_TASKS)
        yield NaturalItem(Prompt(tmpl.format(p=para, name=doc.name, term=term, h=heading), "chat"), doc.unit, key)
        second = r.choice([t for t in _PARA_TASKS if t != tmpl])
        yield NaturalItem(Prompt(second.format(p=para, name=doc.name), "chat"), doc.unit, key, rank=1)
    for h in doc.headings:
        if tasks := _heading_tasks(h):
            r = _rng("heading", seed, doc.unit, h)
            text = r.choice(tasks).format(name=doc.name, h=h.rstrip(":").strip())
            yield NaturalItem(Prompt(text, "chat"), doc.unit, source_key(doc.name + "|" + h))
    if 20 <= len(doc.summary) <= 200:
        s = doc.summary if doc.summary.endswith((".", "!", "?")) else doc.summary + "."
        text = _rng("summary", seed, doc.unit).choice(_SUMMARY_TASKS).format(name=doc.name, s=s)
        yield NaturalItem(Prompt(text, "chat"), doc.unit, source_key(doc.summary))


_NUM = re.compile(r"\b(\d{1,4})\s*(seconds?|minutes?|hours?|days?|weeks?|KB|kB|MB|GB|KiB|MiB|GiB|bytes|"
                  r"times (?:faster|slower|smaller|larger|more|less))\b")
_CONVERT = {"second": "milliseconds", "minute": "seconds", "hour": "minutes", "day": "hours", "week": "days",
            "kb": "bytes", "kib": "bytes", "mb": "kilobytes", "mib": "kibibytes", "gb": "megabytes",
            "gib": "mebibytes", "byte": "bits"}


def _doc_number_items(doc: _Doc, seed: int) -> Iterator[NaturalItem]:
    """Math questions about numbers that documentation sentences quote (same unit and source key
    as the paragraph, so they fall on the paragraph's side of the split)."""
    for _heading, para in doc.sections:
        for sent in re.split(r"(?<=[.!?])\s+", para):
            m = _NUM.search(sent)
            if not m or not 40 <= len(sent) <= 300:
                continue
            n, what = int(m.group(1)), m.group(2)
            r = _rng("docnum", seed, sent)
            if what.startswith("times"):
                k = n * r.choice([3, 4, 6, 12])
                q = (f"If something took {k} seconds before, how long does it take when it is "
                     f"{n} {what}? Show the arithmetic.")
            else:
                q = f"How many {_CONVERT[what.lower().rstrip('s')]} is {n} {what}? Show the arithmetic."
            text = r.choice(["The documentation of {name} says: \"{s}\" {q}",
                             "\"{s}\" (from the documentation of {name}). {q}",
                             "{q} (This comes up in the documentation of {name}: \"{s}\")"]).format(name=doc.name, s=sent, q=q)
            yield NaturalItem(Prompt(text, "math"), doc.unit, source_key(para))
            break


# --------------------------------------------------------------------------------------------
# code: real functions
# --------------------------------------------------------------------------------------------


def _code_roots() -> list[tuple[str, Path]]:
    paths = sysconfig.get_paths()
    roots = [("stdlib", Path(paths["stdlib"]))]
    for key in ("purelib", "platlib"):
        p = Path(paths[key])
        if p.is_dir() and all(p != r for _, r in roots):
            roots.append(("site", p))
    return roots


@functools.lru_cache(maxsize=1)
def _code_files() -> tuple[tuple[str, Path], ...]:
    """(unit, path) of every usable ``.py`` file: stdlib modules and installed packages."""
    std = set(getattr(sys, "stdlib_module_names", ()))
    out = []
    for label, root in _code_roots():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            if _skip_path(rel.parts[:-1]) or rel.name.startswith("test_") or \
                    (label == "stdlib" and rel.parts[0].removesuffix(".py") not in std):
                continue
            out.append((f"code/{label}/{rel.as_posix()}", path))
    return tuple(out)


def _functions(path: Path) -> list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, list[str]]]:
    """Functions of 5–40 lines of a file, each with its dedented source lines."""
    try:
        if path.stat().st_size > 300_000:
            return []
        src = path.read_text(encoding="utf-8")
        tree = ast.parse(src)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError):
        return []
    lines, out = src.splitlines(), []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith(("test", "__")):
            continue  # tests and dunder methods (mostly __init__ boilerplate)
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        seg = lines[start - 1:node.end_lineno]
        body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        if not 5 <= len(seg) <= 40 or not body or all(isinstance(s, (ast.Pass, ast.Raise)) for s in body):
            continue
        text = "\n".join(seg)
        if not text.isascii() or max(map(len, seg)) > 110 or "# type: ignore" in text:
            continue
        out.append((node, textwrap.dedent(text).splitlines()))
    return out


_CODE_TASKS = [
    "Explain what this function does:\n\n```python\n{src}\n```",
    "Can you walk me through this Python code line by line?\n\n```python\n{src}\n```",
    "Write a unit test for this function using pytest:\n\n```python\n{src}\n```",
    "Find a bug in this code, or suggest an improvement if you don't see one:\n\n```python\n{src}\n```",
    "Rewrite this in a more readable way:\n\n```python\n{src}\n```",
    "I found this function in {where}. What is it for, and when would it be called?\n\n```python\n{src}\n```",
    "```python\n{src}\n```\n\nWhat edge cases does this function handle, and which does it miss?",
    "What is the time complexity of this function?\n\n```python\n{src}\n```",
]


def _code_prompt(node: ast.FunctionDef | ast.AsyncFunctionDef, seg: list[str], where: str,
                 r: random.Random) -> str:
    src = "\n".join(seg)
    doc = ast.get_docstring(node) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    annotated = node.returns is not None or any(a.annotation for a in node.args.args)
    choice = r.random()
    body = node.body[1:] if doc else node.body
    if choice < 0.25 and len(body) >= 3:  # complete: signature, docstring and the first statements given
        offset = min([node.lineno] + [d.lineno for d in node.decorator_list])
        keep = body[max(1, len(body) // 3) - 1].end_lineno - offset + 1
        return r.choice(["Complete this function:", "Finish writing this Python function:",
                         "Can you fill in the rest of this function?"]) + \
            "\n\n```python\n" + "\n".join(seg[:keep]) + "\n```"
    if choice < 0.35 and not annotated:
        what = "type hints" if doc else "type hints and a docstring"
        return f"Add {what} to this function:\n\n```python\n{src}\n```"
    if choice < 0.45 and 20 <= len(first) <= 200:
        args = ", ".join(a.arg for a in node.args.args)
        verb = first[0].lower() + first[1:].rstrip(".")
        return r.choice([f"Write a Python function `{node.name}({args})` that does this: {verb}.",
                         f"How would I write a function `{node.name}({args})` in Python? It should {verb}."])
    return r.choice(_CODE_TASKS).format(src=src, where=where)


def _code_file_items(unit: str, path: Path, seed: int, side: str, eval_fraction: float,
                     per_file: int = 3) -> Iterator[NaturalItem]:
    """Up to ``per_file`` prompts about functions of one file whose source falls on ``side``."""
    funcs = [(node, seg, key) for node, seg in _functions(path)
             if item_side(unit, key := source_key("\n".join(seg)), eval_fraction) == side]
    r = _rng("code", seed, unit)
    where = "the Python standard library" if unit.startswith("code/stdlib/") else \
        f"the `{unit.split('/')[2].removesuffix('.py')}` package"
    for node, seg, key in r.sample(funcs, min(per_file, len(funcs))):
        text = _code_prompt(node, seg, where, _rng("code", seed, unit, node.name, node.lineno))
        yield NaturalItem(Prompt(text, "code"), unit, key)


# --------------------------------------------------------------------------------------------
# math: a compositional word-problem generator
# --------------------------------------------------------------------------------------------

_PEOPLE = ["Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jonas", "Kemi", "Liam",
           "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf",
           "Zoe", "Aisha", "Mateo", "Lena", "Kofi", "Ines", "my sister", "my neighbour", "our teacher"]
_GOODS = [("notebook", "notebooks", 2, 9), ("pen", "pens", 1, 4), ("sandwich", "sandwiches", 4, 9),
          ("coffee", "coffees", 3, 6), ("T-shirt", "T-shirts", 8, 25), ("movie ticket", "movie tickets", 9, 15),
          ("bag of rice", "bags of rice", 3, 12), ("potted plant", "potted plants", 5, 20),
          ("paperback", "paperbacks", 7, 16), ("bus pass", "bus passes", 10, 40), ("mango", "mangoes", 1, 3),
          ("phone case", "phone cases", 6, 18), ("pizza", "pizzas", 9, 17), ("bike light", "bike lights", 8, 22)]
_SUFFIX = ["", "", "", "", " Show your working.", " Explain your reasoning step by step.",
           " Just give me the final answer.", " Can you walk me through it?", " Please explain briefly.",
           " I'd like to understand how to solve this kind of problem."]


def _person(r: random.Random) -> tuple[str, str]:
    """A name, and how the rest of the sentence refers to it."""
    n = r.choice(_PEOPLE)
    return (n[0].upper() + n[1:], n if not n.startswith(("my ", "our ")) else "they")


def _f_shopping(r: random.Random) -> tuple[str, list[str]]:
    name, they = _person(r)
    (s1, p1, lo1, hi1), (s2, p2, lo2, hi2) = r.sample(_GOODS, 2)
    q1, q2, c1, c2 = r.randint(2, 6), r.randint(2, 5), r.randint(lo1, hi1), r.randint(lo2, hi2)
    if r.random() < 0.6:
        total = q1 * c1 + q2 * c2
        bill = next(b for b in (20, 50, 100, 200, 500) if b > total)
        return f"change|{name}|{q1}x{c1}|{q2}x{c2}|{bill}", [
            f"How much change does {name} get from a ${bill} bill after buying {q1} {p1} at ${c1} each and "
            f"{q2} {p2} at ${c2} each?",
            f"{name} buys {q1} {p1} for ${c1} each and {q2} {p2} for ${c2} each, and pays with a ${bill} bill. "
            f"How much change should {they} get?",
            f"I bought {q1} {p1} (${c1} each) and {q2} {p2} (${c2} each) and handed over ${bill}. "
            f"How much change should I get back?",
            f"Work out the change from ${bill} for {q1} {p1} at ${c1} apiece plus {q2} {p2} at ${c2} apiece."]
    budget = r.randint(3, 12) * c1 + r.randint(0, c1 - 1)
    return f"budget|{name}|{c1}|{budget}|{s1}", [
        f"How many {p1} can {name} buy with ${budget} if each costs ${c1}, and how much money is left over?",
        f"{p1.capitalize()} cost ${c1} each. {name} has ${budget}. How many can {they} buy, and what's left?",
        f"I've got ${budget} to spend and {p1} are ${c1} each. How many can I get, and how much will I have left?",
        f"Find how many {p1} at ${c1} each fit into a ${budget} budget, and the money remaining."]


def _f_travel(r: random.Random) -> tuple[str, list[str]]:
    vehicle, lo, hi, step = r.choice([("car", 40, 110, 5), ("train", 60, 160, 10), ("cyclist", 12, 24, 1),
                                      ("bus", 30, 70, 5), ("hiker", 3, 6, 1), ("ferry", 15, 40, 5)])
    v, t = r.randrange(lo, hi + 1, step), r.randint(2, 6)
    d = v * t
    kind = r.randrange(3)
    if kind == 0:
        return f"speed|{vehicle}|{d}|{t}", [
            f"What is the average speed of a {vehicle} that covers {d} km in {t} hours?",
            f"A {vehicle} travels {d} km in {t} hours. What is its average speed in km/h?",
            f"I went {d} km by {vehicle if vehicle not in ('cyclist', 'hiker') else 'bike'} and it took me {t} "
            f"hours. How fast was I going on average?",
            f"Find the average speed, in kilometres per hour, of a {vehicle} that goes {d} km in {t} hours."]
    if kind == 1:
        h = r.randint(6, 14)
        return f"arrive|{vehicle}|{d}|{v}|{h}", [
            f"When does a {vehicle} arrive if it leaves at {h}:00, travels {d} km, and averages {v} km/h?",
            f"A {vehicle} sets off at {h}:00 and has {d} km to go at an average of {v} km/h. When will it arrive?",
            f"We're leaving at {h}:00 and the trip is {d} km. If we average {v} km/h, what time do we get there?",
            f"Calculate the arrival time of a {vehicle} that leaves at {h}:00 for a {d} km trip at {v} km/h."]
    v2, t2 = r.randrange(lo, hi + 1, step), r.randint(1, 4)
    return f"legs|{vehicle}|{d}|{v}|{v2 * t2}|{v2}", [
        f"How long does a trip take if a {vehicle} goes {d} km at {v} km/h and then {v2 * t2} km at {v2} km/h? "
        f"What is the average speed overall?",
        f"A {vehicle} covers {d} km at {v} km/h, then another {v2 * t2} km at {v2} km/h. Find the total time "
        f"and the average speed for the whole journey.",
        f"My journey is {d} km at about {v} km/h and then {v2 * t2} km at {v2} km/h. How long will it take "
        f"in total, and what's my average speed?"]


def _f_recipe(r: random.Random) -> tuple[str, list[str]]:
    if r.random() < 0.6:
        s = r.choice([2, 4, 6])
        s2 = s * r.choice([2, 3]) if r.random() < 0.6 else s // 2 * r.choice([3, 5])
        dish, a, ua, b, ub = r.choice([("pancakes", 50, "g of flour", 1, "eggs"),
                                       ("soup", 100, "g of lentils", 250, "ml of stock"),
                                       ("cookies", 40, "g of butter", 30, "g of sugar"),
                                       ("lemonade", 1, "lemons", 150, "ml of water"),
                                       ("a curry", 75, "g of rice", 50, "ml of coconut milk")])
        fa, fb = a * s, b * s
        return f"recipe|{dish}|{s}|{s2}|{fa}|{fb}", [
            f"How much do I need for {s2} people if a recipe for {dish} serving {s} uses {fa} {ua} and {fb} {ub}?",
            f"A recipe for {dish} serves {s} and needs {fa} {ua} and {fb} {ub}. How much of each is needed for "
            f"{s2} servings?",
            f"My {dish} recipe makes enough for {s} and calls for {fa} {ua} plus {fb} {ub}. I'm cooking for "
            f"{s2}. How much of each should I use?",
            f"Scale this recipe from {s} to {s2} servings: {fa} {ua} and {fb} {ub} ({dish})."]
    a, b = r.sample(range(1, 8), 2)
    total = (a + b) * r.randint(2, 12)
    what, x, y = r.choice([("paint", "blue", "white"), ("a drink", "juice", "water"),
                           ("concrete", "sand", "cement"), ("a fertiliser mix", "compost", "soil")])
    return f"ratio|{what}|{a}|{b}|{total}", [
        f"How many litres of {x} and of {y} go into {total} litres of {what} mixed in the ratio {a}:{b}?",
        f"{what.capitalize()} is mixed {x} to {y} in the ratio {a}:{b}. For {total} litres, how much of each "
        f"do you need?",
        f"I want to make {total} litres of {what} with {x} and {y} in a {a}:{b} ratio. How much of each?",
        f"Split {total} litres of {what} into {x} and {y} in the ratio {a}:{b}."]


def _f_percent(r: random.Random) -> tuple[str, list[str]]:
    kind = r.randrange(4)
    if kind == 0:
        price, pct = 20 * r.randint(2, 30), r.choice([10, 15, 20, 25, 30, 40, 50])
        item = r.choice(["coat", "laptop bag", "bike", "pair of boots", "desk lamp", "backpack"])
        return f"discount|{item}|{price}|{pct}", [
            f"What do I pay for a ${price} {item} with {pct}% off?",
            f"A {item} normally costs ${price}. It's {pct}% off this week. What is the sale price?",
            f"The {item} I want is ${price}, but there's a {pct}% discount. How much will I actually pay, "
            f"and how much do I save?",
            f"Calculate the price of a ${price} {item} after a {pct}% discount."]
    if kind == 1:
        salary, pct = 100 * r.randint(20, 60), r.choice([2, 3, 4, 5, 6, 8, 10])
        name, they = _person(r)
        return f"raise|{name}|{salary}|{pct}", [
            f"What is {name}'s new monthly pay after a {pct}% raise on ${salary}?",
            f"{name} earns ${salary} a month and gets a {pct}% raise. How much does {they} earn now?",
            f"I make ${salary} a month and my boss offered a {pct}% raise. What will my new salary be?",
            f"Increase ${salary} by {pct}% and give the new amount."]
    if kind == 2:
        n, pct = 20 * r.randint(1, 15), 5 * r.randint(1, 19)
        group, act = r.choice([("students", "walk to school"), ("employees", "work remotely"),
                               ("people surveyed", "prefer tea to coffee"), ("members", "came to the meeting")])
        return f"share|{group}|{n}|{pct}", [
            f"How many {group} {act} if {pct}% of {n} do?",
            f"Out of {n} {group}, {pct}% {act}. How many is that, and how many don't?",
            f"We asked {n} {group} and {pct}% said they {act}. How many people is that?",
            f"Find {pct}% of {n} {group} (those who {act})."]
    price, pct = 20 * r.randint(2, 30), r.choice([10, 20, 25, 50])
    sale = price * (100 - pct) // 100
    return f"reverse|{price}|{pct}", [
        f"What was the original price of something that costs ${sale} after a {pct}% discount?",
        f"After a {pct}% discount, a jacket costs ${sale}. What did it cost before the sale?",
        f"I paid ${sale} for a lamp that was {pct}% off. What was the full price?",
        f"Work out the pre-discount price if ${sale} is the price after {pct}% off."]


def _f_ages(r: random.Random) -> tuple[str, list[str]]:
    (a, _), (b, _) = _person(r), _person(r)
    while b == a:
        b = _person(r)[0]
    young, k = r.randint(3, 15), r.randint(2, 4)
    old = k * young
    if r.random() < 0.5:
        return f"times|{a}|{b}|{old}|{young}", [
            f"How old are {a} and {b} if {a} is {k} times as old as {b} and together they are {old + young}?",
            f"{a} is {k} times as old as {b}. Their ages add up to {old + young}. How old is each of them?",
            f"My age is {k} times my nephew's, and together we're {old + young}. How old are we?",
            f"Find the two ages: one is {k} times the other and they sum to {old + young}."]
    old = 2 * young + r.randint(3, 20)
    return f"twice|{old}|{young}", [
        f"In how many years will a parent aged {old} be exactly twice as old as a child aged {young}?",
        f"A mother is {old} and her son is {young}. In how many years will she be twice his age?",
        f"I'm {old} and my daughter is {young}. How many years until I'm exactly twice her age?",
        f"Determine when someone aged {old} will be double the age of someone aged {young}."]


def _f_area(r: random.Random) -> tuple[str, list[str]]:
    kind = r.randrange(3)
    if kind == 0:
        ln, w = r.randint(3, 12), r.randint(2, 9)
        return f"tiles|{ln}|{w}", [
            f"How many 50 cm square tiles cover a {ln} m by {w} m floor?",
            f"A room is {ln} m long and {w} m wide. How many square tiles of side 50 cm are needed to cover it?",
            f"I'm tiling a {ln} m × {w} m kitchen floor with 50 cm × 50 cm tiles. How many tiles do I need?",
            f"Compute the number of 0.5 m square tiles needed for a {ln} m by {w} m floor."]
    if kind == 1:
        ln, w, price = r.randint(5, 40), r.randint(4, 25), r.randint(3, 15)
        return f"fence|{ln}|{w}|{price}", [
            f"What does it cost to fence a {ln} m by {w} m garden at ${price} per metre?",
            f"A garden is a {ln} m by {w} m rectangle. Fencing costs ${price} a metre. What will fencing it cost?",
            f"I want to put a fence around my {ln} m × {w} m yard and it's ${price} per metre. What's the total?",
            f"Find the perimeter and the fencing cost of a {ln} m by {w} m plot at ${price}/m."]
    side, path = r.randint(6, 20), r.randint(1, 2)
    return f"path|{side}|{path}", [
        f"What is the area of a {path} m wide path around a square lawn of side {side} m?",
        f"A square lawn of side {side} m has a path {path} m wide all the way around it. "
        f"What is the area of the path?",
        f"My lawn is a {side} m square and I'm laying a {path} m gravel path around the outside. "
        f"How many square metres of gravel path is that?",
        f"Calculate the area of a {path}-metre border around a {side} m by {side} m square."]


_RATE_PAIRS = [(3, 6), (4, 12), (6, 12), (10, 15), (12, 24), (20, 30), (6, 3), (12, 4), (15, 10), (5, 20),
               (8, 24), (9, 18), (30, 20), (24, 8)]


def _f_work(r: random.Random) -> tuple[str, list[str]]:
    if r.random() < 0.6:
        a, b = r.choice(_RATE_PAIRS)
        (x, _), (y, _) = _person(r), _person(r)
        job, unit = r.choice([("paint the fence", "hours"), ("fill the pool", "hours"),
                              ("sort the library donations", "hours"), ("clear the field", "days")])
        return f"together|{job}|{a}|{b}", [
            f"How long do {x} and {y} take to {job} together if {x} alone needs {a} {unit} and {y} alone {b}?",
            f"{x} can {job} in {a} {unit}; {y} can do it in {b} {unit}. Working together, how long will it take?",
            f"It takes me {a} {unit} to {job} and my friend {b} {unit}. If we work together, how long will it take?",
            f"Work out the combined time to {job} when one person takes {a} {unit} and another {b}."]
    k, d = r.choice([2, 3, 4, 6, 8, 12]), r.choice([3, 4, 5, 6, 10, 12])
    m = r.choice([x for x in range(2, 25) if x != k and k * d % x == 0])  # a whole number of days
    return f"crew|{k}|{d}|{m}", [
        f"How many days do {m} workers need for a job that {k} workers finish in {d} days?",
        f"{k} builders finish a wall in {d} days. How long would {m} builders take, working at the same rate?",
        f"Our team of {k} usually takes {d} days for this job. If we had {m} people, how many days would it take?",
        f"Find how long {m} workers need if {k} workers need {d} days."]


def _f_interest(r: random.Random) -> tuple[str, list[str]]:
    p, rate, years = 500 * r.randint(1, 20), r.choice([2, 3, 4, 5, 6, 8]), r.randint(2, 6)
    if r.random() < 0.6:
        return f"simple|{p}|{rate}|{years}", [
            f"How much simple interest does ${p} earn at {rate}% a year over {years} years?",
            f"${p} is invested at {rate}% simple interest per year. How much interest is earned after {years} "
            f"years, and what is the total?",
            f"If I put ${p} in an account paying {rate}% simple interest, how much will I have after {years} years?",
            f"Calculate the simple interest on ${p} at {rate}% per year for {years} years."]
    p, rate = 1000 * r.randint(1, 10), r.choice([5, 10])
    return f"compound|{p}|{rate}|{years}", [
        f"What does ${p} grow to in {years} years at {rate}% compound interest per year?",
        f"${p} is invested at {rate}% a year, compounded annually. What is it worth after {years} years?",
        f"I'm leaving ${p} in a savings account at {rate}% a year, compounded yearly. How much will be there "
        f"after {years} years?",
        f"Compute the value of ${p} after {years} years of {rate}% annual compound interest."]


def _f_units(r: random.Random) -> tuple[str, list[str]]:
    kind = r.randrange(4)
    if kind == 0:
        h, m = r.randint(1, 9), r.choice([0, 10, 15, 20, 30, 45])
        return f"seconds|{h}|{m}", [
            f"How many seconds are there in {h} hours and {m} minutes?",
            f"A film lasts {h} hours and {m} minutes. How long is that in seconds?",
            f"My run took {h} h {m} min. What's that in seconds?",
            f"Convert {h} hours {m} minutes into seconds."]
    if kind == 1:
        litres, glass = r.choice([1, 2, 3, 5]), r.choice([200, 250, 500])
        return f"glasses|{litres}|{glass}", [
            f"How many {glass} ml glasses can be filled from {litres} litres of juice?",
            f"A jug holds {litres} litres. How many glasses of {glass} ml can it fill?",
            f"I have {litres} litres of lemonade for the party. How many {glass} ml cups is that?",
            f"Divide {litres} litres into {glass} ml servings and say how many there are."]
    if kind == 2:
        c = r.choice([100, 120, 150, 160, 180, 200, 220, 250])
        return f"oven|{c}", [
            f"What is {c} °C in Fahrenheit?",
            f"My recipe says to bake at {c} °C but my oven uses Fahrenheit. What should I set it to?",
            f"An oven is set to {c} degrees Celsius. What temperature is that in Fahrenheit?",
            f"Convert {c} °C to °F using F = C × 9/5 + 32."]
    pace, dist = r.randint(4, 8), r.choice([5, 10, 21, 42])
    return f"pace|{pace}|{dist}", [
        f"How long does a {dist} km run take at {pace} minutes per km?",
        f"A runner keeps a pace of {pace} minutes per kilometre. How long does a {dist} km race take, "
        f"in hours and minutes?",
        f"I run about {pace} minutes per km. If I enter a {dist} km race, how long will I be out there?",
        f"Work out the finishing time for {dist} km at a steady {pace} min/km."]


def _f_probability(r: random.Random) -> tuple[str, list[str]]:
    kind = r.randrange(3)
    if kind == 0:
        s = r.randint(3, 11)
        return f"dice|{s}", [
            f"What is the probability that two fair dice add up to {s}?",
            f"Two fair six-sided dice are rolled. What is the probability that their sum is {s}?",
            f"If I roll two dice, what are the chances the total is {s}?",
            f"Find the probability of rolling a total of {s} with two dice."]
    if kind == 1:
        n = r.randint(2, 5)
        k = r.randint(1, n)
        return f"coins|{n}|{k}", [
            f"What is the probability of exactly {k} heads in {n} fair coin flips?",
            f"A fair coin is tossed {n} times. What is the probability of getting exactly {k} heads?",
            f"I flip a coin {n} times. What are the odds of exactly {k} heads?",
            f"Compute P(exactly {k} heads) for {n} tosses of a fair coin."]
    red, blue = r.randint(2, 8), r.randint(2, 8)
    return f"marbles|{red}|{blue}", [
        f"What is the probability that two marbles drawn without replacement from a bag of {red} red and "
        f"{blue} blue are both red?",
        f"A bag has {red} red and {blue} blue marbles. Two are drawn without replacement. "
        f"What is the probability that both are red?",
        f"My kid's bag has {red} red and {blue} blue marbles. If she grabs two without looking, how likely is "
        f"it that they're both red?",
        f"Find the probability of drawing two red marbles in a row (no replacement) from {red} red and "
        f"{blue} blue."]


def _f_sequence(r: random.Random) -> tuple[str, list[str]]:
    kind = r.randrange(3)
    if kind == 0:
        name, they = _person(r)
        a, d, k = r.randint(2, 20), r.randint(1, 5), r.randint(5, 12)
        return f"savings|{a}|{d}|{k}", [
            f"How much does {name} save in week {k}, and in total, starting with ${a} and adding ${d} more each "
            f"week than the week before?",
            f"{name} saves ${a} in the first week and ${d} more each week after that. How much does {they} save "
            f"in week {k}, and how much altogether over {k} weeks?",
            f"I'm saving ${a} this week and plan to add ${d} more every week. How much will I put away in week "
            f"{k}, and what's my total by then?",
            f"Find the week-{k} amount and the {k}-week total for savings of ${a}, ${a + d}, ${a + 2 * d}, …"]
    if kind == 1:
        n0, h = r.choice([50, 100, 200, 500, 1000]), r.choice([1, 2, 3, 4])
        t = h * r.randint(3, 8)
        return f"doubling|{n0}|{h}|{t}", [
            f"How many bacteria are there after {t} hours if a colony of {n0} doubles every {h} hours?",
            f"A colony of {n0} bacteria doubles every {h} hours. How many bacteria are there after {t} hours?",
            f"I started a culture with {n0} cells and they double every {h} hours. How many will I have after "
            f"{t} hours?",
            f"Compute the population after {t} hours: {n0} initially, doubling every {h} hours."]
    a, d = r.randint(1, 30), r.randint(2, 9)
    return f"terms|{a}|{d}", [
        f"What comes next in {a}, {a + d}, {a + 2 * d}, {a + 3 * d}, …, and what is the 20th term?",
        f"The sequence {a}, {a + d}, {a + 2 * d}, {a + 3 * d}, … continues the same way. What is the next "
        f"number, and the 20th?",
        f"There's a pattern in {a}, {a + d}, {a + 2 * d}, {a + 3 * d}. What's the next number, and what would "
        f"the 20th one be?",
        f"Find the rule, the next term and the 20th term of {a}, {a + d}, {a + 2 * d}, {a + 3 * d}, …"]


def _f_average(r: random.Random) -> tuple[str, list[str]]:
    while True:
        scores, target = [r.randint(55, 98) for _ in range(3)], r.randint(70, 92)
        need = 4 * target - sum(scores)
        if 0 <= need <= 100:
            break
    s = ", ".join(map(str, scores[:2])) + f" and {scores[2]}"
    return f"average|{scores}|{target}", [
        f"What score do I need on the fourth test to average {target}, if the first three were {s}?",
        f"A student scored {s} on three tests. What must the fourth score be for an average of {target}?",
        f"So far my test results are {s}. What do I need on the last test to finish with an average of {target}?",
        f"Find the fourth score that makes the average of {s} and it equal to {target}."]


def _f_clock(r: random.Random) -> tuple[str, list[str]]:
    h, m, dh, dm = r.randint(7, 20), r.choice([0, 5, 10, 15, 20, 30, 40, 45, 50]), r.randint(1, 3), r.randint(5, 55)
    if r.random() < 0.5:
        what = r.choice(["movie", "concert", "flight", "exam", "football match"])
        return f"ends|{h}|{m}|{dh}|{dm}", [
            f"What time does a {what} end if it starts at {h}:{m:02d} and lasts {dh} h {dm} min?",
            f"A {what} starts at {h}:{m:02d} and runs for {dh} hours and {dm} minutes. When does it finish?",
            f"The {what} I'm going to starts at {h}:{m:02d} and it's {dh} h {dm} min long. What time will it be over?",
            f"Add {dh} hours {dm} minutes to {h}:{m:02d} and give the end time of the {what}."]
    name, they = _person(r)
    wage, hours, days = r.randint(12, 40), r.randint(4, 9), r.randint(3, 6)
    return f"wage|{wage}|{hours}|{days}", [
        f"How much does {name} earn in a week working {hours} hours a day, {days} days a week, at ${wage} an hour?",
        f"{name} earns ${wage} per hour and works {hours} hours a day, {days} days a week. What does {they} "
        f"earn in a week, and in four weeks?",
        f"My job pays ${wage} an hour and I do {hours}-hour shifts {days} days a week. What's my weekly pay?",
        f"Calculate weekly and four-weekly earnings at ${wage}/hour for {hours} hours a day, {days} days a week."]


_FRAMES: dict[str, Callable[[random.Random], tuple[str, list[str]]]] = {
    "shopping": _f_shopping, "travel": _f_travel, "recipe": _f_recipe, "percent": _f_percent, "ages": _f_ages,
    "area": _f_area, "work": _f_work, "interest": _f_interest, "units": _f_units,
    "probability": _f_probability, "sequence": _f_sequence, "average": _f_average, "clock": _f_clock}


def _math_items(seed: int) -> Iterator[NaturalItem]:
    """Unbounded stream of word problems; unit = frame/seed/index, source = the problem's facts."""
    frames = sorted(_FRAMES)
    i = 0
    while True:
        for frame in frames:
            unit = f"math/{frame}/{seed}/{i}"
            r = _rng(unit)
            facts, phrasings = _FRAMES[frame](r)
            text = r.choice(phrasings) + r.choice(_SUFFIX)
            yield NaturalItem(Prompt(text, "math"), unit, source_key(f"{frame}|{facts}"))
        i += 1


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


# --------------------------------------------------------------------------------------------
# streams and the split
# --------------------------------------------------------------------------------------------


def _reserved(items: Iterable[NaturalItem], eval_fraction: float) -> set[str]:
    cut = max(eval_fraction, RESERVED_FRACTION)
    return {it.source for it in items if band("unit:" + it.unit) < cut}


def _round_robin(queues: list[list]) -> Iterator:
    """One element of each queue in turn until all are empty (the queues are consumed)."""
    queues = [q[::-1] for q in queues if q]
    while queues:
        for q in queues:
            yield q.pop()
        queues = [q for q in queues if q]


def _closed(items: list[NaturalItem], side: str, eval_fraction: float, seed: int, tag: str,
            per_unit: int | None = None, reserved: set[str] | None = None) -> Iterator[NaturalItem]:
    """Items of a fully enumerated source on one side, round-robin over units in a seeded order;
    every first request about a source before any second one. ``reserved``: the source keys of
    the reserved units (default: computed from ``items``)."""
    reserved = _reserved(items, eval_fraction) if reserved is None else reserved
    by_unit: dict[str, list[NaturalItem]] = {}
    for it in items:
        if item_side(it.unit, it.source, eval_fraction, reserved) == side:
            by_unit.setdefault(it.unit, []).append(it)
    units = sorted(by_unit, key=lambda u: band(f"{tag}:{seed}:{u}"))
    for unit in units:
        _rng(tag, seed, unit).shuffle(by_unit[unit])
        if per_unit:
            del by_unit[unit][per_unit:]
    for rank in sorted({it.rank for it in items}):
        yield from _round_robin([[it for it in by_unit[u] if it.rank == rank] for u in units])


def _code_stream(side: str, eval_fraction: float, seed: int) -> Iterator[NaturalItem]:
    """Functions of the files on one side, files in a seeded order, round-robin over packages (so
    a package with thousands of files does not crowd out the rest)."""
    by_pkg: dict[str, list[tuple[str, Path]]] = {}
    for unit, path in _code_files():
        if item_side(unit, "", eval_fraction, set()) == side:  # the unit decides; sources below
            by_pkg.setdefault(unit.split("/")[2].removesuffix(".py"), []).append((unit, path))
    queues = [sorted(files, key=lambda up: band(f"code-order:{seed}:{up[0]}"))
              for _pkg, files in sorted(by_pkg.items(), key=lambda kv: band(f"code-pkg:{seed}:{kv[0]}"))]
    for unit, path in _round_robin(queues):
        yield from _code_file_items(unit, path, seed, side, eval_fraction, 3 if side == "train" else 1)


def _math_stream(side: str, eval_fraction: float, seed: int, limit: int = 2_000_000) -> Iterator[NaturalItem]:
    for i, it in enumerate(_math_items(seed)):
        if i >= limit:
            return
        if item_side(it.unit, it.source, eval_fraction) == side:
            yield it


def _mix(streams: list[tuple[float, Iterator[NaturalItem]]], r: random.Random) -> Iterator[NaturalItem]:
    """Interleave streams by weight until all are exhausted."""
    live = list(streams)
    while live:
        w, it = r.choices(live, weights=[w for w, _ in live])[0]
        try:
            yield next(it)
        except StopIteration:
            live.remove((w, it))


def natural_items(domain: str, side: str = "train", seed: int = 0, eval_fraction: float = RESERVED_FRACTION,
                  followups: Sequence[NaturalItem] = ()) -> Iterator[NaturalItem]:
    """Lazily, the natural items of one domain on one side (``"train"`` or ``"eval"``) of the split:
    one per source text (training adds a second request about a documentation paragraph once the
    first ones run out). Training items never reuse a source of the shipped eval set."""
    if domain not in DOMAINS:
        raise ValueError(f"unknown natural domain {domain!r}; known: {', '.join(DOMAINS)}")
    if side not in ("train", "eval"):
        raise ValueError(f"side must be 'train' or 'eval', got {side!r}")
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction!r}")
    if domain == "code":
        streams = [(1.0, _code_stream(side, eval_fraction, seed))]
    else:
        docs = _docs()
        doc_items = [it for d in docs for it in _doc_items(d, seed)]  # every paragraph, heading, summary
        reserved = _reserved(doc_items, eval_fraction)  # shared by chat and math: a paragraph is one source
        if domain == "chat":
            streams = [(2.0, _closed(doc_items, side, eval_fraction, seed, "docs", reserved=reserved))]
            if followups:
                streams.append((1.0, _closed(list(followups), side, eval_fraction, seed, "turns")))
        else:
            num_items = [it for d in docs for it in _doc_number_items(d, seed)]
            streams = [(9.0, _math_stream(side, eval_fraction, seed)),
                       (1.0, _closed(num_items, side, eval_fraction, seed, "docnum", 3, reserved))]
    banned = shipped_eval_keys() if side == "train" else frozenset()
    seen_keys: set[str] = set()
    uses: dict[str, int] = {}
    for it in _mix(streams, _rng("mix", domain, side, seed)):
        n = uses.get(it.source, 0)
        ok = n == 0 if it.rank == 0 else side == "train" and n == 1  # a second request: training only
        if ok and it.prompt.key not in seen_keys and it.source not in banned:
            seen_keys.add(it.prompt.key)
            uses[it.source] = n + 1
            yield it


def natural_split(per_domain: int, seed: int = 0, eval_fraction: float = 0.1, domains: Iterable[str] = DOMAINS,
                  followups: Sequence[NaturalItem] = ()) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held-out): ``per_domain`` prompts per domain, ``round(per_domain * eval_fraction)`` of
    them held out, split by source unit (fewer when the installed packages run out)."""
    if per_domain < 0:
        raise ValueError(f"per_domain must be >= 0, got {per_domain}")
    train, held = [], []
    for d in domains:
        n_eval = round(per_domain * eval_fraction)
        for side, n, out in (("train", per_domain - n_eval, train), ("eval", n_eval, held)):
            for i, it in enumerate(natural_items(d, side, seed, eval_fraction, followups)):
                if i >= n:
                    break
                out.append(it.prompt)
    return train, held
