"""Generation defaults and the request settings' vocabulary, in one place for every surface (Python
API, integrations, service, CLI).

It imports nothing of ragkv, so every layer may read it (tests/project/test_layout.py ranks it below
all others). The request settings value that carries these (:class:`ragkv.fidelity.plan.RequestSettings`)
is parsed once at each edge; its unset fields fall back to the defaults here.
"""

from enum import StrEnum
from pathlib import Path


class Mode(StrEnum):
    """The prefill modes: the one definition of their names (a member equals its name as a string)."""

    #: every row computed (the baseline)
    FULL = "full"
    #: exact: the longest cached token prefix reused from the KV tree, the rest computed
    PREFIX = "prefix"
    #: stored chunk KV reused as is (re-positioned)
    REUSE = "reuse"
    #: stored chunk KV reused with a share of its rows recomputed (CacheBlend and beyond)
    BLEND = "blend"

    @property
    def reuses(self) -> bool:
        """Whether the mode reads stored chunk KV (``reuse``, ``blend``)."""
        return self in (Mode.REUSE, Mode.BLEND)


#: the prefill modes' names, in :class:`Mode`'s order (for ``Literal[...]`` types and messages)
MODES: tuple[str, ...] = tuple(m.value for m in Mode)

#: the modes a request that names none runs in: blend (at the fidelity gate's point when no ratio is set)
DEFAULT_MODE = Mode.BLEND

#: the share of reused rows a blend recomputes when a request names a ratio nowhere and runs outside
#: the fidelity gate (the default :class:`~ragkv.blend.core.BlendSchedule`'s ratio): the one home of
#: the default, read by the LLM, RAG, engine, service and the vLLM parameters alike
DEFAULT_RATIO = 0.12

#: the fidelity setting of a request that names none (:mod:`ragkv.fidelity.choose`): the cheapest
#: point that changes no more answers than a dtype change does
DEFAULT_FIDELITY = "floor"

#: the KV adapter setting of an owner that names none (:func:`ragkv.adapter.shipped.resolve_adapter`):
#: the package's adapter for the model, where the fidelity gate chooses it
DEFAULT_ADAPTER = "auto"

#: the order retrieved chunks go into a RAG prompt: by retrieval score (the default), seeded-random (the
#: paper's evaluation), or ``cache``: the KV tree's longest cached path first (an opt-in operating point:
#: the prompt changes, so the answer may; ``eval.bench_order`` measures how often)
CHUNK_ORDERS = ("score", "random", "cache")
DEFAULT_CHUNK_ORDER = "score"

#: tokens generated at most when a request names no limit: ``SamplingParams``, ``RAG.answer``, the
#: LangChain / LlamaIndex wrappers, the vLLM client, the service's query and chat routes, the CLI
DEFAULT_MAX_NEW_TOKENS = 64

#: ``/v1/completions`` keeps its protocol's defaults (OpenAI's and vLLM's): 16 tokens, temperature 1
COMPLETIONS_MAX_TOKENS = 16
COMPLETIONS_TEMPERATURE = 1.0

#: temperatures below this sample greedily (dividing logits by ~1e-300 overflows to NaN probabilities)
MIN_TEMPERATURE = 1e-4

#: most alternatives a token's log-probabilities may list (OpenAI's ``top_logprobs`` limit)
MAX_LOGPROBS = 20

#: the calibration set (shipped with ragkv): the questions every default above is measured on (the
#: fidelity report's operating points) and whose passages the adapter's training never uses
CALIBRATION_SET = Path(__file__).resolve().parent / "fidelity" / "calibration_set.json"
