"""Decode on low-bit weights: the kernel against dequantize-then-matmul for every block format, decode
tokens against float32 decode, prefill untouched, and the fallback when the kernel cannot be built."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from ragkv.model import lowbit, lowbit_kernel, random_model
from ragkv.model.loader import hf_state_dict, quantized_decode_weights, use_decode_weights
from tests.helpers import REPO, stories_model

needs_kernel = pytest.mark.skipif(
    os.environ.get("RAGKV_LOWBIT_KERNEL", "1") == "0", reason="the low-bit kernel is disabled here"
)

#: bytes of one GGUF block and where its fp16 scale fields lie (for random K-quant blocks)
K_QUANTS = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}


def gguf_rows(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """GGUF rows ``[n, bytes]`` of type ``qtype``: quantized by the gguf library, or random K-quant
    blocks (the library has no K-quant quantizer) with small finite scales."""
    rng = np.random.default_rng(seed)
    if qtype not in K_QUANTS:
        return lowbit.quantize_to_gguf(torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32)), qtype)
    bb, scales = K_QUANTS[qtype]
    raw = rng.integers(0, 256, size=(n, k // 256 * bb), dtype=np.uint8)
    blocks = raw.reshape(-1, bb)
    for o in scales:
        d = rng.uniform(1e-3, 1e-2, size=blocks.shape[0]).astype(np.float16)
        blocks[:, o : o + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw


FORMATS = ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("qtype", FORMATS)
def test_packed_blocks_dequantize_to_the_files_weights(qtype):
    """Scales and offsets are carried exactly: the packed weight is the gguf library's float32 weight."""
    raw = gguf_rows(qtype, 24, 512)
    t = lowbit.pack_gguf_tensor(raw, qtype, 512)
    assert t is not None and t.n == 24 and t.k == 512
    assert torch.equal(t.dequantize(), lowbit.dequantize_gguf(raw, qtype))


@needs_kernel
@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_kernel_matches_dequantize_then_matmul(qtype, rows):
    n, k = 38, 512  # 38 output rows: a tail of fewer than 4 rows after the 4-row tiles
    raw = gguf_rows(qtype, n, k, seed=rows)
    w = lowbit.dequantize_gguf(raw, qtype)
    lin = lowbit.LowBitLinear([lowbit.pack_gguf_tensor(raw, qtype, k)])
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    ref = x.double() @ w.double().T
    got = lin(x)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    scale = float((x.abs().double() @ w.abs().double().T).max())
    assert float((got.double() - ref).abs().max()) <= 1e-5 * scale
    bias = torch.randn(n)
    torch.testing.assert_close(lin(x, bias), got + bias)


@needs_kernel
def test_mixed_formats_in_one_linear():
    """q/k/v of different types (a K-quant mix) run as one linear, part by part."""
    a, b = gguf_rows("Q4_K", 64, 256), gguf_rows("Q6_K", 32, 256)
    lin = lowbit.LowBitLinear(
        [lowbit.pack_gguf_tensor(a, "Q4_K", 256), lowbit.pack_gguf_tensor(b, "Q6_K", 256)]
    )
    w = torch.cat([lowbit.dequantize_gguf(a, "Q4_K"), lowbit.dequantize_gguf(b, "Q6_K")])
    x = torch.randn(2, 256)
    torch.testing.assert_close(lin(x), x @ w.T, atol=2e-4, rtol=1e-4)


