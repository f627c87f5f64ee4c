"""The core suite's test utilities: reference logits, RoPE settings of small configs, story chunks of the
trained tiny model, the repository's source folders; and, re-exported, what every suite shares
(:mod:`ragkv.testing`: the tiny model, the corpus, stop-string checks, chat templates)."""

from __future__ import annotations

from pathlib import Path

import torch

from ragkv.testing import (  # noqa: F401  (what every suite shares, under the names the core's tests use)
    CHATML_TEMPLATE,
    INST_TEMPLATE,
    NO_VLLM,
    bearer,
    check_stop_strings,
    data_dir,
    have_vllm,
    musique_samples,
    stop_cases,
    stories_model,
    stories_path,
    template_ids,
    templated_checkpoint,
    worker_threads,
)

REPO = Path(__file__).resolve().parents[1]


#: Llama-3 RoPE scaling for small random test models (original context 32, so scaling bites)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def yarn_rope(original_max_position_embeddings: int = 32) -> dict:
    """YaRN RoPE parameters (factor 4) for the small test configs."""
    return {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": original_max_position_embeddings,
    }


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error ``|a - b| / |b|`` in fp32."""
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


#: the evaluation sets the repository carries
DATA_DIR = data_dir()


def sample_story_chunks(model, n_chunks: int, length: int, seed: int) -> list[list[int]]:
    """Chunks of text the trained model writes itself (temperature 1), so they are in-distribution."""
    from ragkv.blend import prefill
    from ragkv.generate import SamplingParams, generate

    chunks = []
    for i in range(n_chunks):
        res = prefill(model, [model.config.bos_token_id], [], [], "full")
        params = SamplingParams(
            max_new_tokens=length, temperature=1.0, seed=seed * 1000 + i, stop_token_ids=()
        )
        out = generate(model, res, params)
        chunks.append(out.token_ids[:length])
    return chunks


def ulps(dtype: torch.dtype, scale: float, n: float = 1.0) -> float:
    """``n`` units in the last place of ``dtype`` at magnitude ``scale`` (``n * eps(dtype) * scale``)."""
    return n * torch.finfo(dtype).eps * float(scale)


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """Gap between the largest and the second-largest logit along the last dimension (fp32)."""
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def hf_logits(model_dir_or_config, ids: torch.Tensor, weights: dict | None = None) -> torch.Tensor:
    """Reference logits from transformers' own AutoModelForCausalLM (eager attention)."""
    from transformers import AutoModelForCausalLM

    if weights is None:
        ref = AutoModelForCausalLM.from_pretrained(model_dir_or_config, attn_implementation="eager")
    else:
        ref = AutoModelForCausalLM.from_config(model_dir_or_config, attn_implementation="eager")
        missing, unexpected = ref.load_state_dict(weights, strict=False)
        assert not unexpected, unexpected
        assert all("rotary" in m or "lm_head" in m for m in missing), missing
        if "lm_head.weight" in missing:
            ref.tie_weights()
    ref.eval()
    with torch.no_grad():
        return ref(ids[None]).logits[0]


#: the source folders of the repository's packages: the core and each distribution's (issue 40)
PACKAGE_FOLDERS = (
    "ragkv",
    "apps/ragkv_server",
    "integrations/frameworks/ragkv_frameworks",
    "integrations/langchain/langchain_ragkv",
    "integrations/llama-index/llms/llama_index/llms/ragkv",
    "integrations/llama-index/retrievers/llama_index/retrievers/ragkv",
    "integrations/vllm/ragkv_vllm",
)


def source_files(folder: str | Path) -> list[Path]:
    """The ``*.py`` files under ``folder`` (relative to the checkout), sorted; a layout test that walks a
    folder fails here when the folder is missing or holds no Python, rather than checking nothing."""
    root = folder if isinstance(folder, Path) else REPO / folder
    assert root.is_dir(), f"{root} is missing: a layout test walks it"
    files = sorted(root.rglob("*.py"))
    assert files, f"{root} holds no Python files: a layout test walks it"
    return files
