"""The vLLM plugin: engine-independent logic on CPU, and contract tests against the real vLLM package.

Part 1 needs only ragkv. Part 2 imports the real ``vllm`` (0.32.x; it imports with this project's
CPU torch 2.13 when installed ``--no-deps`` plus its pure-Python deps, see
integrations/vllm/examples/contract_venv.sh) and is skipped, with the reason, where it is not
installed. Nothing here runs vLLM's CUDA kernels or its engine loop: see integrations/vllm/README.md.
"""

from __future__ import annotations

import inspect
import pickle
import sys

import pytest
import torch

from ragkv.blend.core import COMPUTED, EXACT, REUSED, BlendSchedule, selective_prefill
from ragkv.blend.resolver import PieceSlice
from ragkv.blend.source import LayerSource
from ragkv.blend.spans import ChunkRef, ChunkSpan, SpanError, check_spans, find_occurrences, locate_chunks
from ragkv.kv import chunk_key
from ragkv.model.forward import compute_chunk_kv
from ragkv.remote.wire import BlendParams, KVParamsError
from ragkv.testing import NO_VLLM, free_port, have_vllm, stories_model, stories_path
from ragkv_vllm.rows import blend_rows, blocks_of_rows, plan_rows, slot_mapping

TEXTS = [
    "Once upon a time there was a little girl named Lily. She loved to play outside in the sun.",
    "Tom had a big red ball. He liked to throw it high in the sky and catch it with his hands.",
    "The cat sat on the mat and looked at the bird. The bird sang a happy song all day long.",
]


# ============================== part 1: no vLLM needed ==============================================
class TestParams:
    def test_roundtrip(self):
        p = BlendParams(
            (ChunkRef("a" * 64, 3, 10), ChunkRef("b" * 64)), mode="blend", ratio=0.2, check_layers=(1, 2)
        )
        d = p.to_kv_transfer_params()
        import json

        assert BlendParams.from_kv_transfer_params(json.loads(json.dumps(d))) == p

    def test_absent_is_none(self):
        assert BlendParams.from_kv_transfer_params(None) is None
        assert BlendParams.from_kv_transfer_params({"other_connector": 1}) is None

    def test_key_strings_accepted(self):
        p = BlendParams.from_kv_transfer_params({"ragkv": {"chunks": ["k1", "k2"]}})
        assert [c.key for c in p.chunks] == ["k1", "k2"] and p.chunks[0].start is None

    @pytest.mark.parametrize(
        "body",
        [
            [],
            {"chunks": "k1"},
            {"chunks": [{"key": "../etc"}]},
            {"chunks": [{"key": "k", "start": 0}]},
            {"chunks": [{"key": "k", "start": -1, "length": 3}]},
            {"chunks": [{"key": "k", "start": 0, "length": 0}]},
            {"chunks": [{"key": "k", "start": 0, "length": 2, "x": 1}]},
            {"chunks": [], "mode": "full"},
            {"chunks": [], "ratio": 1.5},
            {"chunks": [], "ratio": True},
            {"chunks": [], "check_layers": [2, 1]},
            {"chunks": [], "check_layers": ["1"]},
            {"chunks": [], "save": "yes"},
            {"chunks": [], "deviation": "q"},
            {"chunks": [], "extra": 1},
        ],
    )
    def test_malformed_raise_typed(self, body):
        with pytest.raises(KVParamsError):
            BlendParams.from_kv_transfer_params({"ragkv": body})

    def test_reuse_has_no_schedule(self):
        assert BlendParams((), mode="reuse").schedule() is None
        # the library's default deviation (K)
        assert BlendParams((), ratio=0.3, check_layers=(1, 3)).schedule() == BlendSchedule(
            (1, 3), (0.3, 0.3), selector="kdev"
        )


