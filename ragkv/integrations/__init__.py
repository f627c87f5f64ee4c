"""Deprecated: the integrations are their own distributions (``langchain-ragkv``, ``llama-index-llms-ragkv``,
``llama-index-retrievers-ragkv``, ``ragkv-vllm``); these old names import them, with a warning, for one release."""

import warnings

from ragkv._moved import install

install()
warnings.warn(
    "ragkv.integrations is deprecated (issue 40): see ragkv._moved.MOVED for the new homes",
    DeprecationWarning,
    stacklevel=2,
)
