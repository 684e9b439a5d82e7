"""Natural prompts (dspark.data.natural): determinism, the split by source unit, the shipped eval
set, multi-turn prompts through the chat template, and the junk filter."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import pytest

from dspark.cli import main as cli_main
from dspark.data.natural import (
    RESERVED_FRACTION,
    SHIPPED_EVAL,
    band,
    junk_reason,
    load_followups,
    natural_items,
    natural_split,
)
from dspark.data.prompts import DOMAINS, Prompt, jsonl_prompts, prompt_hash
from dspark.data.selfdistill import generate_records, write_prompts
from dspark.engine import encode_prompt
from dspark.types import SamplingParams


def _take(domain, side, n, seed=0, eval_fraction=0.1, followups=()):
    return list(itertools.islice(natural_items(domain, side, seed, eval_fraction, followups), n))


def test_natural_split_is_deterministic_and_covers_every_domain():
    a_train, a_held = natural_split(20, seed=0)
    b_train, b_held = natural_split(20, seed=0)
    assert [p.key for p in a_train] == [p.key for p in b_train]
    assert [p.key for p in a_held] == [p.key for p in b_held]
    assert Counter(p.domain for p in a_train) == {d: 18 for d in DOMAINS}
    assert Counter(p.domain for p in a_held) == {d: 2 for d in DOMAINS}
    c_train, _ = natural_split(20, seed=1)
    assert {p.key for p in c_train} != {p.key for p in a_train}  # the seed changes choices and phrasing
    assert len({p.key for p in a_train + a_held}) == 60


def test_split_is_disjoint_by_source_unit_and_source_text():
    for domain, n_train, n_eval in (("chat", 400, 60), ("code", 60, 15), ("math", 600, 60)):
        train, held = _take(domain, "train", n_train), _take(domain, "eval", n_eval)
        assert len(held) == n_eval and len(train) == n_train
        assert not {it.unit for it in train} & {it.unit for it in held}
        assert not {it.source for it in train} & {it.source for it in held}
        assert all(band("unit:" + it.unit) < 0.1 for it in held)
        assert all(band("unit:" + it.unit) >= RESERVED_FRACTION for it in train)
        assert {it.prompt.domain for it in train + held} == {domain}
    # a smaller eval fraction never moves the reserved band (the shipped eval set) into training
    assert all(band("unit:" + it.unit) >= RESERVED_FRACTION for it in _take("chat", "train", 300, eval_fraction=0.02))
    math = _take("math", "train", 300)
    assert len({it.unit.split("/")[1] for it in math}) >= 12  # many scenario frames
    assert len({it.prompt.text.split()[0] for it in math}) >= 20  # and phrasings


def test_shipped_eval_set_is_held_out_and_readable():
    prompts = list(jsonl_prompts(SHIPPED_EVAL))
    assert Counter(p.domain for p in prompts) == {"math": 40, "code": 40, "chat": 40}
    rows = [json.loads(line) for line in SHIPPED_EVAL.read_text(encoding="utf-8").splitlines()]
    assert [r["key"] for r in rows] == [p.key for p in prompts]
    assert all(band("unit:" + r["unit"]) < RESERVED_FRACTION for r in rows)
    units, sources = {r["unit"] for r in rows}, {r["source"] for r in rows}
    for domain, n in (("chat", 10_000), ("code", 80), ("math", 3000)):  # chat: the whole training side
        train = _take(domain, "train", n)
        assert not units & {it.unit for it in train}
        assert not sources & {it.source for it in train}
        assert not {p.key for p in prompts} & {it.prompt.key for it in train}


def _chat_tokenizer(words):
    """A tiny word-level tokenizer with a ChatML-like chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(specials + sorted(set(words))))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", additional_special_tokens=specials[1:])
    fast.chat_template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
    return fast


class _Engine:
    """Records what generate_records asks the engine to encode."""

    def __init__(self):
        self.requests, self._done = {}, []

    def add_request(self, prompt, sampling, max_new_tokens, request_id):
        self.requests[request_id] = prompt
        self._done.append(request_id)
        return request_id

    def step(self):
        pass

    def pop_finished(self):
        from types import SimpleNamespace

        out = [SimpleNamespace(request_id=r, prompt_ids=[1, 2], output_ids=[3], finish_reason="stop")
               for r in self._done]
        self._done = []
        return out


