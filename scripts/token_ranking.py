"""Write a drafter folder's token_ranking.json (what `NAME:vocab=K` cuts to) from target-written
training responses:
    python scripts/token_ranking.py TRAIN.jsonl DRAFTER_FOLDER [--source TEXT]
TRAIN.jsonl: `dspark data` rows with `response_ids` (e.g. train.jsonl of
data/smollm2-135m/natural15.tar.xz); the eval prompts are disjoint from it by construction."""
import argparse
import json

from dspark.drafters.prune import save_token_ranking

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("train")
ap.add_argument("folder")
ap.add_argument("--source", default=None)
args = ap.parse_args()
with open(args.train) as f:
    rows = [json.loads(line)["response_ids"] for line in f if line.strip()]
path = save_token_ranking(args.folder, rows, args.source or f"response_ids of {len(rows)} rows of {args.train}")
ranking = json.loads(path.read_text())
print(f"{path}: {len(ranking['ranking'])} distinct tokens over {ranking['tokens_counted']} counted")
