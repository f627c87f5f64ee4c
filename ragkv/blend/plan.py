"""The blend plan: one value for what a request's prefill runs (mode, ratio or schedule, the gate's point).

Resolved once at the edge by :func:`ragkv.fidelity.plan.plan_blend` (the one rule, documented there)
and passed down whole (generators, the engine, the resolver's prefill) instead of a ``ratio`` beside
a ``schedule``. The default ratio is :data:`ragkv.defaults.DEFAULT_RATIO`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ragkv.blend.core import BlendSchedule
from ragkv.blend.prefill import MODES, UnknownModeError

#: the ratio value that asks the RAG's loading controller to choose (per prompt)
AUTO = "auto"


class BlendPlanError(ValueError):
    """A request's blend settings that contradict each other (e.g. a ratio beside another schedule)."""


@dataclass(frozen=True)
class BlendPlan:
    """What a request's prefill runs: ``mode``, the share of reused rows recomputed (``ratio``, or
    ``"auto"``), the blend options beyond the ratio (``schedule``, None: the default schedule at
    ``ratio``), and the fidelity gate's point it stands for (``point``, reported in the stats)."""

    mode: str
    ratio: float | str = 0.0
    schedule: BlendSchedule | None = None
    #: the fidelity gate's ``ragkv.fidelity.OperatingPoint`` (or an explicit one): ``stats["fidelity"]``
    point: object | None = None
    #: the KV adapter reused chunk KV is read through (``ragkv.adapter.KVAdapter``; None: none), set
    #: only where the gate chose the (model, adapter) pair's point or the caller asked for it
    adapter: object | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise UnknownModeError(f"unknown mode {self.mode!r}; use one of {MODES}")
        if self.ratio != AUTO:
            if isinstance(self.ratio, bool) or not isinstance(self.ratio, int | float):
                raise BlendPlanError(f"ratio must be a number in [0, 1] or 'auto', got {self.ratio!r}")
            if not 0.0 <= self.ratio <= 1.0:
                raise BlendPlanError(f"ratio must be in [0, 1], got {self.ratio}")
        if self.schedule is not None:
            if self.mode != "blend":
                raise BlendPlanError(f"a blend schedule needs mode 'blend', not {self.mode!r}")
            if self.ratio != AUTO and self.ratio != self.schedule.target_ratio:
                raise BlendPlanError(
                    f"ratio {self.ratio} contradicts the schedule's ratio {self.schedule.target_ratio}"
                )
        if self.adapter is not None and not self.reuses:
            object.__setattr__(self, "adapter", None)  # nothing stored is read: the adapter has no rows

    @property
    def auto(self) -> bool:
        """Whether the loading controller still has to choose the ratio."""
        return self.ratio == AUTO

    @property
    def reuses(self) -> bool:
        """Whether the mode reuses stored chunk KV (``reuse``, ``blend``)."""
        return self.mode in ("reuse", "blend")

    @property
    def outside_gate(self) -> bool:
        """Whether the caller set this plan explicitly (not the fidelity gate's choice)."""
        return self.point is None or self.point.outside_gate

    def blend_schedule(self) -> BlendSchedule | None:
        """The schedule the prefill runs (None outside ``blend``): the plan's, or the default at its ratio."""
        if self.mode != "blend":
            return None
        if self.auto:
            raise BlendPlanError("ratio 'auto' must be chosen (BlendPlan.with_ratio) before prefill")
        return self.schedule or BlendSchedule.single(float(self.ratio))

    def with_ratio(self, ratio: float) -> BlendPlan:
        """This plan at ``ratio`` (the loading controller's choice for ``"auto"``)."""
        sched = rebase(self.schedule, float(ratio)) if self.schedule is not None else None
        return dataclasses.replace(self, ratio=float(ratio), schedule=sched)

    def prefill_args(self) -> dict:
        """``mode``, ``ratio`` and ``schedule`` as :func:`ragkv.blend.prefill` takes them."""
        sched = self.blend_schedule()
        args = {"mode": self.mode, "ratio": sched.target_ratio if sched else 0.0, "schedule": sched}
        if self.adapter is not None:
            args["adapter"] = self.adapter
        return args

    def stats(self) -> dict | None:
        """The ``fidelity`` entry of a response's stats (None without a point)."""
        return self.point.as_stats() if self.point is not None else None


def rebase(schedule: BlendSchedule, ratio: float) -> BlendSchedule:
    """``schedule`` at ``ratio``: its one ratio replaced (:class:`BlendPlanError` for a gradual one,
    unless ``ratio`` is already its target)."""
    if schedule.target_ratio == ratio:
        return schedule
    if len(schedule.ratios) != 1:
        raise BlendPlanError(
            f"the blend schedule has ratios {schedule.ratios}; a per-request ratio cannot replace them "
            "(send no ratio, or a whole schedule)"
        )
    return dataclasses.replace(schedule, ratios=(float(ratio),))
