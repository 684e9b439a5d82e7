"""The documentation stays true to the code.

* docs/cli.md is exactly what ``python -m dspark.cli_docs`` renders from the argparse parsers;
* every relative link in README.md and docs/*.md points at an existing file (and, for a
  ``#fragment``, at an existing heading of that Markdown file);
* every backticked ``dspark.module.attr`` reference in the architecture and math docs imports;
* docs/architecture.md names every protocol, and every page of docs/ is reachable by links from README.md.
"""

from __future__ import annotations

import importlib
import re
from collections import Counter
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MARKDOWN = sorted(DOCS.glob("*.md")) + sorted((DOCS / "reports").rglob("*.md")) + [ROOT / "README.md"]
REFERENCE_DOCS = [DOCS / "architecture.md", DOCS / "math.md"]

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_INLINE_CODE = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"`(dspark(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _prose(text: str) -> str:
    """Markdown without fenced code blocks (mermaid and shell snippets are not links)."""
    return _FENCE.sub("", text)


@cache
def _anchors(path: Path) -> frozenset[str]:
    """GitHub's heading anchors of a Markdown file (lower case, punctuation dropped, spaces → -,
    repeats suffixed -1, -2, ...)."""
    seen: Counter[str] = Counter()
    out = set()
    for heading in _HEADING.findall(_prose(path.read_text(encoding="utf-8"))):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
        slug = "".join(c for c in text.lower() if c.isalnum() or c in " -_").replace(" ", "-")
        out.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return frozenset(out)


# ------------------------------------------------------------------------------------------
# (a) the generated CLI reference
# ------------------------------------------------------------------------------------------


def test_cli_reference_is_up_to_date():
    from dspark.cli_docs import REGENERATE, cli_reference

    expected = cli_reference()
    path = DOCS / "cli.md"
    actual = path.read_text(encoding="utf-8") if path.is_file() else ""
    assert actual == expected, (
        f"docs/cli.md is out of date with the dspark / dspark.export parsers; regenerate it with "
        f"`{REGENERATE}` (from the repository root) and commit the result"
    )


def test_cli_reference_covers_every_command():
    from dspark.cli import build_parser
    from dspark.cli_docs import cli_reference

    text = cli_reference()
    parser = build_parser()
    names = next(
        a.choices for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict)
    )
    for name in names:
        assert f"## `dspark {name}`" in text
    assert "## `python -m dspark.export`" in text
    assert "\x1b" not in text  # no terminal colours


# ------------------------------------------------------------------------------------------
# (b) relative links
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("doc", MARKDOWN, ids=_rel)
def test_relative_links_resolve(doc: Path):
    text = _INLINE_CODE.sub("", _prose(doc.read_text(encoding="utf-8")))
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
            continue
        file_part, _, fragment = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target} (no file {dest})")
        elif fragment and dest.suffix == ".md" and fragment.lower() not in _anchors(dest):
            broken.append(f"{target} (no heading #{fragment} in {_rel(dest)})")
    assert not broken, f"{_rel(doc)} has broken links: " + "; ".join(broken)


def _links(page: Path) -> set[Path]:
    """The Markdown files a page links (relative links, fragments dropped)."""
    text = _prose(page.read_text(encoding="utf-8"))
    out = set()
    for target in _LINK.findall(text):
        path = target.partition("#")[0]
        if path and "://" not in path and path.endswith(".md"):
            out.add((page.parent / path).resolve())
    return out


def test_every_doc_page_is_reachable_from_the_readme():
    """Every page of docs/ (dated reports under docs/reports/ included) can be reached by links
    from README.md: a guide directly or through another page, a report through the page that
    cites it."""
    seen, todo = set(), [(ROOT / "README.md").resolve()]
    while todo:
        page = todo.pop()
        if page in seen or not page.is_file():
            continue
        seen.add(page)
        todo.extend(_links(page) - seen)
    pages = sorted(DOCS.glob("*.md")) + sorted((DOCS / "reports").glob("*.md"))
    missing = [_rel(p) for p in pages if p.resolve() not in seen]
    assert not missing, f"no chain of links from README.md reaches {missing}"


# ------------------------------------------------------------------------------------------
# (c) code references
# ------------------------------------------------------------------------------------------


def _resolve(dotted: str) -> object:
    """Import the longest importable module prefix of ``dotted``, then getattr the rest."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name is None or not ".".join(parts[:cut]).startswith(exc.name):
                raise  # the module exists but one of its own imports is missing
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("doc", REFERENCE_DOCS, ids=_rel)
def test_code_references_resolve(doc: Path):
    refs = sorted(set(_REFERENCE.findall(_prose(doc.read_text(encoding="utf-8")))))
    assert len(refs) >= 10, f"{_rel(doc)}: expected `dspark.module.attr` references, found {refs}"
    broken = []
    for ref in refs:
        try:
            _resolve(ref)
        except (ImportError, AttributeError) as exc:
            broken.append(f"`{ref}` ({type(exc).__name__}: {exc})")
    assert not broken, f"{_rel(doc)} references code that does not exist: " + "; ".join(broken)


# ------------------------------------------------------------------------------------------
# (d) the architecture page names every protocol
# ------------------------------------------------------------------------------------------


def test_architecture_names_every_protocol():
    import dspark.protocols

    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    missing = [n for n in dspark.protocols.__all__ if not re.search(rf"\b{re.escape(n)}\b", text)]
    assert not missing, f"docs/architecture.md does not describe the protocols {missing}"