class TestSpans:
    def test_find_occurrences(self):
        hay = [5, 1, 2, 1, 2, 3, 9]
        assert find_occurrences(hay, [[1, 2, 3], [1, 2], [4], [], None]) == [[3], [1, 3], [], [], []]

    def test_locate_in_order(self):
        prompt = [1, 7, 8, 9, 4, 7, 8, 9, 5, 6, 2]
        # the second chunk equals the first: it is searched after the first match
        assert locate_chunks(prompt, [[7, 8, 9], [7, 8, 9], [5, 6], [3], None]) == [1, 5, 8, None, None]

    def test_check_spans(self):
        a, b = ChunkSpan(0, "a", 2, 3), ChunkSpan(1, "b", 5, 2)
        assert check_spans([b, a], 10) == [a, b]
        with pytest.raises(SpanError):
            check_spans([a, ChunkSpan(1, "b", 4, 2)], 10)
        with pytest.raises(SpanError):
            check_spans([ChunkSpan(0, "a", 8, 3)], 10)

    def test_plan_rows(self):
        # prompt of 20: prefix 0..3, chunk A 4..9, gap 10, chunk B 11..15, question 16..19
        a, b = ChunkSpan(0, "a", 4, 6), ChunkSpan(1, "b", 11, 5)
        plan = plan_rows(20, [a, b], num_exact=0)
        assert plan.num_rows == 16 and plan.num_external == 16
        rc = plan.row_class.tolist()
        assert rc[:4] == [COMPUTED] * 4 and rc[4:10] == [REUSED] * 6 and rc[10] == COMPUTED
        assert rc[11:16] == [REUSED] * 5
        # the engine's prefix cache covers rows 0..7: chunk A is partly exact, its stored rows from 4 on
        plan = plan_rows(20, [a, b], num_exact=8)
        assert plan.num_exact == 8 and plan.num_external == 8
        assert [(p.start, p.stop, p.src_start) for p in plan.pieces] == [(8, 10, 4), (11, 16, 0)]
        assert plan.row_class[:8].tolist() == [EXACT] * 8
        # never the last prompt row: a chunk at the very end is cut one row short
        plan = plan_rows(16, [a, b], num_exact=0)
        assert plan.num_rows == 15 and plan.pieces[-1].stop == 15
        # nothing reusable beyond the engine's cache
        assert plan_rows(20, [a, b], num_exact=16) is None
        assert plan_rows(20, [], num_exact=0) is None
        # a failed chunk becomes computed rows
        plan = plan_rows(20, [a, b], num_exact=0).without(0)
        assert plan.row_class[4:10].tolist() == [COMPUTED] * 6 and len(plan.pieces) == 1

    def test_slots_and_blocks(self):
        table = [7, 3, 9]
        assert slot_mapping(table, 4, torch.tensor([0, 3, 4, 9])).tolist() == [28, 31, 12, 37]
        with pytest.raises(SpanError):
            slot_mapping(table, 4, torch.tensor([12]))
        assert blocks_of_rows(table, 4, 3, 5) == {7, 3}
        assert blocks_of_rows(table, 4, 5, 5) == set()


class _ExactPiece:
    """Pre-RoPE K/V of the prompt head from a real forward (what ragkv's prefix cache would hold)."""

    def __init__(self, k, v):
        self.k, self.v = k, v

    @property
    def num_tokens(self):
        return self.k.shape[1]

    def layer_kv(self, layer):
        return self.k[layer], self.v[layer]


def _prompt(model):
    prefix = model.encode("Read the stories and answer.\n\n", add_bos=True)
    chunks = [model.encode(t) for t in TEXTS]
    suffix = model.encode(" Who had a ball? Answer:")
    return prefix, chunks, suffix


def _reference(model, prefix, chunks, suffix, gap, schedule, n_exact):
    """ragkv's own selective prefill of ``prefix + c0 + gap + c1 + c2 + suffix`` (first ``n_exact`` rows exact)."""
    kvs = [compute_chunk_kv(model, c) for c in chunks]
    segs = [prefix, chunks[0], gap, chunks[1], chunks[2], suffix]
    ids = torch.tensor([t for s in segs for t in s])
    classes = [COMPUTED] * len(prefix) + [REUSED] * len(chunks[0]) + [COMPUTED] * len(gap)
    classes += [REUSED] * (len(chunks[1]) + len(chunks[2])) + [COMPUTED] * len(suffix)
    rc = torch.tensor(classes)
    rc[:n_exact] = EXACT
    _, k_full, v_full = model.forward(ids, capture_kv=True)
    pieces = [_ExactPiece(k_full[:, :n_exact], v_full[:, :n_exact])] if n_exact else []
    starts = [len(prefix), len(prefix) + len(chunks[0]) + len(gap)]
    starts.append(starts[1] + len(chunks[1]))
    for kv, st in zip(kvs, starts, strict=True):
        lo = max(0, n_exact - st)
        if lo < kv.num_tokens:
            pieces.append(PieceSlice(kv, lo, kv.num_tokens))
    res = selective_prefill(model, ids, rc, LayerSource(pieces, model.device, model.dtype), schedule)
    spans = [
        ChunkSpan(i, kv.key, st, kv.num_tokens) for i, (kv, st) in enumerate(zip(kvs, starts, strict=True))
    ]
    return ids, res, spans, kvs, k_full, v_full


