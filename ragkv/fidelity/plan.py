"""One request's settings and the blend plan they resolve to, by one rule (:func:`plan_blend`).

A request says how much to blend in up to three ways: a prefill ``mode``, a recompute ``ratio`` (or a
whole :class:`~ragkv.blend.core.BlendSchedule`), and a ``fidelity`` target for the gate
(:mod:`ragkv.fidelity.choose`). Every surface (the Python API's keywords, the service's schemas and
settings, the CLIs, the framework options) parses them once into a frozen :class:`RequestSettings`;
its owner (an ``LLM``, a ``RAG``, an ``Engine``) holds one too, of defaults, with its KV ``adapter``.
A :class:`Planner` (the owner's model, settings and resolved adapter) turns a request's settings into
one :class:`BlendPlan` (:func:`plan_blend`, called nowhere else), and everything below (generators,
the engine, the resolver's prefill) takes the plan instead of a ``ratio`` beside a ``schedule``:

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
from dataclasses import dataclass

from ragkv.blend.core import BlendSchedule
from ragkv.blend.plan import AUTO, BlendPlan, BlendPlanError, rebase
from ragkv.blend.prefill import UnknownModeError
from ragkv.blend.source import ChunkKVAdapter
from ragkv.defaults import DEFAULT_MODE, MODES, Mode
from ragkv.fidelity.choose import GATE, explicit_point, operating_point, parse_fidelity

__all__ = ["AUTO", "BlendPlan", "BlendPlanError", "Planner", "RequestSettings", "plan_blend"]


def _ratio(value: float | str | None) -> float | str | None:
    """A ratio as given on any surface: None, ``"auto"``, or a number in [0, 1] (also as text)."""
    if value is None or value == AUTO:
        return value
    if isinstance(value, bool):
        raise BlendPlanError(f"ratio must be a number in [0, 1] or 'auto', got {value!r}")
    try:
        ratio = float(value)
    except (TypeError, ValueError):
        raise BlendPlanError(f"ratio must be a number in [0, 1] or 'auto', got {value!r}") from None
    if not 0.0 <= ratio <= 1.0:
        raise BlendPlanError(f"ratio must be in [0, 1], got {ratio}")
    return ratio


@dataclass(frozen=True)
class RequestSettings:
    """What one request (or, as defaults, its owner) asks of the prefill; parsed once at the edge.

    Every field is optional: None is "not set" (the owner's setting, then :mod:`ragkv.defaults`).
    ``mode``: a :class:`~ragkv.defaults.Mode` (or its name); ``ratio``: the share of reused rows
    recomputed, in [0, 1], or ``"auto"`` (the RAG's loading controller chooses); ``schedule``: the
    blend options beyond a ratio (:class:`~ragkv.blend.core.BlendSchedule`); ``fidelity``: where
    ``blend`` without a ratio runs (:func:`ragkv.fidelity.choose.parse_fidelity`'s canonical form);
    ``adapter``: an owner's KV adapter setting (``"auto"``, ``"off"``, a file or an adapter; read
    when the owner is built, :func:`ragkv.adapter.shipped.resolve_adapter`, never per request).
    Bad values raise ``ValueError`` (:class:`UnknownModeError`, :class:`BlendPlanError`).
    """

    mode: Mode | None = None
    ratio: float | str | None = None
    schedule: BlendSchedule | None = None
    fidelity: str | None = None
    adapter: object | None = None

    def __post_init__(self):
        if self.mode is not None:
            if self.mode not in MODES:
                raise UnknownModeError(f"unknown mode {self.mode!r}; use one of {MODES}")
            object.__setattr__(self, "mode", Mode(self.mode))
        object.__setattr__(self, "ratio", _ratio(self.ratio))
        if self.schedule is not None and not isinstance(self.schedule, BlendSchedule):
            raise BlendPlanError(f"schedule must be a BlendSchedule, got {type(self.schedule).__name__}")
        if self.fidelity is not None:
            object.__setattr__(self, "fidelity", parse_fidelity(self.fidelity))

    @classmethod
    def parse(cls, settings: RequestSettings | None = None, **loose) -> RequestSettings:
        """A public call's loose keywords (``mode=``, ``ratio=``...) parsed over its ``settings``
        value (either may be absent): the one parse of an edge that takes both."""
        mine = cls(**loose)
        return mine if settings is None else mine.over(settings)

    def over(self, defaults: RequestSettings) -> RequestSettings:
        """These settings with what they leave unset taken from ``defaults`` (a RAG's over its LLM's)."""
        return RequestSettings(
            *(
                mine if mine is not None else getattr(defaults, f.name)
                for f in dataclasses.fields(self)
                for mine in (getattr(self, f.name),)
            )
        )

    def changed(self, **fields) -> RequestSettings:
        """These settings with ``fields`` replaced (parsed again)."""
        return dataclasses.replace(self, **fields)


def plan_blend(
    model,
    request: RequestSettings,
    owner: RequestSettings | None = None,
    adapter: ChunkKVAdapter | None = None,
    adapter_outside_gate: bool = False,
) -> BlendPlan:
    """The one resolution of a request's settings into a :class:`BlendPlan` (called by :class:`Planner`).

    ``request``: the request's settings (None fields: not set); ``owner``: its owner's defaults
    (``mode`` unset: :data:`~ragkv.defaults.DEFAULT_MODE`; ``fidelity`` unset: the gate's default
    setting; ``schedule``: the owner's blend options); ``adapter``: the owner's resolved KV adapter
    (rule 6). The rule is the module docstring's."""
    owner = owner or RequestSettings()
    if request.adapter is not None:
        raise BlendPlanError("the KV adapter is its owner's setting (it names the chunk KV), not a request's")
    plan = _plan(model, request, owner, adapter)
    if (
        adapter is not None
        and plan.adapter is None
        and (adapter.writes_kv or (plan.outside_gate and adapter_outside_gate))
    ):
        plan = dataclasses.replace(plan, adapter=adapter)  # a writer's KV is the only stored KV there is
    return plan


def _plan(model, request: RequestSettings, owner: RequestSettings, adapter) -> BlendPlan:
    """:func:`plan_blend` without the adapter of explicit plans."""
    mode = str(request.mode or owner.mode or DEFAULT_MODE)
    ratio, schedule, owner_schedule = request.ratio, request.schedule, owner.schedule
    if schedule is not None:
        if ratio not in (None, AUTO) and ratio != schedule.target_ratio:
            raise BlendPlanError(
                f"ratio {ratio} contradicts the blend schedule's ratio {schedule.target_ratio}; send one"
            )
        if mode != Mode.BLEND:
            raise BlendPlanError(f"a blend schedule needs mode 'blend', not {mode!r}")
        return BlendPlan(mode, schedule.target_ratio, schedule, explicit_point(mode, schedule.target_ratio))
    if ratio is None:
        ratio = owner.ratio
    if mode != Mode.BLEND:
        return BlendPlan(mode, 0.0, None, explicit_point(mode, ratio if ratio != AUTO else None))
    if ratio == AUTO:
        return BlendPlan(mode, AUTO, owner_schedule, explicit_point(mode, None))
    if ratio is not None:
        sched = rebase(owner_schedule, ratio) if owner_schedule is not None else None
        return BlendPlan(mode, ratio, sched, explicit_point(mode, ratio))
    if owner_schedule is not None:  # the owner's own schedule: its ratios are theirs
        r = owner_schedule.target_ratio
        return BlendPlan(mode, r, owner_schedule, explicit_point(mode, r))
    fidelity = request.fidelity or owner.fidelity
    op = operating_point(model, fidelity)
    use = None
    if adapter is not None:
        with_adapter = operating_point(model, fidelity, adapter=adapter.identity)
        # a chunk-KV writer's KV is all that is stored: the pair's report alone says where to run
        if adapter.writes_kv or GATE.adapter_wins(model.name, op, with_adapter, adapter.identity):
            op, use = with_adapter, adapter
    if op.mode == Mode.BLEND:
        return BlendPlan(Mode.BLEND.value, float(op.ratio), None, op, use)
    return BlendPlan(op.mode, 0.0, None, op, use)


@dataclass(frozen=True)
class Planner:
    """An owner's planning of its requests: its model, its settings (every request's defaults) and
    its resolved KV adapter (``adapter_explicit``: asked for, so used outside the gate too)."""

    model: object
    settings: RequestSettings = RequestSettings()
    adapter: ChunkKVAdapter | None = None
    adapter_explicit: bool = False

    def plan(self, request: RequestSettings | None = None) -> BlendPlan:
        """``request``'s :class:`BlendPlan`, this owner's settings filling what it does not set."""
        return plan_blend(
            self.model, request or RequestSettings(), self.settings, self.adapter, self.adapter_explicit
        )

    def fill(self, plan: BlendPlan) -> BlendPlan:
        """A plan resolved elsewhere (a caller's) with this owner's blend schedule where a blend has
        none of its own, at the plan's ratio (:class:`BlendPlanError` for a gradual schedule beside
        a ratio, as in :func:`plan_blend`); any other plan as it is."""
        owner = self.settings.schedule
        if plan.mode != Mode.BLEND or plan.schedule is not None or owner is None:
            return plan
        sched = owner if plan.auto else rebase(owner, float(plan.ratio))
        return dataclasses.replace(plan, schedule=sched)

    def under(self, defaults: RequestSettings) -> Planner:
        """This planner with ``defaults`` over its settings (a RAG's mode and ratio over its LLM's)."""
        return dataclasses.replace(self, settings=defaults.over(self.settings))
