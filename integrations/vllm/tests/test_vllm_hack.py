"""Contract tests of the HACK attention backend against the real vLLM package (skipped without vLLM)."""

from __future__ import annotations

import inspect

import pytest
import torch

from ragkv.attention.hack_cache import HackKVCache
from ragkv.attention.hack_paged import PagedLayout
from ragkv.testing import NO_VLLM, have_vllm, stories_path

HAVE_VLLM = have_vllm()
pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)


def _vllm_minor() -> tuple[int, int]:
    import vllm
    from packaging.version import Version

    return Version(vllm.__version__).release[:2]


def _same_signature(ours, base) -> None:
    a, b = inspect.signature(ours), inspect.signature(base)
    got = [(p.name, p.kind, p.default) for p in a.parameters.values()]
    want = [(p.name, p.kind, p.default) for p in b.parameters.values()]
    assert got == want, (ours, got, want)


def test_plugin_registers_backend_and_kv_cache_dtypes():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from ragkv_vllm import plugin
    from ragkv_vllm.hack_backend import HackAttentionBackend

    assert plugin._register_backend() == plugin.HACK_BACKEND_PATH
    dtypes = plugin._register_kv_cache_dtypes()
    assert AttentionBackendEnum.CUSTOM.get_class() is HackAttentionBackend
    assert AttentionBackendEnum["CUSTOM"].get_path() == plugin.HACK_BACKEND_PATH
    if _vllm_minor() >= (0, 33):
        from vllm.config.cache import KV_CACHE_DTYPES, get_kv_cache_dtype_handler
        from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
        from vllm.v1.kv_cache_interface import KVQuantMode, get_kv_quant_mode

        assert dtypes == ["hack_2bit", "hack_4bit", "hack_8bit"]
        for name in dtypes:
            assert name in KV_CACHE_DTYPES and STR_DTYPE_TO_TORCH_DTYPE[name] == torch.uint8
            assert get_kv_quant_mode(name) == KVQuantMode.CUSTOM
            assert get_kv_cache_dtype_handler(name).name == name
        assert plugin._register_kv_cache_dtypes() == dtypes  # idempotent
    else:  # 0.32: CacheDType is a closed Literal, no registration hook
        assert dtypes == []


def test_attention_backend_custom_resolves_through_vllms_selector():
    """``--attention-backend CUSTOM`` -> our class, validated as CudaPlatform.get_attn_backend_cls does.

    vllm.platforms.cuda cannot be imported without libcuda, so its two steps for a selected backend
    (``backend.get_class()``, then ``validate_configuration(device_capability, **selector config)``)
    are called here directly, with an H100's capability.
    """
    from vllm.config import AttentionConfig
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from ragkv_vllm import plugin
    from ragkv_vllm.hack_backend import HackAttentionBackend

    plugin._register_backend()
    plugin._register_kv_cache_dtypes()
    cfg = AttentionConfig(backend="CUSTOM")  # what --attention-backend CUSTOM parses to
    assert cfg.backend is AttentionBackendEnum.CUSTOM
    cls = cfg.backend.get_class()
    assert cls is HackAttentionBackend
    cap = DeviceCapability(9, 0)
    dtypes = ["auto"] + (["hack_2bit", "hack_4bit"] if _vllm_minor() >= (0, 33) else [])
    for kv_dtype in dtypes:
        sel = AttentionSelectorConfig(
            head_size=128, dtype=torch.bfloat16, kv_cache_dtype=kv_dtype, block_size=32
        )
        assert cls.validate_configuration(device_capability=cap, **sel._asdict()) == []
    bad = AttentionSelectorConfig(
        head_size=128, dtype=torch.bfloat16, kv_cache_dtype="fp8", block_size=24, has_sliding_window=True
    )
    reasons = cls.validate_configuration(device_capability=cap, **bad._asdict())
    assert {
        "kv_cache_dtype not supported",
        "block_size not supported",
        "sliding window not supported",
    } <= set(reasons)


