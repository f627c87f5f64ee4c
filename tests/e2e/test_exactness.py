"""Every architecture variant ``load_model`` accepts matches transformers, or is refused by name.

Each variant is a tiny random checkpoint built by transformers itself (its own module names and
config semantics); ragkv loads the same state dict. Compared: prefill logits and 20 greedy decode
steps (logits and tokens) through the dense decode cache and through the engine's paged batched
decode, in float32 and bfloat16. The prompts are longer than the sliding windows, and decode goes
well past them, so dropping a window anywhere changes the logits.
"""

from __future__ import annotations

import pytest
import torch

from ragkv.blend import prefill
from ragkv.engine.paged_cache import KVPool, PagedSequence, batched_decode_step, block_keys
from ragkv.generate import decode_step, load_prompt, make_cache
from ragkv.model import UnsupportedRopeError, random_hf_config
from ragkv.model.config import ModelConfig
from ragkv.model.llama import Model
from ragkv.model.loader import model_fingerprint, tensors_digest
from tests.helpers import LLAMA3_ROPE, top2_margin, ulps, yarn_rope

WINDOW = 6
STEPS = 20
VARIANTS = {
    "llama": ("llama", {}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "llama-mha-tied": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "yarn-rope": ("llama", {"rope_parameters": yarn_rope(32)}),
    "qwen2": ("qwen2", {}),
    # layers >= max_window_layers slide: here layer 0 attends to everything, layers 1-2 to 6 tokens
    "qwen2-layer-windows": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
    # transformers' default max_window_layers (28) leaves every layer of a 3-layer model unwindowed
    "qwen2-window-default-layers": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW}),
    "mistral-window": ("mistral", {"sliding_window": WINDOW}),
}


