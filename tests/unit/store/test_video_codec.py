"""The ``video`` KV codec: bit-exact round trips, store integration, corruption, adaptive resolution."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch

av = pytest.importorskip("av")

from eval.video_adaptive import (  # noqa: E402
    DecodeProfile,
    TokenBucket,
    VersionProfile,
    choose_version,
    profile_decode,
    simulate_fetch,
)
from eval.video_search import cached_tiling, search_tiling, tune_tiling  # noqa: E402
from ragkv.store.codecs import get_codec  # noqa: E402
from ragkv.store.codecs.base import CodecError  # noqa: E402
from ragkv.store.codecs.video import VideoCodec, backends, container, nvdec  # noqa: E402
from ragkv.store.codecs.video.allocate import allocate_layer_steps  # noqa: E402
from ragkv.store.codecs.video.layout import Tiling, candidate_tilings, default_tiling  # noqa: E402
from ragkv.store.codecs.video.order import greedy_chain, pack_orders, unpack_orders  # noqa: E402
from ragkv.store.codecs.video.quantize import QuantConfig, QuantizeError, quantize, scale_of  # noqa: E402
from tests.helpers import stories_model, stories_path  # noqa: E402

HAVE_STORIES = stories_path().exists()


def kv_like(
    g: int, t: int, h: int, d: int, seed: int = 0, dtype=torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """KV with real-KV traits: per-channel offsets, one outlier channel, token-to-token correlation."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(g, 1, h, d, generator=gen) * 2.0
    walk = torch.cumsum(torch.randn(g, t, h, d, generator=gen) * 0.3, dim=1)
    k = base + walk + torch.randn(g, t, h, d, generator=gen)
    k[..., 0, 0] *= 20.0  # outlier channel
    v = torch.randn(g, t, h, d, generator=gen) + 0.5 * walk
    return k.to(dtype), v.to(dtype)


def roundtrip(codec: VideoCodec, k: torch.Tensor, v: torch.Tensor, versions=None) -> None:
    ref_k, ref_v = codec.quantized_reference(k, v)
    blobs = codec.encode_versions(k, v, versions) if versions else {codec.slots: codec.encode(k, v)}
    for slots, data in blobs.items():
        got_k, got_v = codec.decode(data)
        assert got_k.dtype == k.dtype and got_k.shape == k.shape
        assert torch.equal(got_k, ref_k), f"K differs at slots={slots}"
        assert torch.equal(got_v, ref_v), f"V differs at slots={slots}"


# -- bit-exact round trips -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape",
    [(3, 37, 4, 8), (2, 1, 4, 8), (1, 5, 8, 8), (3, 64, 2, 16), (3, 9, 3, 8)],
    ids=["gqa-odd-T", "one-token", "mha-one-layer", "two-heads", "three-heads"],
)
def test_roundtrip_every_version_is_bit_exact(shape):
    k, v = kv_like(*shape, seed=sum(shape))
    roundtrip(VideoCodec(), k, v, versions=[1, 4, 16, 64])