def test_vllm_serve_arguments_of_the_hack_example_parse():
    """``vllm serve``'s engine arguments accept what examples/serve_and_query.sh passes with HACK=1."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from ragkv_vllm import plugin

    plugin._register_kv_cache_dtypes()
    kv_dtype = "hack_2bit" if _vllm_minor() >= (0, 33) else "auto"
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        ["--model", str(stories_path()), "--attention-backend", "CUSTOM", "--kv-cache-dtype", kv_dtype]
        + ["--block-size", "32"]
    )
    ea = EngineArgs.from_cli_args(args)
    assert (ea.kv_cache_dtype, ea.block_size) == (kv_dtype, 32)
    assert str(getattr(ea.attention_backend, "name", ea.attention_backend)) == "CUSTOM"


def test_backend_classes_satisfy_the_abstract_interface_with_real_signatures():
    from vllm.v1.attention.backend import AttentionBackend, AttentionImpl, AttentionMetadataBuilder
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from ragkv_vllm.hack_backend import (
        HackAttentionBackend,
        HackAttentionImpl,
        HackMetadataBuilder,
    )

    for ours, base in (
        (HackAttentionBackend, AttentionBackend),
        (HackAttentionImpl, AttentionImpl),
        (HackMetadataBuilder, AttentionMetadataBuilder),
    ):
        assert issubclass(ours, base) and not inspect.isabstract(ours), ours
        for name in getattr(base, "__abstractmethods__", ()):
            _same_signature(getattr(ours, name), getattr(base, name))
    for name in ("get_supported_kernel_block_sizes", "customize_spec", "supports_kv_cache_dtype"):
        _same_signature(getattr(HackAttentionBackend, name), getattr(AttentionBackend, name))
    _same_signature(HackAttentionImpl.do_kv_cache_update, CPUAttentionBackendImpl.do_kv_cache_update)
    assert HackAttentionBackend.get_impl_cls() is HackAttentionImpl
    assert HackAttentionBackend.get_builder_cls() is HackMetadataBuilder
    assert HackAttentionBackend.forward_includes_kv_cache_update is False


@pytest.mark.parametrize("bs,hkv,d", [(16, 8, 128), (32, 2, 64), (16, 4, 8)])
def test_kv_cache_shape_matches_vllms_allocation(bs, hkv, d):
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layer_kv_cache_shape_bytes,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from ragkv_vllm.hack_backend import HackAttentionBackend

    spec = HackAttentionBackend.customize_spec(
        FullAttentionSpec(block_size=bs, num_kv_heads=hkv, head_size=d, dtype=torch.bfloat16)
    )
    lay = PagedLayout(bs, hkv, d)
    assert spec.page_size_bytes == lay.page_bytes and HackAttentionBackend.customize_spec(spec) == spec
    if (bs, hkv, d) == (16, 8, 128):
        assert spec.page_size_bytes == 14592 and spec.page_size_bytes / (2 * 16 * 8 * 128 * 2) == 1824 / 8192
    nb = 5
    shape = HackAttentionBackend.get_kv_cache_shape(nb, bs, hkv, d, "auto")
    assert compute_layer_kv_cache_shape_bytes(spec, nb) == shape == lay.cache_shape(nb)
    tensor = KVCacheTensor(
        size=2 * nb * spec.page_size_bytes,
        layers=["a", "b"],
        layer_stride=nb * spec.page_size_bytes,
        block_stride=spec.page_size_bytes,
    )
    for layout in HackAttentionBackend.supported_kv_cache_layouts():
        if layout is KVCacheLayout.BLHNC:
            tensor = KVCacheTensor(
                size=2 * nb * spec.page_size_bytes,
                layers=["a", "b"],
                layer_stride=spec.page_size_bytes,
                block_stride=2 * spec.page_size_bytes,
            )
        raw = torch.zeros(tensor.size, dtype=torch.int8)
        views = create_kv_cache_views(raw, spec, nb, layout, tensor)
        for v in views:
            assert v.dtype == torch.uint8 and tuple(v.shape) == shape
            from ragkv.attention.hack_paged import page_views

            page_views(v, lay)  # accepted: (block, head) rows contiguous
    # the 1-token spec vLLM uses to size blocks is proportional to the page
    one = HackAttentionBackend.customize_spec(
        FullAttentionSpec(block_size=1, num_kv_heads=hkv, head_size=d, dtype=torch.bfloat16)
    )
    assert one.page_size_bytes * 16 == PagedLayout(16, hkv, d).page_bytes


# ---- the Impl on real vLLM metadata, against ragkv's HACK reference --------------------------------
def _common_metadata(qlens, seqlens, tables, slots):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(seqlens, dtype=torch.int32),
        num_reqs=len(qlens),
        num_actual_tokens=int(sum(qlens)),
        max_query_len=max(qlens),
        max_seq_len=max(seqlens),
        block_table_tensor=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )


def _dense(q, k, v, qpos, scale):
    n, hq, d = q.shape
    hkv = k.shape[1]
    s = torch.einsum("nhgd,thd->nhgt", q.view(n, hkv, hq // hkv, d), k) * scale
    mask = torch.arange(k.shape[0])[None, :] <= qpos[:, None]
    s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    return torch.einsum("nhgt,thd->nhgd", s.softmax(-1), v).reshape(n, hq, d)


def test_impl_forward_equals_hack_reference_for_prefill_then_decode():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from ragkv_vllm.hack_backend import HackAttentionBackend

    hq, hkv, d, bs, nb, scale = 4, 2, 32, 16, 12, 32**-0.5
    lay = PagedLayout(bs, hkv, d)
    vc = VllmConfig()
    vc.cache_config.block_size = bs
    with set_current_vllm_config(vc):
        spec = HackAttentionBackend.customize_spec(
            FullAttentionSpec(block_size=bs, num_kv_heads=hkv, head_size=d, dtype=torch.float32)
        )
        tensor = KVCacheTensor(
            size=nb * spec.page_size_bytes,
            layers=["l0"],
            layer_stride=nb * spec.page_size_bytes,
            block_stride=spec.page_size_bytes,
        )
        (kv_cache,) = create_kv_cache_views(
            torch.zeros(tensor.size, dtype=torch.int8), spec, nb, KVCacheLayout.LBHNC, tensor
        )
        builder = HackAttentionBackend.get_builder_cls()(spec, ["l0"], vc, torch.device("cpu"))
        impl = HackAttentionBackend.get_impl_cls()(hq, d, scale, hkv, None, None, "auto", None)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(nb, generator=g).tolist()
    tables = {"A": perm[0:3], "B": perm[3:6], "C": perm[6:9]}
    rows: dict[str, tuple[list, list]] = {r: ([], []) for r in tables}

    def step(batch):
        """batch: list of (request, query length); returns {request: (output, q, k, v, start)}."""
        qlens, seqlens, slots, tabs, parts = [], [], [], [], []
        for r, n in batch:
            start = sum(x.shape[0] for x in rows[r][0])
            q, k, v = (torch.randn(n, h, d, generator=g) for h in (hq, hkv, hkv))
            parts.append((r, q, k, v, start))
            qlens.append(n)
            seqlens.append(start + n)
            tabs.append(tables[r])
            slots += [tables[r][p // bs] * bs + p % bs for p in range(start, start + n)]
        md = builder.build(0, _common_metadata(qlens, seqlens, tabs, slots))
        q = torch.cat([p[1] for p in parts])
        k, v = torch.cat([p[2] for p in parts]), torch.cat([p[3] for p in parts])
        out = torch.empty(q.shape[0], hq * d)
        impl.do_kv_cache_update(None, k, v, kv_cache, md.slot_mapping)
        impl.forward(None, q, k, v, kv_cache, md, out)
        res, at = {}, 0
        for r, qq, kk, vv, start in parts:
            res[r] = (out[at : at + qq.shape[0]].view(-1, hq, d), qq, kk, vv, start)
            at += qq.shape[0]
            rows[r][0].append(kk)
            rows[r][1].append(vv)
        return md, res

    def ref_cache(r, upto):
        k, v = torch.cat(rows[r][0])[:upto], torch.cat(rows[r][1])[:upto]
        c = HackKVCache(1, hkv, d, scale, lay.config(use_triton=False))
        c.write(0, torch.arange(upto), k, v)
        return c

    md, res = step([("A", 20), ("B", 7)])  # two prompts in one batch
    assert (md.num_decodes, md.num_prefills) == (0, 2)
    for o, q, k, v, _ in res.values():
        torch.testing.assert_close(o, _dense(q, k, v, torch.arange(q.shape[0]), scale), atol=1e-5, rtol=1e-5)
    for _ in range(14):  # decode steps; A crosses its block boundary at row 32
        md, res = step([("A", 1), ("B", 1)])
        assert (md.num_decodes, md.num_prefills) == (2, 0)
        for r, (o, q, _, _, start) in res.items():
            want = ref_cache(r, start + 1).attend(0, q, torch.tensor([start])).float()
            torch.testing.assert_close(o, want, atol=1e-5, rtol=1e-5)
    md, res = step([("A", 1), ("C", 5)])  # a decode and a new prompt in one batch
    assert (md.num_decodes, md.num_prefills) == (1, 1)
    o, q, _, _, start = res["A"]
    torch.testing.assert_close(
        o, ref_cache("A", start + 1).attend(0, q, torch.tensor([start])).float(), atol=1e-5, rtol=1e-5
    )
    o, q, k, v, _ = res["C"]
    torch.testing.assert_close(o, _dense(q, k, v, torch.arange(5), scale), atol=1e-5, rtol=1e-5)
    md, res = step([("B", 1), ("C", 12)])  # chunked prefill: C's second chunk sees its first 5 rows quantized
    o, q, k, v, start = res["C"]
    # the chunk's rows are written first and fill C's first block, so its V is sealed (quantized) by the
    # time the chunk attends: the 5 context rows are read back dequantized, K and V
    view = ref_cache("C", start + 12).layer_view(0)
    keys = torch.cat([view.dequant_k()[:start], k])
    vals = torch.cat([view.dequant_v()[:start], v])
    torch.testing.assert_close(
        o, _dense(q, keys, vals, torch.arange(12) + start, scale), atol=1e-5, rtol=1e-5
    )
    o, q, _, _, start = res["B"]
    torch.testing.assert_close(
        o, ref_cache("B", start + 1).attend(0, q, torch.tensor([start])).float(), atol=1e-5, rtol=1e-5
    )
    assert impl.tails.in_use == 3  # one open block per request


def test_impl_refuses_features_it_does_not_implement():
    """Sliding windows, ALiBi, soft caps, encoder attention, KV sharing, fused output quantization:
    refused at construction / forward with the feature named, never computed wrongly."""
    from vllm.v1.attention.backend import AttentionType

    from ragkv_vllm.hack_backend import HackAttentionBackend

    impl_cls = HackAttentionBackend.get_impl_cls()
    cases = [
        ({"sliding_window": 128}, "sliding_window"),
        ({"alibi_slopes": [0.5, 0.25]}, "alibi_slopes"),
        ({"logits_soft_cap": 30.0}, "logits_soft_cap"),
        ({"attn_type": AttentionType.ENCODER}, "attn_type"),
        ({"kv_sharing_target_layer_name": "model.layers.0.self_attn.attn"}, "kv_sharing"),
    ]
    for kw, name in cases:
        with pytest.raises(NotImplementedError, match=name):
            impl_cls(2, 8, 8**-0.5, 2, **kw)
    impl = impl_cls(2, 8, 8**-0.5, 2)
    q = torch.zeros(1, 2, 8)
    with pytest.raises(NotImplementedError, match="output quantization"):
        impl.forward(None, q, q, q, torch.empty(0), None, torch.zeros_like(q), output_scale=torch.ones(1))
