"""Per-model calibration of RoPE-aware key bits, measured once and kept by model fingerprint.

Block-GTQ's observation: under RoPE a key's contribution to a logit splits into 2-D frequency
blocks (channels ``j`` and ``j + D/2``) whose energies differ by orders of magnitude, so bits spent
on a block pay off in proportion to its energy. :func:`rope_block_energy` measures that energy per
(layer, KV head, block) on chunks of the demo corpus shipped with ragkv (never evaluation data);
the ``stepz`` stored-KV codec allocates its key steps from it, HACK its key bits
(:func:`hack_key_plans`). :func:`ensure_rope_energy` keeps it in
``$RAGKV_CACHE_DIR/calibration/<fingerprint>.json`` (a missing, corrupt or foreign file is
recomputed: a few chunk forwards).
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import numpy as np
import torch

from ragkv.attention.hack_paged import paged_key_widths
from ragkv.attention.hack_quant import KeyPlan
from ragkv.model.forward import compute_chunk_kv
from ragkv.model.gguf import fingerprint_file, write_json_atomic

log = logging.getLogger("ragkv.kv")

DEMO_CORPUS = Path(__file__).resolve().parents[1] / "demo" / "corpus.json"
ENERGY_VERSION = 1
_ENERGY: dict[str, np.ndarray] = {}
_LOCK = threading.Lock()
_CAPTURE_LOCK = threading.Lock()


def allocate_block_bits(
    energy: np.ndarray, base_bits: int, min_bits: int | None = None, max_bits: int | None = None
) -> np.ndarray:
    """Integer bits per frequency block, greedily by marginal gain, ``sum == base_bits * n`` per row.

    ``energy[..., j]``: how much a unit quantization error in block ``j`` moves the logits. At ``b``
    bits a block's error energy is ``energy * 4**-b`` (uniform quantizer: one more bit halves the
    step), so one more bit gains ``0.75 * energy * 4**-b``; starting from ``min_bits`` everywhere,
    each remaining bit of the budget goes to the block with the largest gain (ties: lowest index).
    ``min_bits`` / ``max_bits`` (default ``base_bits -/+ 3``) bound the spread so a block that
    looked idle in calibration is never reduced to noise, and one that looked dominant does not
    take the budget.
    """
    e = np.asarray(energy, dtype=np.float64)
    lo = base_bits - 3 if min_bits is None else int(min_bits)
    hi = base_bits + 3 if max_bits is None else int(max_bits)
    if not lo <= base_bits <= hi:
        raise ValueError(f"need min_bits <= base_bits <= max_bits, got {lo}, {base_bits}, {hi}")
    flat = e.reshape(-1, e.shape[-1])
    n = flat.shape[1]
    out = np.full(flat.shape, lo, dtype=np.int64)
    budget = (base_bits - lo) * n
    for r in range(flat.shape[0]):
        gain = 0.75 * np.maximum(flat[r], 0.0) * 4.0 ** (-lo)
        for _ in range(budget):
            gain_masked = np.where(out[r] < hi, gain, -1.0)
            j = int(np.argmax(gain_masked))
            out[r, j] += 1
            gain[j] /= 4.0
    return out.reshape(e.shape)


def demo_chunks(model, n_chunks: int = 6, chunk_tokens: int = 128) -> list[list[int]]:
    """Token ids of the first ``n_chunks`` demo-corpus documents, cut to ``chunk_tokens`` (a model
    without a tokenizer, e.g. ``random_model``'s, gets seeded random ids: there is no text to read)."""
    if model.tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, model.config.vocab_size, (n_chunks, chunk_tokens), generator=g).tolist()
    docs = [d["text"] for d in json.loads(DEMO_CORPUS.read_text())["documents"]]
    return [model.encode(docs[i % len(docs)])[:chunk_tokens] for i in range(n_chunks)]


