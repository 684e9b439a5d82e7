"""Chat prompts from documentation: paragraphs, headings and summaries of installed packages."""

from __future__ import annotations

import functools
import importlib.metadata
import random
import re
import sys
import sysconfig
import textwrap
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from attrs import frozen

from dspark.data.natural.common import _OWN, NaturalItem, _rng, source_key
from dspark.data.prompts import Prompt

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
