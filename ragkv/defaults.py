"""Generation defaults, in one place for every surface (Python API, integrations, service, CLI).

It imports nothing, so every layer may read it (tests/project/test_layout.py ranks it below all others).
"""

#: the share of reused rows a blend recomputes when a request names a ratio nowhere and runs outside
#: the fidelity gate (the default :class:`~ragkv.blend.core.BlendSchedule`'s ratio): the one home of
#: the default, read by the LLM, RAG, engine, service and the vLLM parameters alike
DEFAULT_RATIO = 0.12

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
