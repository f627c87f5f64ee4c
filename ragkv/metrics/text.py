"""SQuAD-style answer normalisation, token F1 and exact match (as LongBench/CacheBlend score QA)."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Iterable

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lower-case, drop punctuation and articles, collapse whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def token_f1(prediction: str, gold: str) -> float:
    """Word-overlap F1 of normalised strings (0 when either side is empty, 1 when both are)."""
    p, g = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not p or not g:
        return float(p == g)  # both empty: 1
    same = sum((Counter(p) & Counter(g)).values())
    if same == 0:
        return 0.0
    prec, rec = same / len(p), same / len(g)
    return 2 * prec * rec / (prec + rec)


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def answer_recall(prediction: str, gold: str) -> float:
    """1 if the normalised gold appears in the normalised answer as whole words, else 0.

    Small instruct models answer in sentences ("The capital of France is Paris."), which F1 on the
    first line scores as mostly wrong; recall says whether the answer was given at all.
    """
    p, g = f" {normalize_answer(prediction)} ", normalize_answer(gold)
    return float(bool(g) and f" {g} " in p)


def _flatten(golds) -> list[str]:
    out: list[str] = []
    for g in golds if isinstance(golds, (list, tuple)) else [golds]:
        if isinstance(g, (list, tuple)):
            out.extend(_flatten(g))
        elif g is not None:
            out.append(str(g))
    return out


def max_over_golds(metric: Callable[[str, str], float], prediction: str, golds: Iterable) -> float:
    """Best score over every gold answer (list, or list of lists as in 2WikiMQA)."""
    flat = _flatten(list(golds) if not isinstance(golds, str) else [golds])
    return max((metric(prediction, g) for g in flat), default=0.0)
