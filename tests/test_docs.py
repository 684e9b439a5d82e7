"""The documentation stays true to the code.

* docs/cli.md is exactly what ``python -m dspark.cli_docs`` renders from the argparse parsers;
* every relative link in README.md, docs/*.md and docs/reports/ points at an existing file (and,
  for a ``#fragment``, at an existing heading of that Markdown file);
* every backticked ``dspark.module.attr`` reference in docs/concepts.md imports;
* docs/concepts.md names every protocol and every built-in plugin;
* README.md links every guide (docs/*.md, at most 12 of them), docs/reports/README.md links every
  report, and every page of docs/ is reachable by links from README.md;
* README.md stays short (≤ 700 words) and its results table is what ``scripts/results_table.py``
  renders from docs/reports/results.json;
* no page names an absolute machine path (``/work/...``, ``/tmp/...``): runs are ``RUNS/...``;
* every ```` ```python ```` block of README.md and the guides runs here, or is marked
  ``<!-- not executed: REASON -->`` or ``<!-- executed by tests/FILE.py::TEST -->`` on the line
  before it.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
from collections import Counter
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MARKDOWN = sorted(DOCS.glob("*.md")) + sorted((DOCS / "reports").rglob("*.md")) + [ROOT / "README.md"]
GUIDES = sorted(DOCS.glob("*.md"))
REPORTS = DOCS / "reports"
REFERENCE_DOCS = [DOCS / "concepts.md"]
MAX_GUIDES = 12
MAX_README_WORDS = 700

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
# (d) the concepts page names every protocol and every built-in
# ------------------------------------------------------------------------------------------


def test_concepts_names_every_protocol():
    import dspark.protocols

    text = (DOCS / "concepts.md").read_text(encoding="utf-8")
    missing = [n for n in dspark.protocols.__all__ if not re.search(rf"\b{re.escape(n)}\b", text)]
    assert not missing, f"docs/concepts.md does not describe the protocols {missing}"


def test_concepts_table_lists_every_builtin():
    """The table of built-in names in docs/concepts.md is what `dspark plugins` lists for dspark."""
    import dspark

    text = (DOCS / "concepts.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| (\w+) \| (.+) \|$", text, flags=re.M))
    missing = [f"{r['kind']} {r['name']}" for r in dspark.list_plugins()
               if r["plugin"] == "dspark" and f"`{r['name']}`" not in rows.get(r["kind"], "")]
    assert not missing, f"docs/concepts.md's table of built-ins misses {missing}"


# ------------------------------------------------------------------------------------------
# (e) guides, reports and the README
# ------------------------------------------------------------------------------------------


def _direct_links(page: Path) -> set[Path]:
    return _links(page)


def test_the_readme_links_every_guide_and_there_are_few():
    assert len(GUIDES) <= MAX_GUIDES, (
        f"docs/ holds {len(GUIDES)} guides ({[p.name for p in GUIDES]}); at most {MAX_GUIDES}: merge "
        "guides by user task, and put dated measurements in docs/reports/")
    linked = _direct_links(ROOT / "README.md")
    missing = [_rel(p) for p in GUIDES if p.resolve() not in linked]
    assert not missing, f"README.md does not link the guides {missing}"
    assert (REPORTS / "README.md").resolve() in linked, "README.md does not link docs/reports/README.md"


def test_the_reports_index_links_every_report():
    index = REPORTS / "README.md"
    linked = _direct_links(index)
    missing = [_rel(p) for p in sorted(REPORTS.glob("*.md")) if p != index and p.resolve() not in linked]
    assert not missing, f"docs/reports/README.md does not list the reports {missing}"


def test_the_readme_is_short():
    words = len((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert words <= MAX_README_WORDS, f"README.md has {words} words (at most {MAX_README_WORDS})"


def _results_table_module():
    spec = importlib.util.spec_from_file_location("results_table", ROOT / "scripts" / "results_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_results_table_is_rendered_from_results_json():
    table = _results_table_module()
    assert table.current() == table.render(), (
        "README.md's results table differs from docs/reports/results.json; run "
        "`python scripts/results_table.py`")
    rows = json.loads(table.RESULTS.read_text(encoding="utf-8"))["rows"]
    assert rows and all({"date", "machine", "command", "figure"} <= set(r) for r in rows)
    for row in rows:
        assert (ROOT / row["report"]).is_file(), f"results.json names a missing report {row['report']}"


_MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|tmp|home|root|mnt|scratch)/")


@pytest.mark.parametrize(
    "page", MARKDOWN + sorted(DOCS.rglob("*.json")), ids=_rel)
def test_no_absolute_machine_paths(page: Path):
    bad = [line.strip()[:120] for line in page.read_text(encoding="utf-8").splitlines()
           if _MACHINE_PATH.search(line)]
    assert not bad, f"{_rel(page)} names absolute machine paths (write RUNS/... or OUT/...): {bad}"


# ------------------------------------------------------------------------------------------
# (f) Python blocks of the README and the guides
# ------------------------------------------------------------------------------------------

_PY_BLOCK = re.compile(r"(?:^<!--[ \t]*(?P<mark>[^\n]*?)[ \t]*-->[ \t]*\n)?^```python[ \t]*\n(?P<code>.*?)^```",
                       re.M | re.S)


def _python_blocks() -> list[tuple[Path, int, str | None, str]]:
    out = []
    for page in [ROOT / "README.md", *GUIDES]:
        for i, m in enumerate(_PY_BLOCK.finditer(page.read_text(encoding="utf-8"))):
            out.append((page, i, m.group("mark"), m.group("code")))
    return out


PY_BLOCKS = _python_blocks()


def test_every_python_block_is_run_or_says_why_not():
    bad = []
    for page, i, mark, _ in PY_BLOCKS:
        if mark is None:
            continue
        if mark.startswith("not executed:"):
            if len(mark.split(":", 1)[1].strip()) < 10:
                bad.append(f"{_rel(page)} block {i}: give the reason it is not executed")
        elif mark.startswith("executed by "):
            where = mark.removeprefix("executed by ").strip()
            file_part, _, test = where.partition("::")
            path = ROOT / file_part
            if not path.is_file() or (test and f"def {test}(" not in path.read_text(encoding="utf-8")):
                bad.append(f"{_rel(page)} block {i}: no test {where}")
        else:
            bad.append(f"{_rel(page)} block {i}: unknown marker <!-- {mark} -->")
    assert not bad, "; ".join(bad)


@pytest.mark.parametrize(
    "page,index,code",
    [(page, i, code) for page, i, mark, code in PY_BLOCKS if mark is None],
    ids=[f"{_rel(page)}[{i}]" for page, i, mark, _ in PY_BLOCKS if mark is None])
def test_python_block_runs(page: Path, index: int, code: str, tmp_path, monkeypatch):
    """An unmarked block runs as written, in a fresh namespace and an empty working directory."""
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{_rel(page)} python block {index}", "exec"), {"__name__": f"doc_block_{index}"})