def _run_blend(model, ids, spans, kvs, n_exact, k_full, v_full, params):
    plan = plan_rows(len(ids), spans, n_exact)
    pieces = [PieceSlice(kvs[p.span.index], p.src_start, p.src_start + p.num_tokens) for p in plan.pieces]
    pos = torch.arange(n_exact)
    got_k = torch.zeros(
        model.config.num_layers, plan.num_rows, model.config.num_kv_heads, model.config.head_dim
    )
    got_v = torch.zeros_like(got_k)

    def exact_kv(layer):
        return model.rope(k_full[layer, :n_exact], pos), v_full[layer, :n_exact]

    def write(layer, rows, k, v):
        got_k[layer, rows], got_v[layer, rows] = k, v

    stats = blend_rows(
        model, ids, plan, LayerSource(pieces, model.device, model.dtype), exact_kv, params, write
    )
    return plan, got_k, got_v, stats


FRESH = "fresh_check_kv" in inspect.signature(BlendSchedule).parameters


@pytest.mark.parametrize("n_exact", [0, 20])
@pytest.mark.parametrize("ratio,fresh", [(0.0, False), (0.3, False), (1.0, False), (0.3, True)])
def test_blend_rows_matches_selective_prefill(ratio, fresh, n_exact):
    """blend_rows over rows [n_exact, end) gives the KV ragkv's own selective prefill gives those rows."""
    if fresh and not FRESH:
        pytest.skip("this ragkv's BlendSchedule has no fresh_check_kv")
    model = stories_model()
    prefix, chunks, suffix = _prompt(model)
    gap = model.encode(" And then:")
    params = BlendParams((), ratio=ratio, fresh_check_kv=fresh)
    ids, res, spans, kvs, k_full, v_full = _reference(
        model, prefix, chunks, suffix, gap, params.schedule(), n_exact
    )
    plan, got_k, got_v, stats = _run_blend(model, ids, spans, kvs, n_exact, k_full, v_full, params)
    assert plan.num_rows == spans[-1].stop < len(ids)
    rows = slice(n_exact, plan.num_rows)
    torch.testing.assert_close(got_k[:, rows], res.kv.k[:, rows], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got_v[:, rows], res.kv.v[:, rows], atol=2e-5, rtol=1e-4)
    n_reused = plan.num_reused
    # same selection sizes: computed rows + round(ratio * reused) from the check layer on
    n_comp = plan.num_rows - n_exact - n_reused
    assert stats["recomputed_per_layer"][0] == n_comp + n_reused
    assert stats["recomputed_per_layer"][2] == n_comp + round(ratio * n_reused)
    if ratio == 1.0:  # a full recompute: exactly the full prefill's KV
        pos = torch.arange(plan.num_rows)
        for layer in range(model.config.num_layers):
            torch.testing.assert_close(
                got_k[layer, rows],
                model.rope(k_full[layer, : plan.num_rows], pos)[rows],
                atol=2e-5,
                rtol=1e-4,
            )


def test_blend_rows_reuse_mode_copies_stored_kv():
    """Full reuse (mode ``reuse``: no schedule): REUSED rows are exactly the stored KV rotated to their
    positions."""
    model = stories_model()
    prefix, chunks, suffix = _prompt(model)
    ids, res, spans, kvs, k_full, v_full = _reference(model, prefix, chunks, suffix, [], None, 0)
    reuse = BlendParams((), mode="reuse")
    assert reuse.schedule() is None
    plan, got_k, got_v, stats = _run_blend(model, ids, spans, kvs, 0, k_full, v_full, reuse)
    s = spans[1]
    pos = torch.arange(s.start, s.stop)
    for layer in (0, model.config.num_layers - 1):
        torch.testing.assert_close(got_k[layer, s.start : s.stop], model.rope(kvs[1].k[layer], pos))
        torch.testing.assert_close(got_v[layer, s.start : s.stop], kvs[1].v[layer])
    torch.testing.assert_close(got_k[:, : plan.num_rows], res.kv.k[:, : plan.num_rows], atol=2e-5, rtol=1e-4)


