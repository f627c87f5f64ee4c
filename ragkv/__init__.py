"""ragkv: retrieval-augmented generation that never prefills the same retrieved text twice."""

from ragkv.blend import BlendSchedule, KVTree, PrefixCache, prefill
from ragkv.constrain import ConstraintError, JsonConstraint, json_constraint
from ragkv.defaults import Mode
from ragkv.fidelity.plan import RequestSettings
from ragkv.generate import SamplingParams
from ragkv.kv import ChunkKV, KVMismatchError
from ragkv.llm import LLM, Answer
from ragkv.model import DEFAULT_MODEL, Model, PromptTooLongError, load_model, random_model
from ragkv.model.forward import compute_chunk_kv

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL",
    "LLM",
    "Answer",
    "BlendSchedule",
    "ChunkKV",
    "ConstraintError",
    "JsonConstraint",
    "KVMismatchError",
    "KVTree",
    "Mode",
    "Model",
    "PrefixCache",
    "PromptTooLongError",
    "RequestSettings",
    "SamplingParams",
    "compute_chunk_kv",
    "json_constraint",
    "load_model",
    "prefill",
    "random_model",
]
