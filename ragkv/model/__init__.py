"""Model runtime: layer-wise forward of Llama-family checkpoints on selected rows."""

from ragkv.model.config import ModelConfig, UnsupportedModelError
from ragkv.model.llama import Model, PromptTooLongError
from ragkv.model.loader import checkpoint_fingerprint, load_model, parse_dtype, random_hf_config, random_model
from ragkv.model.registry import DEFAULT_MODEL, MODELS, ModelFetchError, pull
from ragkv.model.rope import UnsupportedRopeError

__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "ModelFetchError",
    "pull",
    "Model",
    "ModelConfig",
    "PromptTooLongError",
    "UnsupportedModelError",
    "UnsupportedRopeError",
    "checkpoint_fingerprint",
    "load_model",
    "parse_dtype",
    "random_hf_config",
    "random_model",
]
