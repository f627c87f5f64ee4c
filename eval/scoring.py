"""Answer scoring as CacheBlend's evaluation does: first line of the output, SQuAD F1 / EM, max over golds."""

from __future__ import annotations

import string

from ragkv.metrics import answer_recall, exact_match, max_over_golds, token_f1


def parse_generation(text: str) -> str:
    """The reference's ``parse_generation``: the first line after leading newlines, yes/no collapsed.

    Deviations: the reference collapses any line *starting* with "Yes"/"No" (so "Norway" became
    "No") and crashes on an empty output; here only a first word that is exactly yes/no (any case,
    punctuation stripped) collapses, and an empty output scores as "".
    """
    s = text.lstrip("\n").split("\n")[0]
    words = s.split()
    first = words[0].strip(string.punctuation).lower() if words else ""
    if first == "yes":
        return "Yes"
    if first == "no":
        return "No"
    return s


def score_answer(output: str, golds) -> tuple[float, float]:
    """(F1, exact match) of a raw model output against every gold (list or list of lists)."""
    pred = parse_generation(output)
    return max_over_golds(token_f1, pred, golds), max_over_golds(exact_match, pred, golds)


def score_recall(output: str, golds) -> float:
    """Answer recall: a gold contained (whole words, normalised) in the whole output, max over golds."""
    return max_over_golds(answer_recall, output, golds)
