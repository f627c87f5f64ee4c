"""Training and dev prompts for a KV adapter, passage-disjoint from what the fidelity gate reports on.

Three kinds (digest "trained chunk KV" 4.4), each an :class:`Item` in the prompt convention users send
(:func:`ragkv.prompt.prompt_parts`, passages as separate chunks):

* ``facts``: questions about single passages of invented facts (:mod:`ragkv.facts`, seeds
  other than the calibration set's), among 4 or 6 passages;
* ``real``: MuSiQue / 2WikiMQA questions from a checkout's ``data/`` (samples past the evaluation
  splits' first ``EVAL_RESERVED``; passages cut to ``REAL_PASSAGE_TOKENS``), when the files exist;
* ``continue``: generic continuation: passages as chunks, no instruction, the start of one more
  passage as the suffix (KVLink's random-split continuation).

Every passage whose invented names or text meet the calibration set's or the dev set's is dropped.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from ragkv.defaults import CALIBRATION_SET
from ragkv.facts import build

TRAIN_SEED = 9001
DEV_SEED = 4242
#: the evaluation splits read the first samples of each data file (eval.run --limit N, N <= 75)
EVAL_RESERVED = 100
REAL_PASSAGE_TOKENS = 110
CONTINUE_TOKENS = 12


@dataclass
class Item:
    """One training prompt: its kind, passages (texts, each a chunk), question (None: continuation)."""

    kind: str
    passages: list[str]
    question: str | None
    answers: list[str] = field(default_factory=list)
    suffix_text: str = ""
    id: str = ""


def _names(text: str) -> set[str]:
    return set(re.findall(r"\b[A-Z][a-z]{3,}\b", text))


def _held_out_names(extra: list[dict]) -> tuple[set[str], set[str]]:
    """Invented names (words in one passage only of their set) and texts of the held-out passages."""
    cal = json.loads(Path(CALIBRATION_SET).read_text())["passages"]
    names: set[str] = set()
    for ps in (cal, extra):
        counts: dict[str, int] = {}
        for p in ps:
            for w in _names(p["text"]):
                counts[w] = counts.get(w, 0) + 1
        names |= {w for w, c in counts.items() if c == 1}
    return names, {p["text"] for p in cal + extra}


def facts_items(
    seed: int, n_short: int, n_long: int, tag: str, avoid: tuple[set[str], set[str]]
) -> list[Item]:
    data = build(seed, n_short, n_long, 6)
    text = {p["id"]: p["text"] for p in data["passages"]}
    # a set never uses an invented name twice, so a word in two of its passages is a template's word
    counts: dict[str, int] = {}
    for t in text.values():
        for w in _names(t):
            counts[w] = counts.get(w, 0) + 1
    common = {w for w, c in counts.items() if c > 1}
    names, texts = avoid
    out = []
    for q in data["questions"]:
        ps = [text[i] for i in q["passages"]]
        if any(p in texts or (_names(p) - common) & names for p in ps):
            continue  # shares an entity with a held-out passage
        out.append(Item("facts", ps, q["question"], q["answers"], id=f"{tag}-{q['id']}"))
    return out


DEV_SHAPE = (20, 10, 6)  # short and long questions, passages of a long one


def dev_passages() -> list[dict]:
    return build(DEV_SEED, *DEV_SHAPE)["passages"]


def dev_set(n: int = 24) -> list[Item]:
    """The dev split (tuning only; never the gate's figure): invented facts, seed ``DEV_SEED``."""
    return facts_items(DEV_SEED, DEV_SHAPE[0], DEV_SHAPE[1], "dev", _held_out_names([]))[:n]


def real_items(model, data_dir: Path, limit: int, rng: random.Random) -> list[Item]:
    """Real questions past the evaluation splits, 4 passages each (answer-bearing first choice)."""
    out: list[Item] = []
    for name in ("musique_s.json", "wikimqa_s_clean.json"):
        path = data_dir / name
        if not path.is_file():
            continue
        samples = json.loads(path.read_text())
        held = {c["text"] for s in samples[:EVAL_RESERVED] for c in s["ctxs"]}
        for i, s in enumerate(samples[EVAL_RESERVED:]):
            ctxs = [c["text"] for c in s["ctxs"] if c["text"] not in held]
            golds = [a for a in s["answers"] if isinstance(a, str)]
            with_gold = [c for c in ctxs if any(g.lower() in c.lower() for g in golds)]
            others = [c for c in ctxs if c not in with_gold]
            rng.shuffle(others)
            chosen = (with_gold[:2] + others)[:4]
            if len(chosen) < 2:
                continue
            rng.shuffle(chosen)
            cut = [model.decode(model.encode(c)[:REAL_PASSAGE_TOKENS]) for c in chosen]
            out.append(Item("real", cut, s["question"], golds, id=f"real-{name[:4]}-{i}"))
    return out[:limit]


def continue_items(items: list[Item], n: int, rng: random.Random) -> list[Item]:
    """Continuation samples over the training passages (no instruction, no question)."""
    pool = [p for it in items for p in it.passages]
    out = []
    for i in range(min(n, len(pool) // 5)):
        ps = rng.sample(pool, 4)
        tail = rng.choice(pool)
        out.append(
            Item("continue", ps, None, suffix_text=" ".join(tail.split()[:CONTINUE_TOKENS]), id=f"cont-{i}")
        )
    return out


def training_set(
    model,
    n_facts: int = 160,
    n_real: int = 40,
    n_continue: int = 30,
    seed: int = 0,
    data_dir: Path | None = None,
) -> list[Item]:
    """The training items (facts, real, continuation), shuffled with ``seed``."""
    rng = random.Random(seed)
    avoid = _held_out_names(dev_passages())
    facts = facts_items(TRAIN_SEED, n_facts - n_facts // 3, n_facts // 3, "train", avoid)
    data_dir = data_dir or Path(__file__).resolve().parents[2] / "data"
    real = real_items(model, data_dir, n_real, rng) if n_real else []
    items = facts + real
    items += continue_items(facts, n_continue, rng)
    rng.shuffle(items)
    return items
