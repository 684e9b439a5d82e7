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

The package: :mod:`~dspark.data.natural.common` (items, units, keys, the side of the split),
the sources :mod:`~dspark.data.natural.docs`, :mod:`~dspark.data.natural.code`,
:mod:`~dspark.data.natural.word_problems` and :mod:`~dspark.data.natural.followups`, and
:mod:`~dspark.data.natural.split` (the streams and the split).
"""

from __future__ import annotations

from dspark.data.natural.common import (
    RESERVED_FRACTION,
    SHIPPED_EVAL,
    NaturalItem,
    band,
    item_side,
    shipped_eval_keys,
    source_key,
)
from dspark.data.natural.docs import junk_reason
from dspark.data.natural.followups import load_followups
from dspark.data.natural.split import natural_items, natural_split

__all__ = ["NaturalItem", "RESERVED_FRACTION", "SHIPPED_EVAL", "band", "source_key", "item_side",
           "junk_reason", "natural_items", "natural_split", "load_followups", "shipped_eval_keys"]
