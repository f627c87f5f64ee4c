"""The GPU paths, made checkable on the CPU: a static-shape decode step (eval.static_decode) that CUDA
graphs and ``torch.compile`` can capture. Pinned staging: tests/unit/blend/test_pipeline_staging.py."""

from __future__ import annotations

import pytest
import torch

from eval.static_decode import StaticDecoder
from ragkv.blend import prefill
from ragkv.generate import SamplingParams, decode_step, generate, load_prompt, make_cache
from ragkv.model import random_model
from tests.helpers import stories_model, stories_path, top2_margin, ulps

HAVE_STORIES = stories_path().exists()
CUDA = torch.cuda.is_available()


# ---- static-shape decode --------------------------------------------------------------------------------------
def _models():
    out = [("random-fp32", random_model(seed=1, num_hidden_layers=3))]
    out.append(("random-bf16", random_model(seed=2, dtype="bfloat16")))
    if HAVE_STORIES:
        out.append(("stories260k", stories_model()))
    return out


def _decode_tolerance(dtype: torch.dtype, scale: float) -> float:
    """How far two summation orders may move decode logits of magnitude ``scale`` in a ``dtype`` model.

    Both decoders run the same kernels, but attention reduces over the static buffer's 78 rows (41 of
    them masked) instead of the 38..57 written ones, and the CPU kernels (AVX2 or AVX-512, picked at
    run time) accumulate in fp32 in their own order. fp32 models: that order shows up directly,
    measured up to 10 fp32 ulps of the logits' magnitude (stories260k, 8 prompts, both levels).
    bf16 models: the fp32 sums are rounded to bf16, so the logits differ by whole bf16 ulps, measured
    up to 1 (the random model; 2.7 for stories260k loaded in bf16). Tolerance: 32 fp32 ulps plus 4
    ulps of the model's dtype, over 3x the measurements for the models tested here.
    """
    return ulps(torch.float32, scale, 32) + ulps(dtype, scale, 4)


@pytest.mark.parametrize("idx", range(3), ids=["random-fp32", "random-bf16", "stories260k"])
def test_static_decode_gives_the_growing_cache_decode_tokens_and_logits(idx, one_thread):
    """Teacher-forced with the growing cache's greedy tokens, the static decoder gives the same logits
    within rounding at every step, and the same token wherever the top-2 margin exceeds that rounding;
    its free-running greedy follows the growing cache's tokens until the first step where it may not.

    Not bit-equal tokens: in bf16 a random model's top two logits are often within a bf16 ulp or two
    of each other (at 6 to 7 of these 19 steps), so which of them wins depends on the summation
    order, i.e. on the CPU's kernels (AVX-512 took the other token of a near tie at token 11, AVX2
    did not).
    """
    models = _models()
    if idx >= len(models):
        pytest.skip("shared stories260k model not found")
    name, m = models[idx]
    ids = [1] + torch.randint(
        3, m.config.vocab_size, (37,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    res = prefill(m, ids, [], [], "full")
    ref = generate(m, res, SamplingParams(max_new_tokens=20, stop_token_ids=())).token_ids
    sd = StaticDecoder(m, capacity=len(ids) + 40)
    assert isinstance(sd, torch.nn.Module)
    got = sd.greedy(res, 20)
    assert len(got) == 20 and got[0] == ref[0] == int(res.logits.argmax())  # the prefill's own token
    cache = make_cache(m, "fp16", capacity=8)  # grows by doubling, as generate's does
    load_prompt(cache, res)
    sd.load_prompt(res)
    decided = 0
    diverged = got[0] != ref[0]
    for i, tok in enumerate(ref[:-1]):
        a = decode_step(m, cache, tok, len(ids) + i)
        b = sd.step(tok, len(ids) + i)
        # same cache code, same rows as generate: bit-identical, so its token is generate's
        assert int(a.argmax()) == ref[i + 1], (name, i)
        tol = _decode_tolerance(m.dtype, float(a.abs().max()))
        err = float((a - b).abs().max())
        assert err <= tol, (name, i, err, tol)
        # |a - b| <= tol everywhere, so a margin above 2 tol cannot flip the argmax
        if float(top2_margin(a)) > 2 * tol:
            decided += 1
            assert int(b.argmax()) == ref[i + 1], (name, i)
        if not diverged:
            # greedy fed these same tokens so far, and sd.step is the same code on the same buffers:
            # its next token is exactly this step's argmax, hence ref's wherever the step is decided
            assert got[i + 1] == int(b.argmax()), (name, i, got, ref)
            diverged = got[i + 1] != ref[i + 1]
    assert sd.length == len(ids) + 19 == cache.length
    assert diverged or got == ref
    # the token checks are not vacuous: fp32 margins are at least 10x the tolerance at every step; in
    # bf16, 7 (AVX-512) and 8 (AVX2) of the 19 steps clear 2 tol here
    assert decided >= (19 if m.dtype == torch.float32 else 5), (name, decided)


def test_static_decode_traces_as_one_graph_and_refuses_overflow():
    m = random_model(seed=3)
    res = prefill(m, [1, 5, 9, 11], [], [], "full")
    sd = StaticDecoder(m, capacity=8)
    sd.load_prompt(res)
    compiled = torch.compile(sd, backend="eager", fullgraph=True)  # fullgraph: any graph break raises
    sd._set_inputs(7, 4)
    with torch.inference_mode():
        got = compiled()
    want = sd.step(7, 4)  # same row, same inputs
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="no room"):
        sd.load_prompt(prefill(m, list(range(1, 10)), [], [], "full"))
    for _ in range(3):
        sd.step(1, sd.length)
    with pytest.raises(ValueError, match="full"):
        sd.step(1, sd.length)
    with pytest.raises(RuntimeError, match="CUDA"):
        sd.capture()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_graph_decode_replays_the_eager_decode():
    m = random_model(seed=7, num_hidden_layers=4, dtype="bfloat16", device="cuda", hidden_size=256)
    ids = list(range(1, 30))
    res = prefill(m, ids, [], [], "full")
    eager = StaticDecoder(m, capacity=64)
    want = eager.greedy(res, 16)
    graphed = StaticDecoder(m, capacity=64)
    graphed.capture()
    assert graphed.greedy(res, 16, use_graph=True) == want
    ref = generate(m, res, SamplingParams(max_new_tokens=16, stop_token_ids=())).token_ids
    assert sum(a == b for a, b in zip(ref, want, strict=True)) >= 14  # bf16 on GPU: near-ties may flip
