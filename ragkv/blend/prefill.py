"""Prefill modes over a prompt assembled as ``[prefix] + [chunk_1..chunk_n] + [query suffix]``.

* ``full``: ordinary prefill of everything.
* ``prefix``: exact prefix caching; the longest cached leading run (prefix, chunk_1, ...) is reused
  and the rest computed, then the head is cached for next time.
* ``reuse``: full KV reuse (PromptCache-style): every chunk's stored KV, RoPE re-positioned; only
  uncached text and the suffix computed.
* ``blend``: CacheBlend: as ``reuse`` plus HKVD selective recompute per the blend schedule.
"""

from __future__ import annotations

from ragkv.blend.assemble import MODES, UnknownModeError, assemble
from ragkv.blend.core import BlendSchedule, PrefillResult
from ragkv.blend.gate import ensure_gate
from ragkv.defaults import DEFAULT_MODE, DEFAULT_RATIO, Mode

__all__ = ["MODES", "UnknownModeError", "prefill"]


def prefill(
    model, prefix_ids, chunks, suffix_ids, mode=DEFAULT_MODE, ratio=DEFAULT_RATIO, **options
) -> PrefillResult:
    """Prefill the assembled prompt in ``mode``; see the module docstring. The public primitive (a
    request's :class:`~ragkv.blend.plan.BlendPlan` passes its ``prefill_args()``): ``blend`` runs the
    ``schedule`` option, else the default schedule at ``ratio``.

    Before a model's first ``reuse`` or ``blend`` the blending gate runs (:func:`ragkv.blend.gate.ensure_gate`;
    a model that fails it prefills in full, with a warning). ``chunks`` and ``options`` (``schedule``,
    ``prefix_cache``, ``source_factory``, ``probe_suffix``...): :func:`ragkv.blend.assemble.assemble`.
    """
    if mode in (Mode.REUSE, Mode.BLEND) and model.blend_ok is None:
        ensure_gate(model)
    if mode == Mode.BLEND and options.get("schedule") is None:
        options["schedule"] = BlendSchedule.single(ratio)
    return assemble(model, prefix_ids, chunks, suffix_ids, mode, **options)
