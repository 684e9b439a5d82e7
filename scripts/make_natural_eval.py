"""Build the shipped natural-prompt eval set, ``src/dspark/data/natural_eval.jsonl``.

    python scripts/make_natural_eval.py [--per-domain 40] [--out PATH]

40 prompts per domain (math, code, chat) from the *held-out* side of the natural source's split
(:mod:`dspark.data.natural`, seed 0, eval fraction ``RESERVED_FRACTION``): their source units hash
into the band that no ``dspark data --source natural`` run ever trains on, and training also skips
their source texts by key. One JSON object per line, as ``jsonl_prompts`` reads it: ``prompt``,
``domain``, ``key``, plus ``unit`` and ``source`` (the source unit and the source text's key).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

from dspark.data.natural import RESERVED_FRACTION, SHIPPED_EVAL, natural_items
from dspark.data.prompts import DOMAINS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-domain", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(SHIPPED_EVAL))
    args = ap.parse_args(argv)
    rows = []
    for domain in DOMAINS:
        items = list(itertools.islice(natural_items(domain, "eval", args.seed, RESERVED_FRACTION), args.per_domain))
        if len(items) < args.per_domain:
            raise SystemExit(f"only {len(items)} held-out {domain} prompts available (wanted {args.per_domain})")
        for it in items:
            rows.append({"prompt": it.prompt.text, "domain": domain, "key": it.prompt.key, "unit": it.unit,
                         "source": it.source})
    Path(args.out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows)} prompts to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