@torch.inference_mode()
def rope_block_energy(model, chunk_ids: list[list[int]]) -> tuple[np.ndarray, list]:
    """``[L, Hkv, D/2]`` energy per RoPE block, and the chunks' KV (reused by stepz's probes).

    A block's energy is ``E|q_j|^2 * Var(k_j)``: the mean squared norm of the block in the queries
    of the heads sharing the KV head, times the block's key variance over the chunks' tokens (a
    quantizer's error in a channel scales with its spread, and a key error enters a logit through
    ``q_j . R(theta_j) dk_j``, whose size the rotation does not change). Deviation from the paper:
    its score is label-free on keys; the queries weight it here because their block energies differ
    by orders of magnitude (a high-energy key block that no query reads costs nothing to coarsen).
    """
    c = model.config
    L, H, D, Hq = c.num_layers, c.num_kv_heads, c.head_dim, c.num_heads
    half = D // 2
    q_energy = np.zeros((L, Hq, D), dtype=np.float64)
    rows = 0
    orig = model.qkv

    def capture(layer, h):
        q, k, v = orig(layer, h)
        q_energy[layer] += (q.double() ** 2).sum(0).cpu().numpy()
        return q, k, v

    chunks = []
    with _CAPTURE_LOCK:  # one capture at a time: a second one's ``del`` would drop the first's
        model.qkv = capture  # instance attribute: only this calibration forward is observed
        try:
            for ids in chunk_ids:
                chunks.append(compute_chunk_kv(model, ids))
                rows += len(ids) + 1
        finally:
            del model.qkv
    q_energy /= max(rows, 1)
    qb = q_energy[..., :half] + q_energy[..., half:]  # [L, Hq, D/2]
    qb = qb.reshape(L, H, Hq // H, half).mean(2)  # the query heads sharing each KV head
    kvar = np.zeros((L, H, D), dtype=np.float64)
    for ch in chunks:
        kvar += ch.k.double().var(dim=1).cpu().numpy()
    kvar /= len(chunks)
    kb = kvar[..., :half] + kvar[..., half:]
    return qb * kb, chunks


def energy_path(fingerprint: str, directory: Path | None = None) -> Path:
    """Where a model's block energies live: ``directory``, default ``$RAGKV_CACHE_DIR/calibration``."""
    return fingerprint_file("calibration", fingerprint, directory)


def _load_energy(model, path: Path) -> np.ndarray | None:
    """The stored energies of ``model``; None (logged) when missing, corrupt, foreign or misshapen."""
    c = model.config
    try:
        doc = json.loads(path.read_text())
        if doc.get("fingerprint") != model.fingerprint or doc.get("version") != ENERGY_VERSION:
            raise ValueError("another model or version")
        e = np.asarray(doc["energy"], dtype=np.float64)
        if e.shape != (c.num_layers, c.num_kv_heads, c.head_dim // 2) or not np.isfinite(e).all():
            raise ValueError(f"shape {e.shape} or non-finite values")
        return e
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("calibration %s is unusable (%s); it will be recomputed", path, e)
        return None


def ensure_rope_energy(model, directory: Path | None = None) -> np.ndarray:
    """The model's RoPE block energies: this process's, else the stored ones, else measured and saved."""
    with _LOCK:
        e = _ENERGY.get(model.fingerprint)
        if e is not None:
            return e
        path = energy_path(model.fingerprint, directory)
        e = _load_energy(model, path)
        if e is None:
            log.info("calibrating the RoPE key-block energies of model %s (once)", model.fingerprint[:16])
            e, _ = rope_block_energy(model, demo_chunks(model))
            doc = {"version": ENERGY_VERSION, "fingerprint": model.fingerprint, "energy": e.tolist()}
            try:
                write_json_atomic(path, doc)
            except OSError as err:  # a read-only cache still gets this process's calibration
                log.warning("cannot save the calibration (%s); it is recomputed next time", err)
        _ENERGY[model.fingerprint] = e
        return e


def hack_key_plans(
    model,
    k_bits: int,
    k_part: int,
    energy: np.ndarray | None = None,
    widths: tuple[int, ...] | None = None,
) -> list[KeyPlan]:
    """One :class:`~ragkv.attention.hack_quant.KeyPlan` per layer for HACK keys of ``k_bits`` on average.

    Per KV head, RoPE blocks are ordered by energy (highest first) and grouped into partitions of
    ``k_part`` channels; a layer's partition widths come from :func:`allocate_block_bits` over the
    partitions' energies summed across its KV heads (one layout per layer), within 2..4 bits, or
    are ``widths`` for every layer (paged pools share pages across layers). On the real default
    model at 3 bits in two partitions this gives 4 + 2 bits on 88 of 90 heads' own allocations
    (docs/HACK.md).
    """
    e = ensure_rope_energy(model) if energy is None else np.asarray(energy, dtype=np.float64)
    L, H, half = e.shape
    if k_part % 2 or (2 * half) % k_part:
        raise ValueError(f"K partition {k_part} does not split head_dim {2 * half} into RoPE block pairs")
    per = k_part // 2  # blocks per partition
    lo, hi = (2, 4) if k_bits <= 4 else (k_bits, k_bits)  # widths the packers support: 2, 3, 4 (8)
    plans = []
    for layer in range(L):
        order = np.argsort(-e[layer], axis=1, kind="stable")  # [H, D/2] blocks, highest energy first
        ranked = np.take_along_axis(e[layer], order, axis=1).reshape(H, -1, per).sum(-1)  # [H, parts]
        bits = widths or allocate_block_bits(ranked.sum(0), k_bits, min_bits=lo, max_bits=hi)
        channels = np.concatenate(
            [np.concatenate([g, g + half], axis=1) for g in np.split(order, order.shape[1] // per, axis=1)],
            axis=1,
        )  # each partition: its blocks' first channels, then their RoPE partners
        plans.append(KeyPlan(torch.from_numpy(channels).long(), tuple(int(b) for b in bits)))
    return plans


def key_plans_for(model, cfg, paged: bool = False) -> list[KeyPlan] | None:
    """The key plans a HACK cache of ``cfg`` (a ``HackConfig``) needs on ``model``: None unless
    ``cfg.k_plan == "rope"``. ``paged``: one set of byte-aligned widths for every layer, since a page
    pool's pages are shared by all layers."""
    if cfg.k_plan != "rope":
        return None
    kp = cfg.k_part(model.config.head_dim)
    widths = paged_key_widths(cfg.key_bits, model.config.head_dim // kp) if paged else None
    return hack_key_plans(model, cfg.key_bits, kp, widths=widths)
