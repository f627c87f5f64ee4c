"""KV codecs: raw is bit-exact, int8/int4 stay within their quantization step, bad bytes raise CodecError."""

from __future__ import annotations

import itertools

import pytest
import torch

from ragkv.store.codecs import CodecError, QuantCodec, RawCodec, available_codecs, get_codec


def kv(shape=(2, 33, 4, 64), dtype=torch.float16, seed=0, outlier_channels=True):
    """K with per-channel outliers (as real K has), V plain gaussian."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(shape, generator=g)
    if outlier_channels:
        k[..., 3] *= 20.0
        k[..., 7] += 5.0
    v = torch.randn(shape, generator=g)
    return k.to(dtype), v.to(dtype)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_builtin_codecs_are_registered():
    assert {"raw", "int8", "int4"} <= set(available_codecs())
    with pytest.raises(KeyError, match="unknown KV codec"):
        get_codec("nope")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("group", [1, 3])
def test_raw_round_trip_is_bit_exact(dtype, group):
    codec = get_codec("raw", group_size=group)
    k, v = kv((group, 17, 2, 8), dtype)
    dk, dv = codec.decode(codec.encode(k, v))
    assert dk.dtype == dtype and dv.dtype == dtype
    assert torch.equal(
        dk.view(torch.uint8) if dtype == torch.bfloat16 else dk,
        k.view(torch.uint8) if dtype == torch.bfloat16 else k,
    )
    assert torch.equal(dv, v)
    # decoded tensors own their memory: writing to them must not touch the codec's input or bytes
    dk.zero_()
    assert not torch.equal(dk, k)


def test_raw_decode_converts_dtype_and_rejects_bad_bytes():
    codec = RawCodec()
    k, v = kv((1, 9, 2, 8), torch.float16)
    data = codec.encode(k, v)
    dk, dv = codec.decode(data, dtype=torch.float32)
    assert dk.dtype == torch.float32 and torch.equal(dk, k.float()) and torch.equal(dv, v.float())
    with pytest.raises(CodecError):
        codec.decode(data[:-1])
    with pytest.raises(CodecError):
        codec.decode(b"XXXX" + data[4:])
    with pytest.raises(CodecError):
        codec.decode(data[:10])
    with pytest.raises(ValueError):
        codec.encode(k, v[:, :3])
    with pytest.raises(ValueError):
        codec.encode(k.to(torch.int32), v.to(torch.int32))


def _bound(x: torch.Tensor, axis: str, bits: int, symmetric: bool) -> torch.Tensor:
    """Per-element error bound: half a quantization step of its group, plus fp16 rounding slack."""
    x = x.float()
    dim = 3 if axis == "token" else 1
    if symmetric:
        step = x.abs().amax(dim=dim, keepdim=True) / ((1 << (bits - 1)) - 1)
    else:
        step = (x.amax(dim=dim, keepdim=True) - x.amin(dim=dim, keepdim=True)) / ((1 << bits) - 1)
    amax = x.abs().amax(dim=dim, keepdim=True)
    # scales/minimums are stored in fp16 (rel. 2^-11) and the output is fp16 again (rel. 2^-11)
    return 0.5 * step * (1 + 2**-8) + amax * 2**-9 + 1e-6


@pytest.mark.parametrize(
    "bits,k_axis,v_axis,symmetric",
    list(itertools.product([8, 4], ["channel", "token"], ["token", "channel"], [False, True])),
)
def test_quant_error_within_half_a_step(bits, k_axis, v_axis, symmetric):
    codec = get_codec(f"int{bits}", k_axis=k_axis, v_axis=v_axis, symmetric=symmetric)
    k, v = kv()
    data = codec.encode(k, v)
    dk, dv = codec.decode(data)
    assert dk.dtype == torch.float16 and dk.shape == k.shape
    for x, dx, axis in ((k, dk, k_axis), (v, dv, v_axis)):
        err = (dx.float() - x.float()).abs()
        assert (err <= _bound(x, axis, bits, symmetric)).all(), float(
            (err - _bound(x, axis, bits, symmetric)).max()
        )
    # sizes: int8 about half of fp16, int4 about a quarter (plus scales)
    raw = 2 * k.numel() * 2
    assert len(data) < raw * (0.62 if bits == 8 else 0.40)


def test_int8_default_settings_beat_per_token_k_on_outlier_channels():
    k, v = kv((4, 64, 4, 32))
    default = get_codec("int8")
    per_token = get_codec("int8", k_axis="token")
    assert default.params()["k_axis"] == "channel" and default.params()["v_axis"] == "token"
    e_default = rel_err(default.decode(default.encode(k, v))[0], k)
    e_token = rel_err(per_token.decode(per_token.encode(k, v))[0], k)
    assert e_default < 0.01 and e_default < e_token


def test_quant_handles_constant_and_zero_groups():
    k = torch.zeros(1, 8, 2, 4, dtype=torch.float16)
    v = torch.full((1, 8, 2, 4), 3.25, dtype=torch.float16)
    for name in ("int8", "int4"):
        codec = get_codec(name)
        dk, dv = codec.decode(codec.encode(k, v))
        assert torch.equal(dk, k)
        assert (dv.float() - 3.25).abs().max() < 3.25 * 2**-9


def test_quant_decode_dtype_device_and_params_round_trip():
    k, v = kv(dtype=torch.bfloat16)
    codec = QuantCodec(bits=8, symmetric=True, scale_dtype="float32")
    data = codec.encode(k, v)
    rebuilt = get_codec(codec.name, **codec.params())  # what a blob header records
    dk, dv = rebuilt.decode(data, device="cpu", dtype=torch.float32)
    assert dk.dtype == torch.float32 and rel_err(dk, k) < 0.01 and rel_err(dv, v) < 0.01
    assert codec.decode(data)[0].dtype == torch.bfloat16  # default: the dtype that was encoded


def test_quant_rejects_bad_input_and_bytes():
    k, v = kv()
    codec = get_codec("int8")
    bad = k.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        codec.encode(bad, v)
    with pytest.raises(ValueError):
        QuantCodec(bits=3)
    with pytest.raises(ValueError):
        QuantCodec(k_axis="head")
    data = codec.encode(k, v)
    for broken in (data[:-1], data + b"\0", b"QNT2" + data[4:], data[:8]):
        with pytest.raises(CodecError):
            codec.decode(broken)


def test_int4_packs_odd_element_counts():
    k, v = kv((1, 3, 1, 5), outlier_channels=False)
    codec = get_codec("int4")
    dk, dv = codec.decode(codec.encode(k, v))
    assert dk.shape == k.shape and dv.shape == v.shape
    assert rel_err(dk, k) < 0.2 and rel_err(dv, v) < 0.2
    # the last (odd) element of the packed stream decodes to its own value, not to a neighbour's
    k2 = torch.zeros_like(k)
    k2.view(-1)[-1] = 1.0
    dk2, _ = codec.decode(codec.encode(k2, v))
    assert float(dk2.view(-1)[-1]) > 0.5 and float(dk2.view(-1)[:-1].abs().max()) < 0.5


def test_codecs_on_real_kv_of_the_shared_model():
    """Raw is exact and int8 error is small on KV the trained stories260k model really produces."""
    from tests.helpers import stories_path

    if not stories_path().exists():
        pytest.skip(f"shared model not found at {stories_path()}")
    from ragkv.model.forward import compute_chunk_kv
    from tests.helpers import stories_model

    model = stories_model()
    text = "Once upon a time, there was a little girl named Lily. She loved to play in the park with her dog."
    ids = model.tokenizer(text * 4, add_special_tokens=False)["input_ids"][:200]
    chunk = compute_chunk_kv(model, ids)
    raw = get_codec("raw")
    k, v = raw.decode(raw.encode(chunk.k, chunk.v))
    assert torch.equal(k, chunk.k) and torch.equal(v, chunk.v)
    k16, v16 = chunk.k.half(), chunk.v.half()
    for layer in range(chunk.num_layers):
        q8 = get_codec("int8")
        dk, dv = q8.decode(q8.encode(k16[layer : layer + 1], v16[layer : layer + 1]))
        # measured on this model: ~0.002 (K) and ~0.003 (V); 4x headroom
        assert rel_err(dk, k16[layer : layer + 1]) < 0.01
        assert rel_err(dv, v16[layer : layer + 1]) < 0.012


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_straight_to_cuda():
    from ragkv.kv.chunk import ChunkKV
    from ragkv.store import MemoryStore

    k, v = kv((3, 40, 4, 64))
    for name in ("raw", "int8"):
        codec = get_codec(name)
        ck, cv = codec.decode(codec.encode(k, v), device="cuda")
        hk, hv = codec.decode(codec.encode(k, v))
        assert ck.is_cuda and torch.equal(ck.cpu(), hk) and torch.equal(cv.cpu(), hv)
    chunk = ChunkKV(torch.arange(40), k, v, start_pos=1, fingerprint="g" * 64)
    store = MemoryStore()
    store.put(chunk)
    buf = tuple(torch.empty(1, 40, 4, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    out = store.load_layers(chunk.key, 2, 3, chunk.fingerprint, out=buf)
    assert out[0] is buf[0] and torch.equal(buf[0].cpu(), k[2:3]) and torch.equal(buf[1].cpu(), v[2:3])


# -- stepz: std-step quantization + zstd, per-layer and RoPE-aware key steps -----------------------
def stepz_profile(layers=2, heads=4, head_dim=64, k=0.35, v=0.5, bits=None):
    from ragkv.store.codecs.stepz import StepProfile

    return StepProfile(k_steps=[k] * layers, v_steps=[v] * layers, k_bits=bits, fingerprint="s" * 64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_stepz_error_within_half_a_step_and_decode_is_its_reference(dtype):
    from ragkv.store.codecs.stepz import StepZCodec, scale_of

    k, v = kv((2, 57, 4, 64), dtype=dtype)
    codec = StepZCodec(profile=stepz_profile())
    data = codec.encode(k, v, layer_start=0)
    dk, dv = codec.decode(data)
    assert dk.dtype == dtype and dk.shape == k.shape and codec.peek_shape(data) == (2, 57, 4, 64)
    rk, rv = codec.reference(k, v)
    assert torch.equal(dk, rk) and torch.equal(dv, rv)
    for x, d, is_k in ((k, dk, True), (v, dv, False)):
        codes, _, _ = codec.quantize(x, 0, is_k)
        half = torch.from_numpy(scale_of(codes)).unsqueeze(1) / 2  # [G,1,H,D]
        tol = half * 1.001 + (0 if dtype == torch.float32 else 0.01 * x.float().abs())
        assert ((d.float() - x.float()).abs() <= tol).all()
        # steps are 0.35 / 0.5 std, so the relative error is ~0.1 / 0.15 std-normalized
        assert rel_err(d, x) < (0.12 if is_k else 0.17)
    # compact: far smaller than fp16 even on gaussian noise (real KV compresses better)
    assert len(data) < 0.3 * 2 * k.numel() * 2
    assert codec.decode(data, dtype=torch.float64)[0].dtype == torch.float64


def test_stepz_handles_constant_outlier_and_huge_channels_and_rejects_bad_bytes():
    from ragkv.store.codecs.stepz import StepZCodec

    codec = StepZCodec(profile=stepz_profile(layers=1))
    k = torch.zeros(1, 40, 2, 8)
    k[..., 1] = 3.25  # constant
    k[0, 5, 0, 2] = 1e4  # a lone outlier: the channel's step widens, nothing is clipped
    k[..., 3] = 1e6 + torch.arange(40.0)[None, :, None]  # large offset
    v = torch.randn(1, 40, 2, 8)
    dk, dv = codec.decode(codec.encode(k, v))
    assert torch.allclose(dk[..., 1], k[..., 1]) and (dk[0, 5, 0, 2] - 1e4).abs() < 0.2 * k[0, :, 0, 2].std()
    assert (dk[..., 3] - k[..., 3]).abs().max() < 0.2 * k[0, :, 0, 3].std() + 0.1 and rel_err(dv, v) < 0.2
    with pytest.raises(ValueError, match="non-finite"):
        codec.encode(torch.full((1, 4, 2, 8), float("nan")), v[:, :4])
    data = codec.encode(k, v)
    for bad in (b"", data[:10], b"XXXX" + data[4:], data[:-7], data[:30] + bytes(len(data) - 30)):
        with pytest.raises(CodecError):
            codec.decode(bad)


def test_stepz_is_registered_and_records_its_profile_id():
    from ragkv.store.codecs import DEFAULT_CODEC

    assert DEFAULT_CODEC in available_codecs() and "stepz" in available_codecs()
    codec = get_codec("stepz")
    params = codec.for_fingerprint("u" * 64).params()  # no calibration: the uniform fallback
    assert params["profile"] == "fallback" or len(params["profile"]) == 12
    again = get_codec("stepz", **params)  # what a reader builds from a blob header: decodes fine
    k, v = kv((1, 9, 4, 64))
    dk, _ = again.decode(codec.for_fingerprint("u" * 64).encode(k, v))
    assert dk.shape == k.shape and rel_err(dk, k) < 0.1


def test_rope_bits_make_the_dominant_block_of_synthetic_keys_finer():
    """Keys whose frequency block 3 (channels 3 and 35: half-split RoPE pairs) carries the energy."""
    import numpy as np

    from ragkv.model.rope_energy import allocate_block_bits
    from ragkv.store.codecs.stepz import StepZCodec

    g = torch.Generator().manual_seed(1)
    k = torch.randn(1, 200, 2, 64, generator=g)
    k[..., 3] *= 30.0
    k[..., 35] *= 30.0
    v = torch.randn(1, 200, 2, 64, generator=g)
    var = k[0].double().var(0).numpy()  # [H, D]
    energy = (var[:, :32] + var[:, 32:])[None]  # uniform query energy
    bits = allocate_block_bits(energy, base_bits=4)
    assert (bits[0].argmax(-1) == 3).all()
    uniform = StepZCodec(profile=stepz_profile(layers=1, heads=2))
    aware = StepZCodec(profile=stepz_profile(layers=1, heads=2, bits=bits.tolist()))
    err = {}
    for name, c in (("uniform", uniform), ("aware", aware)):
        dk, _ = c.decode(c.encode(k, v, layer_start=0))
        err[name] = (dk - k).pow(2).sum().item()  # total key error energy (what the logits see)
        size = len(c.encode(k, v, layer_start=0))
        err[name + "_bytes"] = size
    assert err["aware"] < 0.5 * err["uniform"]
    assert err["aware_bytes"] < 1.1 * err["uniform_bytes"]
    assert np.isfinite(list(err.values())).all()


def test_calibration_is_kept_by_fingerprint_and_recomputed_when_corrupt(tmp_path, caplog):
    from ragkv.store.codecs import calibrate as cal
    from ragkv.store.codecs.stepz import StepProfile, load_profile, profile_path
    from tests.helpers import stories_model, stories_path

    if not stories_path().exists():
        pytest.skip("shared model missing")
    model = stories_model()
    p1 = cal.ensure_profile(model, tmp_path, n_questions=1, chunk_tokens=48)
    path = profile_path(model.fingerprint, tmp_path)
    assert path.exists() and p1.fingerprint == model.fingerprint
    L, H, D = model.config.num_layers, model.config.num_kv_heads, model.config.head_dim
    assert len(p1.k_steps) == L and len(p1.v_steps) == L
    assert torch.tensor(p1.k_bits).shape == (L, H, D // 2)
    assert (torch.tensor(p1.k_bits).sum(-1) == p1.base_bits * D // 2).all()
    assert cal.ensure_profile(model, tmp_path).meta["created"] == p1.meta["created"]  # loaded, not redone
    for junk in ("{not json", json_of({"version": 1, "k_steps": [-1], "v_steps": [1]}), ""):
        path.write_text(junk)
        assert load_profile(model.fingerprint, tmp_path) is None
        p2 = cal.ensure_profile(model, tmp_path, n_questions=1, chunk_tokens=48)
        assert p2.meta["created"] > p1.meta["created"] and load_profile(model.fingerprint, tmp_path)
    from eval.bench_stored_kv import layer_sensitivity

    per_layer = cal.calibrate(model, n_questions=1, chunk_tokens=48, sensitivity=layer_sensitivity)
    assert len(per_layer.meta["k_kl"]) == L and all(0.05 <= s <= 3.0 for s in per_layer.k_steps)
    other = StepProfile.from_json({**p1.to_json(), "fingerprint": "0" * 64})  # another model's file
    path.write_text(json_of(other.to_json()))
    assert load_profile(model.fingerprint, tmp_path) is None


def json_of(obj) -> str:
    import json

    return json.dumps(obj)