def _hf_pair(name: str, dtype: torch.dtype):
    """(transformers model, ragkv model) with the same random weights; biases and norms random too."""
    from transformers import AutoModelForCausalLM

    arch, overrides = VARIANTS[name]
    hf_cfg = random_hf_config(arch, **overrides)
    torch.manual_seed(7)
    ref = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager")
    with torch.no_grad():
        for pname, p in ref.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    ref = ref.to(dtype).eval()
    weights = {k: v.detach().clone() for k, v in ref.state_dict().items() if "rotary" not in k}
    if hf_cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    cfg = ModelConfig.from_hf(hf_cfg)
    ours = Model(cfg, weights, fingerprint=model_fingerprint(cfg, tensors_digest(weights), dtype, "none"))
    return ref, ours


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _hf_greedy(ref, ids: list[int], steps: int) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """transformers' prefill logits, then per-step logits and tokens of greedy decode with its KV cache."""
    out = ref(torch.tensor([ids]), use_cache=True)
    prefill_logits = out.logits[0].float()
    past = out.past_key_values
    logits, toks = [], []
    last = prefill_logits[-1]
    for _ in range(steps):
        tok = int(last.argmax())
        toks.append(tok)
        out = ref(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        last = out.logits[0, -1].float()
        logits.append(last)
    return prefill_logits, logits, toks


def _ours_dense(model, ids: list[int], forced: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """Decode logits and greedy tokens through the dense decode cache, fed ``forced`` tokens."""
    res = prefill(model, [], [], ids, "full")
    cache = make_cache(model, "fp16", capacity=4)  # small capacity: growth is exercised too
    load_prompt(cache, res)
    logits, toks = [], []
    for i, tok in enumerate(forced):
        toks.append(int((res.logits if i == 0 else logits[-1]).argmax()))
        logits.append(decode_step(model, cache, tok, len(ids) + i))
    return logits, toks


def _ours_paged(model, prompts: list[list[int]], forced: list[list[int]]) -> list[list[torch.Tensor]]:
    """Per-sequence decode logits of a batch through the paged pool and ``batched_decode_step``."""
    pool = KVPool.for_model(model, num_blocks=64, block_size=4)
    seqs = []
    for ids in prompts:
        res = prefill(model, [], [], ids, "full")
        s = PagedSequence(pool)
        s.load_prompt(res.kv.k, res.kv.v)
        seqs.append(s)
    out: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in range(len(forced[0])):
        lg = batched_decode_step(model, seqs, [f[step] for f in forced])
        for i in range(len(prompts)):
            out[i].append(lg[i])
    return out


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 0.05


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: within 1e-4 absolute; bf16: within 5% of the logits' range (rounding of two kernels)."""
    a, b = a.float(), b.float()
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    else:
        err = float((a - b).abs().max() / b.abs().max())
        assert err < _tolerance(dtype), err


def _same_greedy(ours: list[torch.Tensor], ref: list[torch.Tensor], dtype: torch.dtype) -> None:
    """Greedy tokens agree wherever the reference's top-2 margin exceeds the two kernels' rounding.

    fp32: ours and transformers' differ by up to 20 fp32 ulps of the logits' magnitude (measured, AVX2
    and AVX-512); the margins here all exceed twice 48 such ulps (checked, not assumed: smallest 234,
    qwen2), so no step is a near-tie and every token must agree whatever the CPU's kernels.
    bf16: top-2 margins of 0 to 2 bf16 ulps are common on these random models, so the token is only
    compared where the margin exceeds twice the measured difference; which of a near-tied pair wins
    depends on the summation order of the CPU's kernels.
    """
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        margin = float(top2_margin(b))
        if dtype == torch.float32:
            tol = ulps(torch.float32, float(b.abs().max()), 48)
            assert margin > 2 * tol, (
                f"step {step}: fp32 near-tie in the reference ({margin:.2e}); pick another prompt"
            )
            assert int(a.argmax()) == int(b.argmax()), step
        else:
            err = float((a.float() - b.float()).abs().max())
            if margin > 2 * err:
                assert int(a.argmax()) == int(b.argmax()), step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_transformers(name, dtype):
    ref, ours = _hf_pair(name, dtype)
    prompts = [_prompt(11, 1), _prompt(14, 2)]
    refs = [_hf_greedy(ref, ids, STEPS) for ids in prompts]
    # prefill: every position's logits
    for ids, (pl, _, _) in zip(prompts, refs, strict=True):
        mine, _, _ = ours.forward(torch.tensor(ids))
        _close(mine, pl, dtype)
    # dense decode cache, fed the reference's greedy tokens: logits at every step, and the same tokens
    for ids, (pl, steps, toks) in zip(prompts, refs, strict=True):
        logits, greedy = _ours_dense(ours, ids, toks)
        for a, b in zip(logits, steps, strict=True):
            _close(a, b, dtype)
        _same_greedy([prefill(ours, [], [], ids, "full").logits] + logits[:-1], [pl[-1]] + steps[:-1], dtype)
        if dtype == torch.float32:
            assert greedy == toks
    # the engine's paged batched decode: two sequences of different lengths in one batch
    paged = _ours_paged(ours, prompts, [t for _, _, t in refs])
    for logits, (_, steps, _) in zip(paged, refs, strict=True):
        for a, b in zip(logits, steps, strict=True):
            _close(a, b, dtype)
        _same_greedy(logits, steps, dtype)


@pytest.mark.parametrize("path", ["dense", "paged"])
@pytest.mark.parametrize("name", ["mistral-window", "qwen2-layer-windows"])
def test_hack_decode_keeps_the_sliding_window(name, path):
    """HACK decode (8-bit codes: near lossless) follows transformers' windowed decode in the dense
    HACK cache and in the engine's paged HACK blocks; without the window it is off by ~2x the logits'
    range (measured: 0.03 with the window, 1.9 without)."""
    from ragkv.attention.hack_cache import HackConfig

    ref, ours = _hf_pair(name, torch.float32)
    ids = _prompt(20, 1)  # 20 + 20 rows: sealed 16-row V partitions, well past the 6-token window
    _, steps, toks = _hf_greedy(ref, ids, STEPS)
    res = prefill(ours, [], [], ids, "full")
    cfg = HackConfig(bits=8, partition=16)
    if path == "dense":
        cache = make_cache(ours, "hack", preset="paper", bits=8, partition=16)
        load_prompt(cache, res)
        logits = [decode_step(ours, cache, t, len(ids) + i) for i, t in enumerate(toks)]
    else:
        seq = PagedSequence(KVPool.for_model(ours, num_blocks=16, block_size=16, hack_config=cfg))
        seq.load_prompt(res.kv.k, res.kv.v)
        logits = [batched_decode_step(ours, [seq], [t])[0] for t in toks]
    for a, b in zip(logits, steps, strict=True):
        assert float((a - b).abs().max() / b.abs().max()) < 0.2


def test_windows_follow_layer_types():
    windows = {
        name: ModelConfig.from_hf(random_hf_config(a, **o)).windows for name, (a, o) in VARIANTS.items()
    }
    assert windows["qwen2-layer-windows"] == (None, WINDOW, WINDOW)
    assert windows["qwen2-window-default-layers"] == (None, None, None)
    assert windows["mistral-window"] == (WINDOW,) * 3
    assert windows["llama"] == (None,) * 3
    # transformers' Llama ignores a sliding_window in its config, and so does ragkv
    assert ModelConfig.from_hf(random_hf_config("llama", sliding_window=4)).windows == (None,) * 3


def test_attention_bias_reaches_o_proj():
    cfg = ModelConfig.from_hf(random_hf_config("llama", attention_bias=True))
    assert cfg.qkv_bias and cfg.o_bias
    q = ModelConfig.from_hf(random_hf_config("qwen2"))
    assert q.qkv_bias and not q.o_bias


def test_longrope_is_refused_by_name():
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 64,
    }
    with pytest.raises(UnsupportedRopeError, match="longrope"):
        ModelConfig.from_hf(random_hf_config("llama", rope_parameters=rope))


def _fp(**overrides) -> str:
    cfg = ModelConfig.from_hf(random_hf_config("llama", **overrides))
    return model_fingerprint(cfg, "w", torch.float32, "t")


def test_fingerprint_covers_bos_and_every_rope_parameter():
    assert _fp() == _fp()
    assert _fp(bos_token_id=1) != _fp(bos_token_id=5)
    assert _fp(attention_bias=True) != _fp()
    yarn = yarn_rope(32)
    assert _fp(rope_parameters=yarn) != _fp(rope_parameters={**yarn, "factor": 2.0})
    # list-valued parameters count too (a fingerprint of their scalar siblings only would collide)
    from ragkv.model import loader

    a = loader._jsonable({"rope_type": "x", "short_factor": [1.0, 2.0]})
    b = loader._jsonable({"rope_type": "x", "short_factor": [1.0, 3.0]})
    assert a != b


def test_block_keys_never_match_across_provenance():
    ids = list(range(12))
    exact = block_keys(ids, 4, 3, "s")
    assert block_keys(ids, 4, 3, "s", num_exact=12) == exact
    blended = block_keys(ids, 4, 3, "s", num_exact=4)
    assert blended[0] == exact[0]  # the exact head is shared
    assert blended[1] != exact[1] and blended[2] != exact[2]
