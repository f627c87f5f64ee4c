"""Calibrate the ``stepz`` codec's steps for one model, once, and keep them by model fingerprint.

:func:`ensure_profile` returns the model's :class:`~ragkv.store.codecs.stepz.StepProfile` from
``$RAGKV_CACHE_DIR/stepz/<fingerprint>.json``, or calibrates it (a missing, corrupt or foreign file
is recomputed) and saves it. Calibration material is the demo corpus shipped with ragkv (its
passages as chunks, its questions as queries), never evaluation data.

1. **RoPE-aware key bits** (Block-GTQ's idea): the energy of each RoPE frequency block per layer and
   KV head (:func:`ragkv.model.rope_energy.rope_block_energy`, shared with HACK's key plans), then
   integer bits per block by greedy marginal gain under the layer's budget
   (:func:`ragkv.model.rope_energy.allocate_block_bits`).
2. **Per-layer steps** (optional, ``calibrate(..., sensitivity=...)``; off by default, see :func:`calibrate`): blend
   first-token KL with one (tensor, layer) quantized at a probe step (the rest exact) on the
   calibration questions, then reverse water-filling to a total KL budget
   (:func:`ragkv.store.codecs.video.allocate.allocate_layer_steps`, as for the video codec).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from ragkv.model.rope_energy import (
    DEMO_CORPUS,
    allocate_block_bits,
    demo_chunks,
    ensure_rope_energy,
    rope_block_energy,
)
from ragkv.store.codecs.stepz import (
    FALLBACK,
    StepProfile,
    StepZCodec,
    load_profile,
    register_profile,
    save_profile,
)
from ragkv.store.codecs.video.allocate import allocate_layer_steps

log = logging.getLogger("ragkv.store")

#: default uniform steps (x std): K, V (measured, docs/BENCHMARKS.md "Compact stored KV")
K_STEP, V_STEP = FALLBACK.k_steps[0], FALLBACK.v_steps[0]
#: probe step (x std) of the optional per-layer sensitivity measurement, and its KL budget
PROBE = 0.5
TARGET_KL = 0.001
BASE_BITS = 4
STEP_RANGE = (0.05, 3.0)


def calibration_material(model, n_questions: int = 2, chunk_tokens: int = 128):
    """``[(prefix, [chunk token ids] * 3, suffix)]`` from the demo corpus, in the model's prompt form."""
    from ragkv.model.chat import has_chat_template, render_parts

    corpus = json.loads(DEMO_CORPUS.read_text())
    chunks_all = demo_chunks(model, 3 * n_questions, chunk_tokens)
    out = []
    for i in range(n_questions):
        q = corpus["questions"][i % len(corpus["questions"])]["question"]
        chunks = chunks_all[3 * i : 3 * i + 3]
        if has_chat_template(model):
            prefix, suffix = render_parts(model, corpus.get("instruction", ""), f"Question: {q}", True)
        else:
            prefix, suffix = [model.config.bos_token_id], model.encode(" question: " + q + " answer:")
        out.append((list(prefix), chunks, list(suffix)))
    return out


def calibrate(
    model,
    n_questions: int = 2,
    chunk_tokens: int = 128,
    rope_bits: bool = True,
    sensitivity: Callable | None = None,
    k_step: float = K_STEP,
    v_step: float = V_STEP,
    target_kl: float = TARGET_KL,
    base_bits: int = BASE_BITS,
    probe: float = PROBE,
) -> StepProfile:
    """Measure and return the model's profile (does not save it; :func:`ensure_profile` does).

    Default: uniform steps ``k_step`` / ``v_step`` with RoPE-aware key bits (a few chunk forwards).
    ``sensitivity(model, cases, chunks_per_case, probe_codec, probe) -> (k_kl, v_kl)`` (the blend's
    first-token KL with one tensor of one layer quantized; ``eval.bench_stored_kv.layer_sensitivity``,
    outside the store layer because it blends) allocates per-layer steps to ``target_kl``: on the
    real default model that kept the first-token KL but changed more greedy answers than uniform
    steps of the same size, so it is not the default (docs/BENCHMARKS.md, "Compact stored KV").
    """
    t0 = time.perf_counter()
    cases = calibration_material(model, n_questions, chunk_tokens)
    flat = [ids for _, chunks, _ in cases for ids in chunks]
    kv = None
    if sensitivity is None and flat == demo_chunks(model):  # the default material: one calibration
        energy = ensure_rope_energy(model)  # per model, shared with HACK's key plans
    else:
        energy, kv = rope_block_energy(model, flat)
    L = model.config.num_layers
    k_bits = allocate_block_bits(energy, base_bits).tolist() if rope_bits else None
    k_steps, v_steps = [k_step] * L, [v_step] * L
    meta: dict = {"questions": n_questions, "chunk_tokens": chunk_tokens}
    if sensitivity is not None:
        chunks_per_case = [kv[3 * i : 3 * i + 3] for i in range(len(cases))]
        probe_codec = StepZCodec(
            profile=StepProfile(k_steps=[probe] * L, v_steps=[probe] * L, k_bits=k_bits, base_bits=base_bits)
        )
        k_kl, v_kl = sensitivity(model, cases, chunks_per_case, probe_codec, probe)
        k_steps, v_steps = allocate_layer_steps(k_kl, v_kl, probe, target_kl, *STEP_RANGE)
        meta.update(k_kl=k_kl, v_kl=v_kl, probe=probe, target_kl=target_kl)
    meta.update(seconds=round(time.perf_counter() - t0, 1), created=time.time())
    return StepProfile(
        k_steps=[round(s, 4) for s in k_steps],
        v_steps=[round(s, 4) for s in v_steps],
        k_bits=k_bits,
        base_bits=base_bits,
        fingerprint=model.fingerprint,
        meta=meta,
    )


def ensure_profile(model, directory: Path | None = None, **options) -> StepProfile:
    """The model's stored profile, or a fresh calibration (saved, and used by this process's stores)."""
    p = load_profile(model.fingerprint, directory)
    if p is None:
        log.info(
            "stepz: calibrating the stored-KV steps of model %s (once per model)", model.fingerprint[:16]
        )
        p = calibrate(model, **options)
        try:
            save_profile(p, directory)
        except OSError as e:  # a read-only cache still gets this process's calibration
            log.warning("stepz: cannot save the calibration (%s); it is recomputed next time", e)
    register_profile(p)
    return p