def test_saved_chunk_kv_is_the_chunk_convention():
    """What the connector saves (compute_chunk_kv with the served checkpoint's fingerprint) is the
    chunk convention: the chunk's rows of a prefill after BOS, K pre-RoPE, under the given key."""
    model = stories_model()
    toks = model.encode(TEXTS[0])
    a = compute_chunk_kv(model, toks, "served-fp")
    assert a.fingerprint == "served-fp" and a.start_pos == 1
    assert a.key == chunk_key(toks, "served-fp") != compute_chunk_kv(model, toks).key
    _, k_pre, v = model.forward(torch.tensor([model.config.bos_token_id, *toks]), capture_kv=True)
    torch.testing.assert_close(a.k, k_pre[:, 1:], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(a.v, v[:, 1:], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError):
        compute_chunk_kv(model, [], "served-fp")


def test_checkpoint_fingerprint_equals_runtime_fingerprint():
    """The connector's fingerprint of a checkpoint folder is the one ragkv stores chunk KV under."""
    from ragkv_vllm.model_hook import checkpoint_fingerprint

    model = stories_model()
    assert checkpoint_fingerprint(stories_path(), torch.float32) == model.fingerprint
    assert checkpoint_fingerprint(stories_path(), "bfloat16") != model.fingerprint


def test_client_builds_spans_that_match_the_prompt():
    from ragkv.remote.client import build_prompt, completion_body, parse_completion

    model = stories_model()
    prefix, chunks, suffix = _prompt(model)
    pairs = [(compute_chunk_kv(model, c).key, c) for c in chunks]
    prompt, params = build_prompt(prefix, pairs, suffix, ratio=0.2)
    parsed = BlendParams.from_kv_transfer_params(params)
    for ref, (key, toks) in zip(parsed.chunks, pairs, strict=True):
        assert ref.key == key and prompt[ref.start : ref.start + ref.length] == toks
    assert prompt == prefix + [t for c in chunks for t in c] + suffix
    body = completion_body("m", prompt, params, max_new_tokens=8, seed=3, stop=["\n"])
    assert body["kv_transfer_params"] == params and body["max_tokens"] == 8 and body["prompt"] == prompt
    with pytest.raises(ValueError):
        build_prompt(prefix, [("k", [])], suffix)
    out = parse_completion(
        {
            "choices": [{"text": " Tom", "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 1},
        }
    )
    assert out.text == " Tom" and out.prompt_tokens == 9
    from ragkv.remote.client import VllmServerError

    with pytest.raises(VllmServerError):
        parse_completion({"error": "boom"})


# ============================== part 2: the real vLLM package =======================================
HAVE_VLLM = have_vllm()  # without CUDA: vLLM's CPU platform
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason=NO_VLLM)


@needs_vllm
class TestVllmContract:
    def test_version_in_supported_range(self):
        import vllm
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version

        from ragkv_vllm import SUPPORTED_VLLM

        assert Version(vllm.__version__) in SpecifierSet(SUPPORTED_VLLM), (vllm.__version__, SUPPORTED_VLLM)

    def test_connector_implements_every_abstract_method_with_real_signatures(self):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

        from ragkv_vllm.connector import RagkvConnector, RagkvConnectorMetadata

        assert issubclass(RagkvConnector, KVConnectorBase_V1)
        assert issubclass(RagkvConnectorMetadata, KVConnectorMetadata)
        assert not inspect.isabstract(RagkvConnector), RagkvConnector.__abstractmethods__
        abstract = {
            n for n, m in vars(KVConnectorBase_V1).items() if getattr(m, "__isabstractmethod__", False)
        }
        assert abstract >= {
            "start_load_kv",
            "wait_for_layer_load",
            "save_kv_layer",
            "wait_for_save",
            "get_num_new_matched_tokens",
            "update_state_after_alloc",
            "build_connector_meta",
        }
        overridden = abstract | {
            "__init__",
            "register_kv_caches",
            "request_finished",
            "get_block_ids_with_load_errors",
        }
        for name in sorted(overridden):
            ours, base = getattr(RagkvConnector, name), getattr(KVConnectorBase_V1, name)
            assert ours is not base, name
            sp, sb = inspect.signature(ours), inspect.signature(base)
            assert [(p.name, p.kind, p.default) for p in sp.parameters.values()] == [
                (p.name, p.kind, p.default) for p in sb.parameters.values()
            ], name

    def test_factory_loads_by_module_path_and_by_registered_name(self):
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        from ragkv_vllm.connector import RagkvConnector
        from ragkv_vllm.plugin import register

        cfg = KVTransferConfig(
            kv_connector="RagkvConnector",
            kv_role="kv_both",
            kv_connector_module_path="ragkv_vllm.connector",
            kv_connector_extra_config={"store": "memory://"},
        )
        assert KVConnectorFactory.get_connector_class(cfg) is RagkvConnector
        register()
        cfg = KVTransferConfig(
            kv_connector="RagkvConnector", kv_role="kv_both", kv_connector_extra_config={"store": "memory://"}
        )
        assert KVConnectorFactory.get_connector_class(cfg) is RagkvConnector

    def test_entry_point_loads_through_vllms_plugin_loader(self, tmp_path, monkeypatch):
        """vLLM's own ``load_general_plugins`` finds and runs our entry point (as pyproject declares it)."""
        dist = tmp_path / "ragkv_vllm_ep-0.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ragkv-vllm-ep\nVersion: 0.0\n")
        (dist / "entry_points.txt").write_text("[vllm.general_plugins]\nragkv = ragkv_vllm.plugin:register\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setenv("VLLM_PLUGINS", "ragkv")
        import vllm.plugins as vp
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        found = vp.load_plugins_by_group(vp.DEFAULT_PLUGINS_GROUP)
        assert "ragkv" in found
        out = found["ragkv"]()
        assert out["connector"] == "RagkvConnector" and "RagkvConnector" in KVConnectorFactory._registry
        assert any(p.endswith("gpu_model_runner.GPUModelRunner") for p in out["model_hook"]), out
        assert found["ragkv"]() == out  # re-entrant: vLLM loads general plugins in every process

    def test_load_model_hook_wraps_the_real_runners(self):
        from ragkv_vllm.model_hook import install_load_model_hook

        patched = install_load_model_hook()
        import vllm.v1.worker.gpu_model_runner as r1

        assert getattr(r1.GPUModelRunner.load_model, "_ragkv_load_model_hook", False)
        assert install_load_model_hook() == patched  # idempotent: wrapped once
        assert not getattr(r1.GPUModelRunner.load_model.__wrapped__, "_ragkv_load_model_hook", False)

    def test_metadata_pickles_inside_a_scheduler_output(self):
        from ragkv_vllm.connector import LoadSpec, RagkvConnectorMetadata, SaveSpec

        meta = RagkvConnectorMetadata(
            loads=[LoadSpec("r1", [1, 2, 3, 4], [5, 6], 0, [(0, "k" * 64, 1, 2)], "blend", 0.15, [1], "v")],
            saves=[SaveSpec("r1", [[7, 8, 9]])],
        )
        back = pickle.loads(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL))
        assert back == meta and back.loads[0].plan().num_rows == 3

    def test_openai_request_carries_params_to_the_connector(self):
        """Client body -> vLLM's CompletionRequest -> SamplingParams -> Request.kv_transfer_params -> BlendParams."""
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.v1.request import Request

        from ragkv.remote.client import build_prompt, completion_body

        prompt, params = build_prompt([1, 2], [("a" * 64, [3, 4, 5]), ("b" * 64, [6, 7])], [8, 9], ratio=0.25)
        req = CompletionRequest.model_validate(completion_body("m", prompt, params, max_new_tokens=4))
        sp = req.to_sampling_params(max_tokens=4)
        r = Request(request_id="r", prompt_token_ids=prompt, sampling_params=sp, pooling_params=None)
        got = BlendParams.from_kv_transfer_params(r.kv_transfer_params)
        assert got == BlendParams.from_kv_transfer_params(params)
        assert [(c.start, c.length) for c in got.chunks] == [(2, 3), (5, 2)] and got.ratio == 0.25


# ---- vLLM model and connector on CPU ----------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory):
    """A real vLLM LlamaForCausalLM of stories260k on CPU (fp32), and a VllmConfig with our connector."""
    if not HAVE_VLLM:
        pytest.skip(NO_VLLM)
    from vllm.config import (
        DeviceConfig,
        KVTransferConfig,
        LoadConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    store_dir = tmp_path_factory.mktemp("kvstore")
    mc = ModelConfig(model=str(stories_path()), dtype="float32", enforce_eager=True, max_model_len=512)
    ktc = KVTransferConfig(
        kv_connector="RagkvConnector",
        kv_role="kv_both",
        kv_connector_module_path="ragkv_vllm.connector",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"store": f"file://{store_dir}"},
    )
    vc = VllmConfig(
        model_config=mc,
        load_config=LoadConfig(),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=ktc,
    )
    vc.cache_config.block_size = 16
    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        loader = get_model_loader(vc.load_config)
        with set_default_torch_dtype(torch.float32):
            model = loader.create_model(vllm_config=vc, model_config=mc)
            loader.load_weights(model, mc)
            process_weights_after_loading(model, mc, torch.device("cpu"))
    return vc, model, store_dir


def test_vllm_layer_model_matches_ragkv_runtime(vllm_env):
    """The adapter over vLLM's modules computes what ragkv's runtime computes on the same weights."""
    from ragkv_vllm.model_hook import VllmLayerModel

    vc, vmodel, _ = vllm_env
    ours = stories_model()
    lm = VllmLayerModel(vmodel, bos_token_id=ours.config.bos_token_id)
    assert (lm.config.num_layers, lm.config.num_heads, lm.config.num_kv_heads, lm.config.head_dim) == (
        ours.config.num_layers,
        ours.config.num_heads,
        ours.config.num_kv_heads,
        ours.config.head_dim,
    )
    ids = torch.tensor(ours.encode(TEXTS[1], add_bos=True))
    pos = torch.arange(ids.numel()) + 5
    h1, h2 = lm.embed(ids), ours.embed(ids)
    torch.testing.assert_close(h1, h2)
    for layer in range(ours.config.num_layers):
        a, b = lm.qkv(layer, h1), ours.qkv(layer, h2)
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(lm.rope(a[1], pos), ours.rope(b[1], pos), atol=1e-5, rtol=1e-4)
        o = ours.attend(layer, ours.rope(b[0], pos), ours.rope(b[1], pos), b[2], pos, pos, contiguous=True)
        h1, h2 = lm.finish_layer(layer, h1, o), ours.finish_layer(layer, h2, o)
        torch.testing.assert_close(h1, h2, atol=1e-4, rtol=1e-4)


def _kv_cache_config(vc, num_blocks):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    names = [f"model.layers.{i}.self_attn.attn" for i in range(5)]
    spec = FullAttentionSpec(
        block_size=vc.cache_config.block_size, num_kv_heads=4, head_size=8, dtype=torch.float32
    )
    page = spec.page_size_bytes
    tensor = KVCacheTensor(
        size=page * num_blocks * len(names), layers=names, layer_stride=page * num_blocks, block_stride=page
    )
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
    ), names


