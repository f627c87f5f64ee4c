"""Fidelity of reused KV vs full prefill, answer quality (SQuAD-style F1 / EM), percentiles, and the
serving engine's request and engine metrics (``serving.py``)."""

from ragkv.metrics.fidelity import attention_deviation, first_token_agreement, first_token_kl
from ragkv.metrics.serving import EngineMetrics, RequestMetrics
from ragkv.metrics.stats import percentile
from ragkv.metrics.text import answer_recall, exact_match, max_over_golds, normalize_answer, token_f1

__all__ = [
    "EngineMetrics",
    "RequestMetrics",
    "answer_recall",
    "attention_deviation",
    "exact_match",
    "first_token_agreement",
    "first_token_kl",
    "max_over_golds",
    "normalize_answer",
    "percentile",
    "token_f1",
]