def _quantized_model(qtype: str, seed: int = 7):
    """A random model whose float32 weights are exactly its ``qtype`` blocks (as a GGUF model's are),
    with those blocks as its decode weights."""
    m = random_model("llama", seed=seed, init_std=0.1, tie_word_embeddings=True)
    packed = quantized_decode_weights(m, qtype)

    def deq(*names):
        return torch.cat([packed[n].dequantize() for n in names])

    for i, lw in enumerate(m.layers):
        a, p = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        lw.qkv_w.copy_(deq(*(f"{a}{x}_proj.weight" for x in "qkv")))
        lw.o_w.copy_(deq(a + "o_proj.weight"))
        lw.gate_up_w.copy_(deq(p + "gate_proj.weight", p + "up_proj.weight"))
        lw.down_w.copy_(deq(p + "down_proj.weight"))
    m.embed_w.copy_(deq("model.embed_tokens.weight"))
    return m, packed


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    from ragkv.blend import prefill
    from ragkv.generate import SamplingParams, generate

    res = prefill(model, prompt, [], [], "full")
    return generate(model, res, SamplingParams(max_new_tokens=n, stop_token_ids=())).token_ids


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_decode_on_blocks_gives_float32_decodes_tokens(qtype):
    m, packed = _quantized_model(qtype)
    prompt = [1, 17, 42, 99, 5, 63, 200, 31]
    want = _greedy(m, prompt, 24)
    assert m.set_decode_weights(packed) == "gguf" and m.decoder() is not m
    got = _greedy(m, prompt, 24)
    assert got == want
    # one decode step's logits: float rounding apart only
    from ragkv.generate import decode_step, make_cache

    caches = [make_cache(m, capacity=16) for _ in range(2)]
    la = [decode_step(m, caches[0], t, i) for i, t in enumerate(prompt)][-1]
    m.set_decode_weights(None)
    lb = [decode_step(m, caches[1], t, i) for i, t in enumerate(prompt)][-1]
    torch.testing.assert_close(la, lb, atol=1e-4, rtol=1e-4)


@needs_kernel
def test_float32_path_unchanged_and_prefill_bit_identical():
    """The switch off is today's decode, bit for bit; a multi-row forward never reads the blocks."""
    from ragkv.generate import decode_step, make_cache

    m, packed = _quantized_model("Q4_1", seed=3)
    ids = torch.arange(1, 40) % m.config.vocab_size

    def step_logits():
        cache = make_cache(m, capacity=48)
        return [decode_step(m, cache, int(t), i) for i, t in enumerate(ids[:6])][-1]

    before_prefill, _, _ = m.forward(ids)
    before_step = step_logits()
    m.set_decode_weights(packed)
    with_blocks_prefill, _, _ = m.forward(ids)
    assert torch.equal(with_blocks_prefill, before_prefill)  # prefill: float32 F.linear, untouched
    m.set_decode_weights(None)
    assert m.decoder() is m and m.decode_weights == "float32"
    assert torch.equal(step_logits(), before_step)
    assert torch.equal(m.forward(ids)[0], before_prefill)


@needs_kernel
def test_engine_batched_decode_runs_on_the_blocks():
    """The engine's batched decode goes through the same switch: a batch of 3 gives each request the
    tokens decode_step gives it alone, and its stats name the decode weights."""
    from ragkv.engine import Engine, EngineConfig
    from ragkv.generate import SamplingParams

    m, packed = _quantized_model("Q4_1", seed=5)
    m.set_decode_weights(packed)
    prompts = [[1, 5, 9, 13], [1, 77, 3], [1, 8, 8, 8, 8, 2]]
    params = SamplingParams(max_new_tokens=12, stop_token_ids=())
    with Engine(m, EngineConfig(num_blocks=200)) as eng:
        hs = [eng.submit(prefix=p, chunks=[], question=[], mode="full", params=params) for p in prompts]
        outs = [h.result() for h in hs]
    for p, out in zip(prompts, outs, strict=True):
        assert list(out.token_ids) == _greedy(m, p, 12)
        assert out.prefill_stats["decode_weights"] == "gguf"


def test_non_gguf_checkpoint_decodes_on_float32():
    m = stories_model()
    assert m.decode_weights == "float32" and m.decoder() is m
    assert "not a GGUF" in m.decode_weights_note


def test_fallback_when_the_kernel_is_missing(monkeypatch):
    """A GGUF model whose kernel cannot be built decodes on float32 weights and says why."""
    import ragkv.model.gguf as gguf_mod

    m = random_model("llama", seed=1)
    monkeypatch.setattr(gguf_mod, "gguf_source", lambda folder: REPO / "fake.gguf")
    monkeypatch.setattr(lowbit_kernel, "kernel", lambda: None)
    monkeypatch.setattr(lowbit_kernel, "kernel_error", lambda: "no compiler")
    assert use_decode_weights(m, REPO, "auto") == "float32"
    assert m.decoder() is m and "no compiler" in m.decode_weights_note
    assert use_decode_weights(m, REPO, "gguf") == "float32"  # asked for explicitly: a warning, no error
    assert use_decode_weights(m, REPO, "q8_0") == "float32"


