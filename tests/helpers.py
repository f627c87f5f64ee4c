"""Test utilities: where the repository's data and tiny model live, and story prompts from the trained model."""

from __future__ import annotations

import functools
import importlib.util
import itertools
import os
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def worker_threads() -> int:
    """Torch threads for one test process: the machine's cores shared among pytest-xdist's workers.

    Two workers of two intra-op threads each on a 2-core machine oversubscribe it (OpenMP threads
    spin waiting for a core); a service a test starts gets the same share.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    return max(1, (os.cpu_count() or 1) // max(1, workers))


#: Llama-3 RoPE scaling for small random test models (original context 32, so scaling bites)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def bearer(key: str, collection: str | None = None) -> dict:
    """Request headers of an API key (and the collection it names)."""
    h = {"Authorization": f"Bearer {key}"}
    if collection is not None:
        h["X-Ragkv-Collection"] = collection
    return h


def yarn_rope(original_max_position_embeddings: int = 32) -> dict:
    """YaRN RoPE parameters (factor 4) for the small test configs."""
    return {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": original_max_position_embeddings,
    }


#: why the tests of the real vLLM package are skipped where it is missing
NO_VLLM = (
    "vllm is not installed in this environment (CUDA-only on PyPI; for the contract tests install "
    "vllm==0.32.* or 0.33.* --no-deps next to torch 2.13: integrations/vllm/examples/contract_venv.sh)"
)


def have_vllm() -> bool:
    """Whether the vLLM package is installed; without CUDA it is pointed at its CPU platform (so its
    models build without CUDA)."""
    if importlib.util.find_spec("vllm") is None:
        return False
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    return True


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error ``|a - b| / |b|`` in fp32."""
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


#: the evaluation sets the repository carries
DATA_DIR = REPO / "data"


def stories_path() -> Path:
    """The tiny trained test model the repository carries."""
    return REPO / "models" / "stories260k"


def musique_samples(n: int) -> list[dict]:
    """The first ``n`` MuSiQue samples of the repository's copy."""
    import json

    return json.loads((DATA_DIR / "musique_s.json").read_text())[:n]


@functools.lru_cache(maxsize=1)
def stories_model():
    from ragkv.model import load_model

    return load_model(stories_path())


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


def stop_cases(pieces: list[str]) -> dict[str, tuple[str, int]]:
    """Stop strings cut from a greedy output's per-token texts (``pieces``), each with the number of
    tokens whose last one completes it (``max_new_tokens`` that ends on it).

    ``"multi"``: three whole tokens; ``"split"``: from inside one token to inside another two tokens
    on. Each starts after some text and first occurs where it is cut from.
    """
    ends = list(itertools.accumulate(map(len, pieces)))
    starts = [e - len(p) for e, p in zip(ends, pieces, strict=True)]
    text = "".join(pieces)
    out: dict[str, tuple[str, int]] = {}
    for k in range(1, len(pieces) - 3):
        a, b, c = pieces[k : k + 3]
        if not (a.strip() and b.strip() and c.strip()):
            continue
        multi = text[starts[k] : ends[k + 2]]
        if "multi" not in out and text.find(multi) == starts[k]:
            out["multi"] = (multi, k + 3)
        split = text[starts[k] + 1 : ends[k + 2] - 1]
        if "split" not in out and len(a.strip()) >= 2 and len(c) >= 2 and text.find(split) == starts[k] + 1:
            out["split"] = (split, k + 3)
    assert set(out) == {"multi", "split"}, f"no stop cases in {pieces}"
    return out


def check_stop_strings(pieces: list[str], max_new: int, complete) -> None:
    """A surface never emits any part of a stop string and reports the right finish reason.

    ``pieces``: the surface's greedy output, one text per token, ``max_new`` tokens, no stop string;
    ``complete(stop, max_new_tokens, streamed) -> (text, finish_reason)``. Each case of
    :func:`stop_cases` is checked stopped mid-generation, completed on the last allowed token
    ("stop") and one token short of it ("length": the text held back as a possible stop string is
    flushed), streamed (the concatenated deltas) and not.
    """
    whole = "".join(pieces)
    for stop, n in stop_cases(pieces).values():
        want = whole[: whole.index(stop)]
        short = "".join(pieces[: n - 1])
        for limit, reason, text in ((max_new, "stop", want), (n, "stop", want), (n - 1, "length", short)):
            for streamed in (False, True):
                got = complete(stop, limit, streamed)
                assert got == (text, reason), (stop, limit, streamed, got)


#: a ChatML template (SmolLM2's, without its default system turn): contents between role markers
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: a Llama-2 / Mistral style template: BOS from the template, the system prompt folded into the first
#: user turn, roles that must alternate (a template's own refusal, ``raise_exception``)
INST_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
    "{% set msgs = messages[1:] %}{% else %}{% set sys = '' %}{% set msgs = messages %}{% endif %}"
    "{% for m in msgs %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if m['role'] == 'user' %}{{ '[INST] ' }}{% if loop.first and sys %}{{ '<<SYS>>\n' + sys + "
    "'\n<</SYS>>\n\n' }}{% endif %}{{ m['content'] + ' [/INST]' }}{% else %}{{ ' ' + m['content'] + "
    "eos_token }}{% endif %}{% endfor %}"
)


def templated_checkpoint(dest: Path, template: str) -> Path:
    """A copy of the tiny test model whose tokenizer has ``template`` as its chat template (what an
    instruct checkpoint ships in ``tokenizer_config.json``)."""
    import json
    import shutil

    shutil.copytree(stories_path(), dest)
    cfg_path = dest / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return dest


def template_ids(checkpoint: Path, messages: list[dict]) -> list[int]:
    """transformers' own token ids of ``messages`` rendered by the checkpoint's chat template, with
    the generation prompt (``apply_chat_template(..., tokenize=True)``: what vLLM prefills)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


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
