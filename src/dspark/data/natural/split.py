"""The natural-prompt streams and their train/eval split by source unit."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from dspark.data.natural.code import _code_file_items, _code_files
from dspark.data.natural.common import (
    RESERVED_FRACTION,
    NaturalItem,
    _rng,
    band,
    item_side,
    shipped_eval_keys,
)
from dspark.data.natural.docs import _doc_items, _doc_number_items, _docs
from dspark.data.natural.word_problems import _math_items
from dspark.data.prompts import DOMAINS, Prompt

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