@pytest.mark.parametrize(
    "opts",
    [
        dict(planes="gray"),
        dict(planes="yuv444", order="group"),
        dict(planes="yuv444", order="layer", slots=5),
        dict(bits=10, k_step=0.1, v_step=0.1),
        dict(bits=12, planes="gray", order="tensor"),
        dict(bits=4, mode="minmax", v_axis="token", order="none"),
        dict(bits=3, k_step=1.5, v_axis="token"),
        dict(k_bits=8, v_bits=10, tiling=(2, 4)),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_roundtrip_options(opts):
    k, v = kv_like(3, 21, 4, 8, seed=3)
    roundtrip(VideoCodec(**opts), k, v)


def test_torch_restore_path_used_on_gpus_is_bit_identical_to_numpy():
    k, v = kv_like(3, 29, 4, 8, seed=31)
    for opts in (dict(), dict(v_axis="token", bits=10, k_step=0.1, v_step=0.2)):
        c = VideoCodec(**opts)
        data = c.encode(k, v)
        c.restore_backend = "torch"
        for dt in (torch.float32, torch.float16, torch.bfloat16):
            tk, tv = c.decode(data, dtype=dt)
            rk, rv = c.quantized_reference(k, v, dtype=dt)
            assert torch.equal(tk, rk) and torch.equal(tv, rv), (opts, dt)


def test_roundtrip_fp16_and_bf16_inputs_keep_their_dtype():
    for dt in (torch.float16, torch.bfloat16):
        k, v = kv_like(2, 13, 4, 8, seed=5, dtype=dt)
        roundtrip(VideoCodec(), k, v)


def test_quantization_error_is_bounded_by_half_a_step_and_never_clips():
    k, v = kv_like(3, 50, 4, 8, seed=7)
    k[1, 7, 2, 3] = 1e4  # an extreme outlier must widen its channel's step, not clip
    for cfg in (QuantConfig(), QuantConfig(bits=4, mode="minmax"), QuantConfig(bits=6, axis="token")):
        qt = quantize(k, cfg)
        err = (qt.dequantize(torch.float64).reshape(k.shape) - k.double()).abs()
        step = torch.from_numpy(scale_of(qt.code)).double()
        bound = step.expand(3, 50, 32).reshape(k.shape) / 2 + k.double().abs() * 2.0**-23
        assert bool((err <= bound).all()), cfg


def test_bad_inputs_raise_typed_errors():
    c = VideoCodec()
    k, v = kv_like(3, 8, 4, 8)
    bad = k.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(QuantizeError):
        c.encode(bad, v)
    with pytest.raises(ValueError):
        c.encode(k, v[:, :4])
    with pytest.raises(ValueError):
        c.encode(torch.cat([k, k[:1]]), torch.cat([v, v[:1]]))  # 4 layers > group of 3
    with pytest.raises(ValueError):
        VideoCodec(tiling=(3, 1)).encode(k, v)  # 3 does not divide 4 heads
    with pytest.raises(ValueError):
        VideoCodec(planes="rgb")


def test_per_layer_steps_need_the_layer_index_and_stay_bit_exact():
    k, v = kv_like(5, 30, 4, 8, seed=23)
    c = VideoCodec(k_layer_steps=[1, 1, 0.25, 1, 4], v_layer_steps=[1] * 5, k_step=1.0, v_step=1.0)
    assert c.params()["k_layer_steps"] == [1, 1, 0.25, 1, 4]
    with pytest.raises(ValueError, match="layer_start"):
        c.encode(k[:3], v[:3])
    for start, stop in c.groups(5):
        data = c.encode(k[start:stop], v[start:stop], layer_start=start)
        assert c.header(data).layer_start == start
        rk, rv = c.quantized_reference(k[start:stop], v[start:stop], layer_start=start)
        dk, dv = c.decode(data)
        assert torch.equal(dk, rk) and torch.equal(dv, rv)
    qk, _ = c.quantize(k[:3], v[:3], layer_start=0)
    levels = [len(np.unique(qk.q[layer])) for layer in range(3)]
    assert levels[2] > 2 * levels[1]  # layer 2 has a 4x finer step
    with pytest.raises(ValueError):
        c.encode(k[3:5], v[3:5], layer_start=4)  # steps cover 5 layers, the group would end at 6


def test_allocation_equalizes_contributions_and_coarsens_insensitive_layers():
    k_kl, v_kl = [0.0, 0.001, 0.004], [0.0005, 0.0, 0.002]
    ks, vs = allocate_layer_steps(k_kl, v_kl, probe=1.0, target_kl=0.002, hi=3.0)
    assert ks[0] == 3.0 and vs[1] == 3.0  # no measured effect: coarsest step
    contrib = [x * s**2 for x, s in zip((*k_kl, *v_kl), (*ks, *vs), strict=True) if x > 0]
    assert max(contrib) == pytest.approx(min(contrib))
    assert sum(contrib) == pytest.approx(0.002)  # the model's KL meets the target
    assert ks[2] < ks[1]  # the more sensitive layer gets the finer step
    with pytest.raises(ValueError):
        allocate_layer_steps([0.1], [0.1, 0.2], 1.0, 0.01)


def test_nvenc_request_without_a_gpu_is_a_clear_error_and_auto_falls_back():
    k, v = kv_like(3, 12, 4, 8, seed=29)
    if not torch.cuda.is_available():
        with pytest.raises(CodecError, match="NVENC requested but unavailable: no CUDA device"):
            VideoCodec(encoder="nvenc").encode(k, v)
    c = VideoCodec(encoder="auto")
    roundtrip(c, k, v)


def test_nvenc_refusal_is_probed_once_and_auto_encodes_with_libx265_saying_why(caplog):
    """The H100/H200 case: FFmpeg's hevc_nvenc genuinely fails to open (probed for real, without the
    CUDA precondition); ``auto`` then encodes every stream with libx265 after one clear warning."""
    from ragkv.store.codecs import base

    ok, reason = nvdec.nvenc_status(refresh=True, require_cuda=False)
    try:
        if ok:
            pytest.skip("this machine has a working NVENC")
        assert "hevc_nvenc" in reason and "H100" in reason, reason
        assert nvdec.nvenc_status() == (ok, reason)  # cached: one probe per process
        base._LOGGED.difference_update([key for key in base._LOGGED if key[0] == "nvenc"])
        c = VideoCodec(encoder="auto")
        k, v = kv_like(3, 12, 4, 8, seed=30)
        with caplog.at_level("WARNING", logger="ragkv.store.video"):
            roundtrip(c, k, v)
            roundtrip(c, k[:2], v[:2])
        notes = [r for r in caplog.records if "NVENC unavailable" in r.getMessage()]
        assert len(notes) == 1 and "libx265" in notes[0].getMessage() and "H100" in notes[0].getMessage()
        assert dict(c.encoded_by) == {"libx265": 2}
        with pytest.raises(CodecError, match="NVENC requested but unavailable: hevc_nvenc does not open"):
            VideoCodec(encoder="nvenc").encode(k, v)
    finally:
        nvdec.nvenc_status(refresh=True)


def test_gpu_extra_and_nvdec_require_the_pynvvideocodec_release_with_the_16_bit_stride_fix():
    import tomllib

    from tests.helpers import REPO

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert "PyNvVideoCodec>=2.2.4" in extra
    assert nvdec.parse_version("2.2.4") == (2, 2, 4) and nvdec.parse_version("2.10.0rc1") == (2, 10, 0)
    assert nvdec.depth_ok_for_version("1.0.2", 8)
    assert not nvdec.depth_ok_for_version("2.2.3", 10) and not nvdec.depth_ok_for_version("2.1", 12)
    assert nvdec.depth_ok_for_version("2.2.4", 10) and nvdec.depth_ok_for_version("2.3.0", 12)


# -- store integration ---------------------------------------------------------------------------


def test_registered_and_rebuilt_from_params():
    c = get_codec("video", slots=4, k_step=0.7)
    assert isinstance(c, VideoCodec) and c.group_size == 3
    again = get_codec("video", **c.params())
    assert again.params() == c.params()


def test_store_roundtrip_with_layers_not_divisible_by_three(tmp_path):
    from ragkv.kv.chunk import ChunkKV
    from ragkv.store.localdir import LocalDirStore

    k, v = kv_like(5, 23, 4, 8, seed=11)
    chunk = ChunkKV(token_ids=torch.arange(23), k=k, v=v, start_pos=1, fingerprint="f" * 64)
    codec = VideoCodec(slots=4)
    store = LocalDirStore(tmp_path, codec=codec)
    assert store.put(chunk)
    got = store.get(chunk.key, chunk.fingerprint)
    assert got is not None
    for start, stop in codec.groups(5):
        rk, rv = codec.quantized_reference(k[start:stop], v[start:stop])
        assert torch.equal(got.k[start:stop], rk) and torch.equal(got.v[start:stop], rv)
    # a layer range that starts inside a group decodes only what it needs
    lk, lv = store.load_layers(chunk.key, 4, 5, chunk.fingerprint)
    assert torch.equal(lk, got.k[4:5]) and torch.equal(lv, got.v[4:5])


def test_corrupt_blob_in_store_is_a_miss_and_recompute_works(tmp_path):
    from ragkv.kv.chunk import ChunkKV
    from ragkv.store.localdir import LocalDirStore

    k, v = kv_like(3, 30, 4, 8, seed=12)
    chunk = ChunkKV(token_ids=torch.arange(30), k=k, v=v, start_pos=1, fingerprint="e" * 64)
    store = LocalDirStore(tmp_path, codec=VideoCodec(), verify=False)  # force the codec's own checks
    assert store.put(chunk)
    path = store.path_of(chunk.key)
    raw = bytearray(path.read_bytes())
    raw[-20] ^= 0x40  # inside the HEVC bitstream
    path.write_bytes(bytes(raw))
    assert store.get(chunk.key, chunk.fingerprint) is None  # a miss, never wrong KV
    assert store.stats()["corrupt"] + store.stats()["errors"] >= 1
    assert store.put(chunk)  # the recomputed chunk replaces the corrupt blob
    assert store.get(chunk.key, chunk.fingerprint) is not None


# -- corruption inside the codec -----------------------------------------------------------------


def _reseal(data: bytes, video: bytes) -> bytes:
    """Replace the bitstream and fix up both checksums, as a buggy decoder or a forged blob would."""
    hdr = container.unpack(data)
    head = bytearray(data[: hdr.video_offset - 4])
    fixed = container._FIXED
    fields = list(fixed.unpack_from(head, 0))
    fields[-2], fields[-1] = len(video), zlib.crc32(video)
    head[: fixed.size] = fixed.pack(*fields)
    return bytes(head) + struct.pack("<I", zlib.crc32(bytes(head))) + video


def test_corrupt_video_never_decodes_into_wrong_kv():
    c = VideoCodec(slots=4)
    k, v = kv_like(3, 40, 4, 8, seed=13)
    data = c.encode(k, v)
    hdr = container.unpack(data)
    video = bytearray(data[hdr.video_offset :])
    # payload checksum catches a flipped byte first
    flipped = bytearray(data)
    flipped[hdr.video_offset + len(video) // 2] ^= 0x01
    with pytest.raises(CodecError):
        c.decode(bytes(flipped))
    # with the checksums forged, the per-frame integer checksums still refuse every corruption
    rng = np.random.default_rng(0)
    for trial in range(8):
        bad = bytearray(video)
        pos = int(rng.integers(len(bad) // 4, len(bad)))
        bad[pos] ^= 1 << int(rng.integers(0, 8))
        forged = _reseal(data, bytes(bad))
        try:
            got_k, got_v = c.decode(forged)
        except CodecError:
            continue
        # decoding may only succeed if the flip did not change a single integer
        ref_k, ref_v = c.quantized_reference(k, v)
        assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v), trial


def test_truncated_and_foreign_bytes_raise_codec_error():
    c = VideoCodec()
    k, v = kv_like(2, 10, 4, 8)
    data = c.encode(k, v)
    for bad in (data[:10], data[:-1], b"RKVV" + data[4:40], b"not a video segment at all" * 4):
        with pytest.raises(CodecError):
            c.decode(bad)
    # a truncated bitstream with forged checksums: fewer frames than the header says
    hdr = container.unpack(data)
    with pytest.raises(CodecError):
        c.decode(_reseal(data, data[hdr.video_offset : hdr.video_offset + 200]))


def test_fingerprint_is_recorded_and_checked():
    k, v = kv_like(2, 10, 4, 8)
    data = VideoCodec(fingerprint="model-a").encode(k, v)
    assert container.unpack(data).fingerprint == "model-a"
    with pytest.raises(CodecError, match="model"):
        VideoCodec(fingerprint="model-b").decode(data)
    VideoCodec().decode(data)  # a codec without a fingerprint does not check


# -- frame-wise restoration ----------------------------------------------------------------------


def test_restore_frames_writes_each_frame_once_and_early():
    c = VideoCodec(slots=4)
    k, v = kv_like(3, 30, 4, 8, seed=17)
    data = c.encode(k, v, layer_start=6, token_start=100)
    hdr = c.header(data)
    assert (hdr.layer_start, hdr.token_start, hdr.frames) == (6, 100, 8)
    ref_k, _ = c.quantized_reference(k, v)
    out_k = torch.full_like(k, float("nan"))
    out_v = torch.full_like(v, float("nan"))
    frames = c.restore_frames(data, out_k, out_v)
    assert next(frames) == 0
    done = ~torch.isnan(out_k).any(-1).any(-1)  # [G, T] rows complete after frame 0
    assert 0 < int(done.sum()) < done.numel()
    assert torch.equal(out_k[done], ref_k[done])
    assert list(frames) == list(range(1, hdr.frames))
    assert not torch.isnan(out_k).any() and torch.equal(out_k, ref_k)


# -- blending with decoded KV --------------------------------------------------------------------


@pytest.mark.skipif(not HAVE_STORIES, reason="shared stories260k model not found")
def test_blended_answer_from_video_equals_int_quantized_kv():
    from ragkv.blend import prefill
    from ragkv.kv.chunk import ChunkKV
    from ragkv.model.forward import compute_chunk_kv

    model = stories_model()
    codec = VideoCodec(fingerprint=model.fingerprint)
    texts = ["Once upon a time there was a red ball.", "Tim liked to run in the park with his dog."]
    chunks = [compute_chunk_kv(model, model.encode(t)) for t in texts]
    suffix = model.encode(" The ball was")
    via_video, via_quant = [], []
    for ch in chunks:
        ks, vs, qk, qv = [], [], [], []
        for start, stop in codec.groups(ch.num_layers):
            dk, dv = codec.decode(codec.encode(ch.k[start:stop], ch.v[start:stop]))
            rk, rv = codec.quantized_reference(ch.k[start:stop], ch.v[start:stop])
            ks, vs, qk, qv = ks + [dk], vs + [dv], qk + [rk], qv + [rv]
        for dst, (kk, vv) in ((via_video, (ks, vs)), (via_quant, (qk, qv))):
            dst.append(ChunkKV(ch.token_ids, torch.cat(kk), torch.cat(vv), ch.start_pos, ch.fingerprint))
    a = prefill(model, [model.config.bos_token_id], via_video, suffix, mode="blend")
    b = prefill(model, [model.config.bos_token_id], via_quant, suffix, mode="blend")
    assert torch.equal(a.logits, b.logits)
    assert int(a.logits.argmax()) == int(b.logits.argmax())


# -- layout, order, tiling search ------------------------------------------------------------------


def test_tilings_are_invertible_and_cover_the_power_of_two_grid():
    x = np.arange(2 * 8 * 16).reshape(2, 8 * 16)
    cands = candidate_tilings(8, 16)
    assert len(cands) == 4 * 5
    for t in cands:
        tiles = t.tile(x, 8, 16)
        assert tiles.shape == (2, *t.shape(8, 16))
        assert np.array_equal(tiles.reshape(2, -1)[:, t.untile_index(8, 16)], x)
    assert default_tiling(8, 16).shape(8, 16) in ((8, 16), (16, 8))


def test_orders_are_similarity_chains_and_pack_exactly():
    rng = np.random.default_rng(1)
    centers = rng.integers(0, 200, (4, 16))
    x = np.concatenate([c + rng.integers(0, 3, (10, 16)) for c in centers])[rng.permutation(40)]
    order = greedy_chain(x)
    assert sorted(order.tolist()) == list(range(40))
    steps = np.abs(np.diff(x[order], axis=0)).sum(1)
    assert (steps > 100).sum() <= 3  # only the jumps between the 4 clusters are long
    packed = pack_orders(np.stack([order, order[::-1]]), 40)
    assert np.array_equal(unpack_orders(packed, 2, 40), np.stack([order, order[::-1]]))
    with pytest.raises(ValueError):
        unpack_orders(pack_orders(np.zeros((1, 40), np.int64), 40), 1, 40)


def test_tiling_search_scores_candidates_and_caches(tmp_path):
    k, v = kv_like(3, 24, 4, 8, seed=19)
    codec = VideoCodec(slots=4)
    cands = [Tiling(1, 1), Tiling(2, 2), Tiling(4, 8)]
    scored = search_tiling([(k, v)], codec, cands)
    assert [s for _, s in scored] == sorted(s for _, s in scored) and len(scored) == 3
    cache = tmp_path / "tilings.json"
    assert cached_tiling("fp", 4, 8, codec, cache) is None
    best = tune_tiling("fp", [(k, v)], codec, cache)
    assert best in candidate_tilings(4, 8)
    assert cached_tiling("fp", 4, 8, codec, cache) == best


# -- adaptive resolution ---------------------------------------------------------------------------


def _profile() -> DecodeProfile:
    return DecodeProfile(
        {
            4: VersionProfile(4, 1_000_000, {1: 0.30}, 0.05),
            16: VersionProfile(16, 1_200_000, {1: 0.20}, 0.02),
            64: VersionProfile(64, 1_500_000, {1: 0.10}, 0.0),
        }
    )


def test_choose_version_balances_transfer_and_decode():
    p = _profile()
    assert choose_version(p, 3e6, current=4) == 4  # slow link: 0.33 s transfer ~ 0.30 s decode
    assert choose_version(p, 15e6, current=64) == 64  # fast link: the quickest decode wins
    assert choose_version(p, 6e6, current=16) == 16  # 0.2 s transfer matches 0.2 s decode
    with pytest.raises(ValueError):
        choose_version(p, 0.0)
    # a version beaten on both size and decode time is never picked, even when it "balances" best
    dominated = DecodeProfile(
        {4: VersionProfile(4, 1_100_000, {1: 0.30}), 16: VersionProfile(16, 1_000_000, {1: 0.05})}
    )
    assert choose_version(dominated, 3.6e6) == 16


def test_token_bucket_follows_rate_changes_and_burst():
    link = TokenBucket([(0.0, 100.0), (2.0, 50.0)])
    assert link.send(100, 0.0) == pytest.approx(1.0)
    assert link.send(150, 1.0) == pytest.approx(3.0)  # 100 B in [1, 2) then 50 B at 50 B/s
    bursty = TokenBucket([(0.0, 100.0)], burst_bytes=200)
    assert bursty.send(200, 0.0) == pytest.approx(0.0)
    assert bursty.send(100, 0.5) == pytest.approx(1.0)  # 50 B banked while idle, 50 B at 100 B/s


def test_adaptive_fetch_over_store_switches_version_when_bandwidth_drops():
    from ragkv.kv.chunk import ChunkKV
    from ragkv.store.memory import MemoryStore

    codec = VideoCodec()
    versions = [4, 64]
    fp = "d" * 64
    chunks = []
    for i in range(6):
        k, v = kv_like(3, 48, 4, 8, seed=30 + i)
        chunks.append(ChunkKV(token_ids=torch.arange(48) + 100 * i, k=k, v=v, start_pos=1, fingerprint=fp))
    stores = {s: MemoryStore(codec=codec.with_slots(s)) for s in versions}  # one store per version
    for s in versions:
        for ch in chunks:
            assert stores[s].put(ch)

    def fetch(i: int, s: int) -> bytes:  # the bytes a remote fetch would move
        hdr, data = stores[s].fetch(chunks[i].key, fp)
        return bytes(data)

    small = float(np.mean([len(fetch(i, 4)) for i in range(6)]))
    large = float(np.mean([len(fetch(i, 64)) for i in range(6)]))
    assert small < large  # fewer slots per frame = smaller video
    prof = DecodeProfile({4: VersionProfile(4, small, {1: 0.03}), 64: VersionProfile(64, large, {1: 0.01})})
    fast, slow = large / 0.01, small / 0.03

    def run(policy):
        link = TokenBucket([(0.0, fast), (0.015, slow)])  # bandwidth drops during the second chunk
        return simulate_fetch(
            6, fetch, lambda i, s, d: prof.decode_time(s), link, policy, prof, initial_bps=fast
        )

    rep = run("adaptive")
    used = rep.versions_used()
    assert used[0] == 64 and used[-1] == 4
    assert rep.total_bytes == sum(len(fetch(i, s)) for i, s in enumerate(used))
    fixed = run(64)
    assert fixed.versions_used() == [64] * 6 and fixed.total_bytes > rep.total_bytes
    for c in rep.chunks:  # the virtual clock is consistent: decode after arrival, transfers serialized
        assert c.sent_s <= c.arrived_s <= c.decode_start_s <= c.decoded_s
    assert all(a.arrived_s <= b.sent_s + 1e-12 for a, b in zip(rep.chunks, rep.chunks[1:], strict=False))


def test_profile_decode_measures_this_machine():
    codec = VideoCodec()
    prof = profile_decode(codec, [kv_like(3, 24, 4, 8, seed=40)], versions=[4, 16], loads=(1, 2), repeats=1)
    for s in (4, 16):
        vp = prof.versions[s]
        assert vp.size_bytes > 0 and all(t > 0 for t in vp.decode_s.values()) and vp.penalty_s >= 0
    assert DecodeProfile.from_json(prof.to_json()).versions[4].decode_s == prof.versions[4].decode_s


# -- hardware decoders: NVDEC's frame-size rule and the auto fallback ------------------------------


class _PyAvAsHardware(backends.HardwareDecoder):
    """A registered decoder for CPU outputs with NVDEC's HEVC minimum size: the real PyAV decoder behind
    the hardware-decoder interface, so the size rule and the selection run without a GPU. ``corrupt_at``
    flips one pixel of that frame (a decoder returning a wrong surface) to exercise the fallback."""

    device_types = ("cpu",)

    def __init__(self, name: str, corrupt_at: int | None = None, refuse: bool = False):
        self.name, self.corrupt_at, self.refuse, self.calls = name, corrupt_at, refuse, 0

    def min_size(self, planes, depth):
        return nvdec.HEVC_MIN_SIZE

    def supports_format(self, planes, depth):
        return planes in nvdec.NVDEC_PLANES

    def decode_frames(self, data, planes, num_planes, depth, height, width, device):
        from ragkv.store.codecs.video import hevc_cpu

        self.calls += 1
        if self.refuse:
            raise backends.DecoderRefused("no decoder session for this stream")
        for f, arr in enumerate(hevc_cpu.decode_frames(data, num_planes, depth, height, width)):
            t = torch.from_numpy(arr.astype(np.int32))
            if f == self.corrupt_at:
                t[0, 0, 0] += 1
            yield t


@pytest.fixture
def hw_decoder():
    made = []

    def make(name, **kw):
        dec = _PyAvAsHardware(name, **kw)
        backends.register_decoder(dec)
        made.append(name)
        return dec

    yield make
    for name in made:
        backends.unregister_decoder(name)


def test_frames_below_the_nvdec_minimum_are_routed_to_the_cpu_decoder(hw_decoder):
    hw = hw_decoder("fake-nvdec")
    k, v = kv_like(3, 40, 4, 8, seed=50)
    c = VideoCodec(planes="yuv420", slots=4)
    data = c.encode(k, v)
    hdr = c.header(data)
    assert (hdr.frame_h, hdr.frame_w) < nvdec.HEVC_MIN_SIZE  # the 64x48-style frames NVDEC refuses
    got, why = backends.select_decoder("auto", "yuv420", 8, hdr.frame_h, hdr.frame_w, torch.device("cpu"))
    assert got is None and "below fake-nvdec's minimum of 144x144" in why
    gk, gv = c.decode(data)
    rk, rv = c.quantized_reference(k, v)
    assert torch.equal(gk, rk) and torch.equal(gv, rv)
    assert hw.calls == 0 and dict(c.decoded_by) == {"cpu": 1}
    with pytest.raises(CodecError, match="small_frames='pad'"):
        VideoCodec(decoder="fake-nvdec").decode(data)


def test_padded_frames_reach_the_nvdec_minimum_and_decode_there_bit_exactly(hw_decoder):
    hw = hw_decoder("fake-nvdec")
    k, v = kv_like(3, 40, 4, 8, seed=51)
    for planes in ("yuv420", "yuv444"):
        c = VideoCodec(planes=planes, slots=4, small_frames="pad")
        data = c.encode(k, v)
        hdr = c.header(data)
        assert (hdr.frame_h, hdr.frame_w) == nvdec.HEVC_MIN_SIZE
        rk, rv = c.quantized_reference(k, v)
        for dec in ("auto", "fake-nvdec", "cpu"):
            d = VideoCodec(decoder=dec)
            gk, gv = d.decode(data)
            assert torch.equal(gk, rk) and torch.equal(gv, rv), (planes, dec)
            assert dict(d.decoded_by) == {"cpu" if dec == "cpu" else "fake-nvdec": 1}
    assert hw.calls == 4
    assert VideoCodec(small_frames="pad", planes="gray").min_frame() == (16, 16)  # gray never goes to NVDEC
    with pytest.raises(ValueError, match="small_frames"):
        VideoCodec(small_frames="tile")


def test_auto_falls_back_to_the_cpu_decoder_when_a_hardware_decoder_refuses(hw_decoder, caplog):
    k, v = kv_like(3, 40, 4, 8, seed=52)
    c = VideoCodec(slots=4, small_frames="pad")
    data = c.encode(k, v)
    hdr = c.header(data)
    rk, rv = c.quantized_reference(k, v)
    for kw, resumed in ((dict(refuse=True), 0), (dict(corrupt_at=3), 3)):
        hw = hw_decoder("flaky", **kw)
        d = VideoCodec(decoder="auto")
        out_k, out_v = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        with caplog.at_level("WARNING", logger="ragkv.store.video"):
            frames = list(d.restore_frames(data, out_k, out_v))
        assert frames == list(range(hdr.frames))  # every frame restored once, in order
        assert torch.equal(out_k, rk) and torch.equal(out_v, rv)
        assert dict(d.decoded_by) == {"cpu-fallback": 1}
        assert f"after {resumed} of {hdr.frames} frames" in caplog.text and "on the CPU" in caplog.text
        calls = hw.calls
        d.decode(data)  # the refusal is remembered: auto goes straight to the CPU decoder
        assert hw.calls == calls and d.decoded_by["cpu"] == 1
        with pytest.raises(CodecError, match="flaky decode failed"):
            VideoCodec(decoder="flaky").decode(data)  # asked for by name: no silent fallback
        backends.unregister_decoder("flaky")
        caplog.clear()


# -- GPU (NVDEC) ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not nvdec.available(), reason="needs CUDA and PyNvVideoCodec (NVDEC)")
def test_nvdec_decode_matches_cpu_decode():
    k, v = kv_like(3, 40, 4, 8, seed=50)
    for planes in ("yuv444", "yuv420"):
        for bits in (8, 10):
            c = VideoCodec(planes=planes, bits=bits, decoder="nvdec", small_frames="pad")
            data = c.encode(k, v)
            gk, gv = c.decode(data, device="cuda")
            ck, cv = VideoCodec(decoder="cpu").decode(data)
            assert gk.is_cuda and torch.equal(gk.cpu(), ck) and torch.equal(gv.cpu(), cv), (planes, bits)
            assert dict(c.decoded_by) == {"nvdec": 1}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_small_streams_to_cuda_route_to_the_cpu_decoder_and_nvdec_by_name_says_why():
    k, v = kv_like(3, 40, 4, 8, seed=53)
    c = VideoCodec(planes="yuv420", slots=4)
    data = c.encode(k, v)
    gk, gv = c.decode(data, device="cuda")
    ck, cv = VideoCodec(decoder="cpu").decode(data)
    assert gk.is_cuda and torch.equal(gk.cpu(), ck) and torch.equal(gv.cpu(), cv)
    assert dict(c.decoded_by) == {"cpu": 1}
    if nvdec.available():
        assert nvdec.min_size("yuv420", 8) > (c.header(data).frame_h, 0)
        with pytest.raises(CodecError, match="minimum"):
            VideoCodec(decoder="nvdec").decode(data, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nvenc_or_a_clear_libx265_fallback_on_this_gpu():
    ok, reason = nvdec.nvenc_status(refresh=True)
    k, v = kv_like(3, 200, 8, 16, seed=54)  # frames large enough for NVENC's own minimum
    c = VideoCodec(encoder="auto", planes="yuv420", small_frames="pad")
    roundtrip(c, k, v)
    assert set(c.encoded_by) == ({"nvenc"} | {"libx265"} if ok else {"libx265"}), (ok, reason, c.encoded_by)
    if not ok:
        with pytest.raises(CodecError, match="NVENC requested but unavailable"):
            VideoCodec(encoder="nvenc").encode(k, v)
