"""The blend plan: what one request's prefill runs, resolved once at the edge by :func:`plan_blend`.

A request says how much to blend in up to three ways: a prefill ``mode``, a recompute ``ratio`` (or a
whole :class:`~ragkv.blend.core.BlendSchedule`), and a ``fidelity`` target for the gate
(:mod:`ragkv.fidelity.choose`). Its owner (an ``LLM``, a ``RAG``, an ``Engine``) may have defaults for
each, and its own schedule (the blend options beyond a ratio). :func:`plan_blend` turns all of that
into one :class:`BlendPlan` by one rule, and everything below (generators, the engine, the resolver's
prefill) takes the plan instead of a ``ratio`` beside a ``schedule``:

1. The request's own values win over the owner's defaults; a default fills only what is not set.
2. ``blend`` with neither a ratio nor a schedule (the request's or the owner's) runs at the
   fidelity gate's operating point (which may be ``reuse`` or exact ``prefix`` prefill).
3. A ratio with a schedule: the ratio replaces a one-ratio schedule's ratio (the schedule gives the
   other options); a request schedule whose ratio differs from the request's ratio, or an owner's
   gradual schedule (several ratios) with a per-request ratio, is a :class:`BlendPlanError`, never a
   silent override.
4. ``"auto"``: the ratio is the RAG's loading controller's choice, made when the prompt is known
   (:meth:`BlendPlan.with_ratio`).
5. Anything explicit runs as asked and is reported as outside the gate (``point.outside_gate``).
6. A KV adapter (``adapter``): at the gate's point, the (model, adapter) pair's report is asked too,
   and the adapter is used only where that report's point meets the target at less charged compute
   than the model's own choice (``fast``: with more answers kept); else it is off, said once in the
   log. Outside the gate it is used only when the caller asked for it (``adapter_outside_gate``).
   A chunk-KV writer is never off: the KV stored is the one it wrote, so the gate's point is the
   (model, writer) pair's (exact prefill without a report) and every plan that reuses reads through it.

The default ratio (:data:`ragkv.defaults.DEFAULT_RATIO`) is the one of the default schedule.
"""

from __future__ import annotations

import dataclasses

from ragkv.blend.core import BlendSchedule
from ragkv.blend.plan import AUTO, BlendPlan, BlendPlanError, rebase
from ragkv.blend.prefill import MODES, UnknownModeError
from ragkv.blend.source import ChunkKVAdapter
from ragkv.fidelity.choose import GATE, explicit_point, operating_point

__all__ = ["AUTO", "BlendPlan", "BlendPlanError", "plan_blend"]


def _ratio(value: float | str | None) -> float | str | None:
    """A ratio as given on any surface: None, ``"auto"``, or a number (also as text)."""
    if value is None or value == AUTO:
        return value
    if isinstance(value, bool):
        raise BlendPlanError(f"ratio must be a number in [0, 1] or 'auto', got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise BlendPlanError(f"ratio must be a number in [0, 1] or 'auto', got {value!r}") from None


def plan_blend(
    model,
    mode: str | None = None,
    ratio: float | str | None = None,
    *,
    schedule: BlendSchedule | None = None,
    fidelity: str | float | None = None,
    default_mode: str = "blend",
    default_ratio: float | str | None = None,
    owner_schedule: BlendSchedule | None = None,
    adapter: ChunkKVAdapter | None = None,
    adapter_outside_gate: bool = False,
) -> BlendPlan:
    """The one resolution of a request's (mode, ratio, schedule, fidelity) into a :class:`BlendPlan`.

    ``mode``/``ratio``/``schedule``/``fidelity``: the request's (None: not set); ``default_mode``,
    ``default_ratio``, ``owner_schedule``: its owner's defaults (``fidelity`` None: the gate's default
    setting, ``"floor"``); ``adapter``: the owner's KV adapter (rule 6). The rule is the module docstring's."""
    plan = _plan(model, mode, ratio, schedule, fidelity, default_mode, default_ratio, owner_schedule, adapter)
    if (
        adapter is not None
        and plan.adapter is None
        and (adapter.writes_kv or (plan.outside_gate and adapter_outside_gate))
    ):
        plan = dataclasses.replace(plan, adapter=adapter)  # a writer's KV is the only stored KV there is
    return plan


def _plan(
    model, mode, ratio, schedule, fidelity, default_mode, default_ratio, owner_schedule, adapter
) -> BlendPlan:
    """:func:`plan_blend` without the adapter of explicit plans."""
    mode = mode or default_mode
    if mode not in MODES:
        raise UnknownModeError(f"unknown mode {mode!r}; use one of {MODES}")
    ratio = _ratio(ratio)
    if schedule is not None:
        if ratio not in (None, AUTO) and ratio != schedule.target_ratio:
            raise BlendPlanError(
                f"ratio {ratio} contradicts the blend schedule's ratio {schedule.target_ratio}; send one"
            )
        if mode != "blend":
            raise BlendPlanError(f"a blend schedule needs mode 'blend', not {mode!r}")
        return BlendPlan(mode, schedule.target_ratio, schedule, explicit_point(mode, schedule.target_ratio))
    if ratio is None:
        ratio = _ratio(default_ratio)
    if mode != "blend":
        return BlendPlan(mode, 0.0, None, explicit_point(mode, ratio if ratio != AUTO else None))
    if ratio == AUTO:
        return BlendPlan(mode, AUTO, owner_schedule, explicit_point(mode, None))
    if ratio is not None:
        sched = rebase(owner_schedule, ratio) if owner_schedule is not None else None
        return BlendPlan(mode, ratio, sched, explicit_point(mode, ratio))
    if owner_schedule is not None:  # the owner's own schedule: its ratios are theirs
        r = owner_schedule.target_ratio
        return BlendPlan(mode, r, owner_schedule, explicit_point(mode, r))
    op = operating_point(model, fidelity)
    use = None
    if adapter is not None:
        with_adapter = operating_point(model, fidelity, adapter=adapter.identity)
        # a chunk-KV writer's KV is all that is stored: the pair's report alone says where to run
        if adapter.writes_kv or GATE.adapter_wins(model.name, op, with_adapter, adapter.identity):
            op, use = with_adapter, adapter
    if op.mode == "blend":
        return BlendPlan("blend", float(op.ratio), None, op, use)
    return BlendPlan(op.mode, 0.0, None, op, use)