def test_multi_turn_prompts_render_every_turn_and_round_trip(tmp_path):
    from dspark.data.natural.followups import _FOLLOWUPS

    first = "what is a list comprehension"
    reply = "it builds a list from an iterable in one expression"
    tok = _chat_tokenizer((first + " " + reply + " user assistant " + " ".join(
        sum(_FOLLOWUPS.values(), []))).replace("?", " ? ").replace(".", " . ").replace(",", " , ")
        .replace("!", " ! ").replace("'", " ' ").split())
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"key": prompt_hash(first), "domain": "code", "prompt": first, "prompt_ids": [1],
                                "response_ids": tok(reply)["input_ids"]}) + "\n")
    with pytest.raises(ValueError, match="tokenizer"):
        load_followups(data)
    items = load_followups(data, lambda ids: tok.decode(ids, skip_special_tokens=True))
    assert len(items) == 1 and items == load_followups(data, lambda ids: tok.decode(ids, skip_special_tokens=True))
    p = items[0].prompt
    assert [r for r, _ in p.messages] == ["user", "assistant", "user"] and p.messages[1][1] == reply
    assert p.text == p.messages[-1][1] and p.key != prompt_hash(p.text)
    assert items[0].unit == f"turns/{prompt_hash(first)}"
    rendered = tok.decode(encode_prompt(tok, p.request).tolist())
    i, j, k = rendered.find(first), rendered.find(reply), rendered.rfind(p.text.split()[0])
    assert -1 < i < j < k and rendered.count("<|im_start|>") == 4  # three turns + the generation prompt
    # generate_records hands the engine every turn and records them
    engine = _Engine()
    (rec,) = generate_records(engine, [p], SamplingParams.greedy(), progress=False)
    assert engine.requests[p.key] == p.request and rec.key == p.key
    assert rec.to_dict()["messages"][1] == {"role": "assistant", "content": reply}
    # held-out conversations are written and read back with every turn and the same key
    write_prompts(tmp_path / "held.jsonl", [p, Prompt("plain", "chat")])
    back = list(jsonl_prompts(tmp_path / "held.jsonl"))
    assert [q.key for q in back] == [p.key, prompt_hash("plain")] and back[0].messages == p.messages
    # the chat stream mixes them in (each on the side its first turn's key hashes to)
    side = "eval" if band("unit:" + items[0].unit) < 0.1 else "train"
    assert p.key in {it.prompt.key for it in _take("chat", side, 10_000, followups=items)}


def test_followups_and_source_errors_are_one_sentence(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_followups(tmp_path / "none.jsonl")
    assert cli_main(["data", "--source", "natural", "--followups-from", str(tmp_path / "none.jsonl"),
                     "--out", str(tmp_path / "o")]) == 2
    assert "--followups-from" in capsys.readouterr().err
    assert cli_main(["data", "--followups-from", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "needs --source natural" in capsys.readouterr().err
    assert cli_main(["data", "--source", "natural", "--no-builtin", "--out", str(tmp_path / "o")]) == 2
    assert "contradicts" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_followups(bad)


_GOOD = ("The scheduler decides how many draft tokens the target verifies in each round. It reads the "
         "calibrated confidence of every drafted position and the measured cost of a verification step, "
         "and it stops where the expected number of accepted tokens no longer pays for the extra work.")


@pytest.mark.parametrize("text, reason", [
    (_GOOD, None),
    ("Short and sweet.", "length"),
    ("| a | b |\n|---|---|\n| 1 | 2 |\n" * 10, "table"),
    ("[![PyPI](https://img.shields.io/pypi/v/x.svg)](https://pypi.org/project/x) " * 4, "badge"),
    ("Docs: https://example.org/docs Source: https://github.com/x/y Issues: https://github.com/x/y/issues "
     "Chat: https://discord.gg/x " * 2, "urls"),
    (">>> import numpy as np\n>>> np.arange(10).reshape(2, 5)\n>>> x = {'a': [1, 2, 3]}\n" * 3, "code"),
    ("Permission is hereby granted, free of charge, to any person obtaining a copy of this software and "
     "associated documentation files (the Software), to deal in the Software without restriction, including "
     "the rights to use, copy, modify, merge and publish it.", "license"),
    ("Dieses Paket stellt Werkzeuge zur Verfügung, mit denen große Datenmengen schnell verarbeitet werden "
     "können. Über die Programmierschnittstelle lassen sich Größen, Maße und Gewichte für Straßen, Flüsse "
     "und Gebäude einfach berechnen, prüfen und speichern, während Änderungen sofort übernommen werden.",
     "language"),
    (_GOOD[:-1] + ", as in the following example:", "fragment"),
    ("1.3.0: this release fixes a crash in the parser that happened when the input file was empty, speeds up "
     "the loading of large configuration files, and removes the deprecated helpers that were scheduled for "
     "removal in the previous version.", "changelog"),
    ("Thanks to everyone who helped with this release: the fix for #1234 came from @alice-dev and the faster "
     "loader from @bob-dev, and the new documentation pages for the command line were written by the team "
     "that maintains the website.", "changelog"),
])
def test_junk_filter(text, reason):
    assert junk_reason(text) == reason


def test_natural_source_rejects_bad_arguments():
    with pytest.raises(ValueError, match="domain"):
        next(natural_items("poetry"))
    with pytest.raises(ValueError, match="side"):
        next(natural_items("math", "test"))
    with pytest.raises(ValueError, match="per_domain"):
        natural_split(-1)
