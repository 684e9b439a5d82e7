"""Code prompts from real functions of the standard library and installed packages."""

from __future__ import annotations

import ast
import functools
import random
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path

from dspark.data.natural.common import NaturalItem, _rng, item_side, source_key
from dspark.data.natural.docs import _skip_path
from dspark.data.prompts import Prompt

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