@pytest.mark.slow
def test_kernel_build_without_a_compiler_falls_back(tmp_path):
    """No C++ compiler (a fresh cache, ``CXX`` pointing nowhere): the kernel is None, decode float32."""
    code = (
        "from ragkv.model import lowbit_kernel as k, random_model\n"
        "from ragkv.model.loader import use_decode_weights\n"
        "import ragkv.model.gguf as g\n"
        "assert k.kernel() is None, 'built'\n"
        "print(k.kernel_error())\n"
        "m = random_model('llama')\n"
        "g.gguf_source = lambda f: f\n"
        "print(use_decode_weights(m, '.', 'auto'))\n"
    )
    env = {**os.environ, "RAGKV_CACHE_DIR": str(tmp_path), "CXX": str(tmp_path / "no-such-c++")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "float32"


def test_decode_weights_settings(monkeypatch):
    from ragkv.model.loader import resolve_decode_weights

    monkeypatch.delenv("RAGKV_DECODE_WEIGHTS", raising=False)
    assert resolve_decode_weights(None) == lowbit.DEFAULT_DECODE_WEIGHTS
    assert resolve_decode_weights("fp32") == "float32"
    monkeypatch.setenv("RAGKV_DECODE_WEIGHTS", "float32")
    assert resolve_decode_weights(None) == "float32"
    with pytest.raises(ValueError, match="decode_weights"):
        resolve_decode_weights("int3")


@needs_kernel
def test_quantized_decode_of_a_float_checkpoint_is_opt_in():
    """``q8_0`` quantizes a float checkpoint's weights for decode (the stories model: its 172-wide
    down projections are no whole number of blocks and stay float32)."""
    m = stories_model()
    packed = quantized_decode_weights(m, "Q8_0")
    assert "model.layers.0.mlp.down_proj.weight" not in packed
    assert "model.layers.0.self_attn.q_proj.weight" in packed
    w = hf_state_dict(m)["model.layers.0.self_attn.q_proj.weight"]
    assert float((packed["model.layers.0.self_attn.q_proj.weight"].dequantize() - w).abs().max()) < 0.02


@needs_kernel
def test_decode_rope_rounds_as_the_models_rope():
    """The decode view's one-call RoPE is the model's RoPE bit for bit (no fused multiply-add)."""
    m = random_model("llama", seed=2, head_dim=64, hidden_size=256, num_attention_heads=4)
    m.set_decode_weights(quantized_decode_weights(m, "Q8_0"))
    for n in (1, 5):
        pos = torch.randint(0, 900, (n,), generator=torch.Generator().manual_seed(n))
        x = torch.randn(n, 4, 64, generator=torch.Generator().manual_seed(n + 1)) * 3
        tables = m.rope_tables(pos)
        assert torch.equal(m.decoder().rope(x, pos, tables), m.rope(x, pos, tables))


@needs_kernel
def test_hack_kv_decodes_on_the_blocks_too():
    """HACK's 2-bit KV cache is the decode cache under the same decode weights (its attention, the
    blocks' projections): the same tokens as float32 decode over HACK."""
    from ragkv.blend import prefill
    from ragkv.generate import SamplingParams, generate

    m, packed = _quantized_model("Q8_0", seed=11)
    res = prefill(m, [1, 4, 9, 16, 25, 36, 49, 64], [], [], "full")
    params = SamplingParams(max_new_tokens=10, stop_token_ids=())
    want = generate(m, res, params, attention="hack")
    m.set_decode_weights(packed)
    got = generate(m, res, params, attention="hack")
    assert got.token_ids == want.token_ids and got.timings["decode_weights"] == "gguf"


@needs_kernel
@pytest.mark.parametrize("n", [1, 17, 1500])  # 1500 rows x 9 heads: the kernel's threaded branch
def test_decode_attention_kernel_is_rope_write_and_attention(n):
    """One call: q and k rotated as the model's RoPE rounds, k and v written to the cache's row, and
    attention over rows 0..row equal to SDPA's (float rounding apart)."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(n)
    hq, hkv, d, cap = 9, 3, 64, n + 8
    m = random_model("llama", seed=2, head_dim=64, hidden_size=256, num_attention_heads=4)
    pos = torch.tensor([n - 1])
    cos, sin = m.rope_tables(pos)
    q, k, v = (torch.randn(1, h, d, generator=g) for h in (hq, hkv, hkv))
    base = torch.randn(
        2, hkv, cap + 5, d, generator=g
    )  # a layer of a bigger buffer: rows contiguous, heads strided
    kc, vc = base[0, :, :cap], base[1, :, :cap]
    out = lowbit_kernel.kernel().decode_attention(q, k, v, cos, sin, kc, vc, n - 1, 0.125)
    k_rot = m.rope(k, pos, (cos, sin))
    assert torch.equal(kc[:, n - 1], k_rot[0]) and torch.equal(vc[:, n - 1], v[0])
    q_rot = m.rope(q, pos, (cos, sin))
    want = F.scaled_dot_product_attention(
        q_rot[0].reshape(hkv, hq // hkv, d)[None], kc[None, :, :n], vc[None, :, :n], scale=0.125
    ).reshape(1, hq, d)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=2e-5)


def _decode(m, prompt: list[int], steps: int):
    from ragkv.blend import prefill
    from ragkv.generate import decode_step, load_prompt, make_cache

    res = prefill(m, prompt, [], [], "full")
    cache = make_cache(m, capacity=len(prompt) + steps)
    load_prompt(cache, res)
    tok, toks, logits = int(res.logits.argmax()), [], []
    for i in range(steps):
        lg = decode_step(m, cache, tok, len(prompt) + i)
        tok = int(lg.argmax())
        toks.append(tok)
        logits.append(lg)
    return toks, torch.stack(logits), cache


@needs_kernel
def test_a_decode_step_attends_in_one_call_and_keeps_its_tokens(monkeypatch):
    """The fused decode attention (RoPE, K/V write and attention in one kernel call per layer) gives
    the tokens of the step it replaces, logits within float rounding, and the same first-layer K/V rows."""
    from ragkv.model.llama import DecodeModel as Decoder

    m = random_model("llama", seed=5, head_dim=64, hidden_size=256, num_attention_heads=4, init_std=0.1)
    m.set_decode_weights(quantized_decode_weights(m, "Q8_0"))
    calls = []
    fused = Decoder.fused_attention
    monkeypatch.setattr(Decoder, "fused_attention", lambda *a: calls.append(1) or fused(*a))
    prompt = [1, 17, 42, 99, 5, 63, 200, 31]
    got, got_logits, got_cache = _decode(m, prompt, 12)
    assert len(calls) == 12 * m.config.num_layers
    monkeypatch.setattr(Decoder, "fused_attention", lambda *a: None)  # the step before: rotate, write, attend
    want, want_logits, want_cache = _decode(m, prompt, 12)
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
    n = len(prompt) + 12
    assert torch.equal(got_cache._k[0, :, :n], want_cache._k[0, :, :n])
    assert torch.equal(got_cache._v[0, :, :n], want_cache._v[0, :, :n])
    assert got_cache._len == want_cache._len and torch.equal(got_cache._pos[:, :n], want_cache._pos[:, :n])


@needs_kernel
def test_the_kernel_runs_on_torchs_threads_with_the_same_bits():
    """Built with OpenMP (torch's ``parallel_for`` is OpenMP pragmas in its headers: without ``-fopenmp``
    the kernel ran on one thread whatever the thread count), and its sums do not depend on the threads."""
    before = torch.get_num_threads()
    raw = gguf_rows("Q4_1", 256, 512, seed=3)
    lin = lowbit.LowBitLinear([lowbit.pack_gguf_tensor(raw, "Q4_1", 512)])
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(3))
    try:
        torch.set_num_threads(2)
        assert lowbit_kernel.kernel().parallel_threads(64) == 2
        two = lin(x)
        torch.set_num_threads(1)
        assert lowbit_kernel.kernel().parallel_threads(64) == 1
        assert torch.equal(lin(x), two)
    finally:
        torch.set_num_threads(before)