def _paged_caches(kcc, layout_name, kernel_block_size=None):
    """Per-layer KV cache views exactly as vLLM's allocator makes them for ``layout_name``."""
    from vllm.v1.kv_cache_interface import create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    tensor = kcc.kv_cache_tensors[0]
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    views = create_kv_cache_views(
        raw,
        kcc.kv_cache_groups[0].kv_cache_spec,
        kcc.num_blocks,
        KVCacheLayout[layout_name],
        tensor,
        kernel_block_size=kernel_block_size,
    )
    return dict(zip(tensor.layers, views, strict=True))


def _hack_kv_cache_config(kcc):
    """``kcc`` with its spec customized by the HACK backend (uint8 HACK pages), as vLLM's runner does."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    from ragkv_vllm.hack_backend import HackAttentionBackend

    group = kcc.kv_cache_groups[0]
    spec = HackAttentionBackend.customize_spec(group.kv_cache_spec)
    page, n, names = spec.page_size_bytes, kcc.num_blocks, group.layer_names
    tensor = KVCacheTensor(size=page * n * len(names), layers=names, layer_stride=page * n, block_stride=page)
    return KVCacheConfig(
        num_blocks=n, kv_cache_tensors=[tensor], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
    )


def _check_hack_blend(caches, names, slots, ref):
    """The blend went through hack_paged.write_rows: the pages hold ragkv's blend, quantized.

    The reference rows are written into fresh HACK pages the same way; vLLM's model and ragkv's runtime
    differ by float noise (~1e-5), which can flip a code at a rounding boundary, so the two read-backs
    agree exactly on almost every element and within one quantization step everywhere.
    """
    from ragkv.attention.hack_paged import PagedLayout, TailPool, read_rows, write_rows
    from ragkv_vllm.hack_backend import HackAttentionBackend, hack_layer

    for layer, name in enumerate(names):
        cache = caches[name]
        lay = PagedLayout(cache.shape[2], 4, 8)
        assert tuple(cache.shape) == HackAttentionBackend.get_kv_cache_shape(
            cache.shape[0], cache.shape[2], 4, 8
        )
        got_k, got_v = read_rows(cache, hack_layer(cache, 4, 8, 2, 64), slots)
        fresh, tails = lay.allocate(cache.shape[0]), TailPool(lay, 4)
        write_rows(fresh, tails, slots, ref.kv.k[layer, : slots.numel()], ref.kv.v[layer, : slots.numel()])
        want_k, want_v = read_rows(fresh, tails, slots)
        for got, want, exact in ((got_k, want_k, ref.kv.k), (got_v, want_v, ref.kv.v)):
            close = (got - want).abs() <= 1e-3
            assert close.float().mean() > 0.97
            step = (exact[layer, : slots.numel()].float() - want).abs().amax()  # one code step, at most
            assert (got - want).abs().amax() <= 2.01 * step + 1e-3


def _scheduler_output(new_reqs):
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    return SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={r.req_id: 1 for r in new_reqs},
        total_num_scheduled_tokens=len(new_reqs),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        num_common_prefix_blocks=[],
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


@pytest.mark.parametrize(
    "policy,layout,kbs",
    [
        ("recompute", "LBNHC", None),
        ("recompute", "LBHNC", None),
        ("recompute", "LBNHC", 8),
        ("fail", "LBNHC", None),
        ("recompute", "HACK", None),
    ],
)
def test_connector_blends_into_paged_cache(vllm_env, policy, layout, kbs):
    """Scheduler + worker connector on real vLLM objects: the paged cache ends up with ragkv's blend.

    Chunk 0 is stored, chunk 1 is stored but its blob is corrupted after the scheduler matched it
    (a load failure), chunk 2 is not stored (a miss, saved after the step).
    """
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.request import Request

    from ragkv.remote.client import build_prompt
    from ragkv.store import store_from_url
    from ragkv_vllm import model_hook
    from ragkv_vllm.connector import RagkvConnector

    vc, vmodel, store_dir = vllm_env
    vc.kv_transfer_config.kv_load_failure_policy = policy
    ours = stories_model()
    prefix, chunks, suffix = _prompt(ours)
    sub = store_dir / f"{policy}-{layout}-{kbs}"
    sub.mkdir(exist_ok=True)
    vc.kv_transfer_config.kv_connector_extra_config = {"store": f"file://{sub}"}
    store = store_from_url(f"file://{sub}")
    kvs = [compute_chunk_kv(ours, c) for c in chunks]
    store.put(kvs[0])
    store.put(kvs[1])
    prompt, params = build_prompt(
        prefix, [(kv.key, c) for kv, c in zip(kvs, chunks, strict=True)], suffix, ratio=0.3
    )
    bs = vc.cache_config.block_size
    n_blocks_req = -(-len(prompt) // bs)
    kcc, names = _kv_cache_config(vc, 64)
    with set_current_vllm_config(vc):
        sched = RagkvConnector(vc, KVConnectorRole.SCHEDULER, kcc)
        worker = RagkvConnector(vc, KVConnectorRole.WORKER, kcc)
    assert sched.fingerprint == ours.fingerprint
    req = Request(
        request_id="r1",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params}),
        pooling_params=None,
    )
    n_ext, is_async = sched.get_num_new_matched_tokens(req, 0)
    end = len(prefix) + sum(len(c) for c in chunks[:2])  # chunk 2 is not stored: rows end after chunk 1
    assert (n_ext, is_async) == (end, False)
    block_ids = list(range(10, 10 + n_blocks_req))[::-1]  # a non-trivial block table
    blocks = KVCacheBlocks(([KVCacheBlock(b) for b in block_ids],))
    sched.update_state_after_alloc(req, blocks, n_ext)
    new = NewRequestData.from_request(req, (block_ids,))
    meta = sched.build_connector_meta(_scheduler_output([new]))
    meta = pickle.loads(pickle.dumps(meta))  # as vLLM ships it to the worker process
    assert len(meta.loads) == 1 and [len(c) for c in meta.saves[0].chunks] == [len(chunks[2])]

    # corrupt chunk 1's blob after matching: the worker's layer reads fail
    blob = next(p for p in sub.rglob("*") if p.is_file() and kvs[1].key in p.name)
    data = bytearray(blob.read_bytes())
    data[-40:] = bytes(40)
    blob.write_bytes(bytes(data))

    if layout == "HACK":  # the HACK attention backend's pages, allocated as vLLM does from its spec
        kcc_hack = _hack_kv_cache_config(kcc)
        caches = _paged_caches(kcc_hack, "LBHNC")
    else:
        caches = _paged_caches(kcc, layout, kbs)  # kbs: vLLM splits each block into kernel blocks of kbs rows
        assert tuple(caches[names[0]].shape) == (64 * bs // (kbs or bs), 4, kbs or bs, 16)
    kbs = kbs or bs
    worker.register_kv_caches(caches)
    model_hook.register_model(vmodel, vc)
    try:
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        errors = worker.get_block_ids_with_load_errors()
        worker.wait_for_save()
        worker.clear_connector_metadata()
    finally:
        model_hook.clear_registered_model()

    c1 = (len(prefix) + len(chunks[0]), len(prefix) + len(chunks[0]) + len(chunks[1]))
    if policy == "fail":
        assert errors == blocks_of_rows(block_ids, bs, *c1) and errors
    else:
        assert errors == set() and worker.stats["chunks_recomputed_on_load_failure"] == 1
        # reference: ragkv's selective prefill with chunk 0 reused and chunk 1 computed (its load failed)
        ids = torch.tensor(prompt)
        rc = torch.full((len(prompt),), COMPUTED)
        rc[len(prefix) : c1[0]] = REUSED
        ref = selective_prefill(
            ours,
            ids,
            rc,
            LayerSource([kvs[0]], ours.device, ours.dtype),
            BlendSchedule.single(0.3, selector="kdev"),
        )
        slots = slot_mapping(block_ids, bs, torch.arange(end))
        if layout == "HACK":
            _check_hack_blend(caches, names, slots, ref)
            return
        for layer, name in enumerate(names):
            # read back as FlashAttention does: kv_cache.transpose(1, 2).split(head_size, dim=-1)
            key_cache, value_cache = caches[name].transpose(1, 2).split(8, dim=-1)  # [B, kbs, Hkv, D]
            torch.testing.assert_close(
                key_cache[slots // kbs, slots % kbs], ref.kv.k[layer, :end], atol=5e-5, rtol=1e-4
            )
            torch.testing.assert_close(
                value_cache[slots // kbs, slots % kbs], ref.kv.v[layer, :end], atol=5e-5, rtol=1e-4
            )
        # the missed chunk was computed alone (chunk convention) and stored for the next request
        saved = store_from_url(f"file://{sub}").get(kvs[2].key, ours.fingerprint)
        assert saved is not None
        torch.testing.assert_close(saved.k, kvs[2].k, atol=1e-5, rtol=1e-4)
    sched.request_finished(req, block_ids)


def test_real_scheduler_takes_the_connectors_rows(vllm_env, tmp_path):
    """vLLM's own Scheduler with our connector: external rows accepted, loads synchronous, metadata shipped.

    A second identical request is covered by vLLM's prefix cache beyond the chunks: nothing to load.
    """
    from vllm.config import set_current_vllm_config
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from ragkv.remote.client import build_prompt
    from ragkv.store import store_from_url
    from ragkv_vllm.connector import RagkvConnector, RagkvConnectorMetadata

    vc, _, _ = vllm_env
    vc.kv_transfer_config.kv_connector_extra_config = {"store": f"file://{tmp_path}"}
    vc.cache_config.num_gpu_blocks = 64
    ours = stories_model()
    prefix, chunks, suffix = _prompt(ours)
    kvs = [compute_chunk_kv(ours, c) for c in chunks]
    store = store_from_url(f"file://{tmp_path}")
    store.put(kvs[0])
    store.put(kvs[1])
    prompt, params = build_prompt(prefix, [(kv.key, c) for kv, c in zip(kvs, chunks, strict=True)], suffix)
    kcc, _ = _kv_cache_config(vc, 64)
    with set_current_vllm_config(vc):
        sched = Scheduler(vc, kcc, StructuredOutputManager(vc), block_size=vc.cache_config.block_size)
    assert isinstance(sched.connector, RagkvConnector)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(vc.cache_config.block_size, sha256)

    def request(rid):
        sp = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params})
        return Request(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=sp,
            pooling_params=None,
            block_hasher=hasher,
        )

    r1 = request("r1")
    sched.add_request(r1)
    out = sched.schedule()
    end = len(prefix) + len(chunks[0]) + len(chunks[1])
    assert out.num_scheduled_tokens == {"r1": len(prompt) - end} and out.has_sync_kv_loads
    meta = out.kv_connector_metadata
    assert isinstance(meta, RagkvConnectorMetadata) and [ld.req_id for ld in meta.loads] == ["r1"]
    assert [(k, st, n) for _, k, st, n in meta.loads[0].spans] == [
        (kvs[0].key, len(prefix), len(chunks[0])),
        (kvs[1].key, len(prefix) + len(chunks[0]), len(chunks[1])),
    ]
    assert meta.saves[0].chunks == [chunks[2]]
    pickle.loads(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))  # ships to workers as it is
    r2 = request("r2")
    sched.add_request(r2)
    out2 = sched.schedule()
    assert out2.kv_connector_metadata.loads == [] and not out2.has_sync_kv_loads


def test_connector_without_model_hook_reports_every_claimed_block(vllm_env):
    """No registered model (plugin missing): the worker cannot blend and must not leave unwritten KV used."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from ragkv_vllm import model_hook
    from ragkv_vllm.connector import LoadSpec, RagkvConnector, RagkvConnectorMetadata

    vc, _, _ = vllm_env
    model_hook.clear_registered_model()
    kcc, names = _kv_cache_config(vc, 8)
    with set_current_vllm_config(vc):
        worker = RagkvConnector(vc, KVConnectorRole.WORKER, kcc)
    worker.register_kv_caches(_paged_caches(kcc, "LBNHC"))
    spec = LoadSpec(
        "r", list(range(3, 60)), [4, 2, 7, 1], 0, [(0, "k" * 64, 10, 30)], "blend", 0.15, [1], "v"
    )
    worker.bind_connector_metadata(RagkvConnectorMetadata(loads=[spec]))
    worker.start_load_kv(None)
    assert worker.get_block_ids_with_load_errors() == {4, 2, 7}  # rows 0..39 live in the first three blocks


def test_connector_rejects_bad_extra_config(vllm_env):
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from ragkv_vllm.connector import ConnectorConfigError, RagkvConnector

    vc, _, _ = vllm_env
    kcc, _ = _kv_cache_config(vc, 8)
    old = vc.kv_transfer_config.kv_connector_extra_config
    try:
        for bad in ({}, {"store": "memory://", "nope": 1}, {"store": "memory://", "max_saves_per_step": -1}):
            vc.kv_transfer_config.kv_connector_extra_config = bad
            with set_current_vllm_config(vc), pytest.raises(ConnectorConfigError):
                RagkvConnector(vc, KVConnectorRole.SCHEDULER, kcc)
    finally:
        vc.kv_transfer_config.kv_connector_extra_config = old


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
