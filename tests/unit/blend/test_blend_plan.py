"""The request settings and the blend plan: a request's mode, ratio, schedule and fidelity parsed once
into a :class:`~ragkv.fidelity.plan.RequestSettings`, resolved once, by one rule
(:func:`ragkv.fidelity.plan.plan_blend`); a contradiction is an error, never a silent override."""

from __future__ import annotations

import dataclasses

import pytest

from ragkv.blend.core import BlendSchedule
from ragkv.blend.plan import AUTO, BlendPlan, BlendPlanError
from ragkv.blend.prefill import UnknownModeError
from ragkv.defaults import DEFAULT_MODE, DEFAULT_RATIO, MODES, Mode
from ragkv.fidelity.plan import Planner, RequestSettings, plan_blend

GRADUAL = BlendSchedule((1, 3), (0.3, 0.2), selector="kdev")
KDEV = BlendSchedule.single(0.3, selector="kdev")
R = RequestSettings


def plan(mode=None, ratio=None, schedule=None, owner: RequestSettings | None = None) -> BlendPlan:
    """The plan of a request's settings on no model (explicit settings only)."""
    return plan_blend(None, R(mode, ratio, schedule), owner)


def test_settings_are_parsed_once_into_canonical_values():
    s = R("blend", "0.25", fidelity="FAST")
    assert s.mode is Mode.BLEND and s.mode == "blend" and s.ratio == 0.25 and s.fidelity == "fast"
    assert R(ratio="auto").ratio == AUTO and R() == R(None, None, None, None, None)
    assert MODES == ("full", "prefix", "reuse", "blend") and DEFAULT_MODE in Mode  # one definition
    with pytest.raises(UnknownModeError):
        R("magic")
    with pytest.raises(ValueError, match="fidelity"):
        R(fidelity="often")
    with pytest.raises(BlendPlanError, match="BlendSchedule"):
        R(schedule="kdev")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.mode = "full"


def test_settings_over_defaults_and_loose_keywords_over_a_value():
    owner = R("reuse", 0.3, KDEV, "exact", "off")
    assert R(ratio=0.5).over(owner) == R("reuse", 0.5, KDEV, "exact", "off")
    assert R().over(owner) == owner and owner.over(R("full")) == owner
    assert R.parse(None, mode="full") == R("full")
    assert R.parse(owner, mode="full", ratio=None) == R("full", 0.3, KDEV, "exact", "off")


def test_a_request_cannot_set_the_owners_adapter():
    with pytest.raises(BlendPlanError, match="adapter"):
        plan_blend(None, R(adapter="off"))


def test_a_planner_fills_a_request_from_its_owner():
    p = Planner(None, R("blend", 0.2))
    assert p.plan().ratio == 0.2 and p.plan(R(ratio=0.4)).ratio == 0.4
    assert p.under(R("full")).plan().mode == "full"
    assert p.under(R(ratio=0.3)).plan(R("reuse")).mode == "reuse"


def test_explicit_settings_run_as_asked_outside_the_gate():
    p = plan("blend", 0.4)
    assert (p.mode, p.ratio, p.schedule) == ("blend", 0.4, None) and p.outside_gate
    assert p.blend_schedule() == BlendSchedule.single(0.4)
    assert p.prefill_args() == {"mode": "blend", "ratio": 0.4, "schedule": BlendSchedule.single(0.4)}
    assert plan("blend", "0.25").ratio == 0.25  # a ratio as text (a form, a CLI flag)
    full = plan("full", 0.4)
    assert (full.mode, full.ratio, full.blend_schedule()) == ("full", 0.0, None)


def test_defaults_fill_only_what_the_request_does_not_set():
    assert plan(owner=R("blend", 0.2)).ratio == 0.2
    assert plan("blend", 0.5, owner=R(ratio=0.2)).ratio == 0.5
    assert plan("reuse", owner=R("blend")).mode == "reuse"
    # a request's whole schedule carries its ratio: the owner's default ratio does not apply
    p = plan("blend", schedule=KDEV, owner=R(ratio=0.2))
    assert p.schedule == KDEV and p.ratio == 0.3
    assert BlendSchedule().target_ratio == DEFAULT_RATIO  # the one default


def test_a_ratio_beside_another_schedule_is_refused():
    with pytest.raises(BlendPlanError, match="contradicts"):
        plan("blend", 0.5, KDEV)
    assert plan("blend", 0.3, KDEV).schedule == KDEV  # the same ratio: no conflict
    with pytest.raises(BlendPlanError, match="contradicts"):
        BlendPlan("blend", 0.5, KDEV)
    with pytest.raises(BlendPlanError, match="mode 'blend'"):
        plan("reuse", None, KDEV)


def test_the_owners_schedule_gives_options_and_a_request_ratio_replaces_its_one_ratio():
    p = plan("blend", 0.5, owner=R(schedule=KDEV))
    assert p.schedule == BlendSchedule.single(0.5, selector="kdev")
    assert plan("blend", owner=R(schedule=KDEV)).schedule == KDEV  # its own ratio
    with pytest.raises(BlendPlanError, match="ratios"):  # gradual: a per-request ratio cannot replace them
        plan("blend", 0.5, owner=R(schedule=GRADUAL))
    assert plan("blend", owner=R(schedule=GRADUAL)).schedule == GRADUAL


def test_auto_is_chosen_before_prefill():
    p = plan("blend", AUTO)
    assert p.auto and p.outside_gate
    with pytest.raises(BlendPlanError, match="auto"):
        p.blend_schedule()
    assert p.with_ratio(0.2).blend_schedule() == BlendSchedule.single(0.2)
    assert plan("blend", AUTO, owner=R(schedule=KDEV)).with_ratio(0.2).schedule == BlendSchedule.single(
        0.2, selector="kdev"
    )


def test_an_owner_fills_a_callers_plan_with_its_blend_options():
    """``Planner.fill``: a plan resolved elsewhere gets the owner's schedule at the plan's own ratio
    (or as it is for ``auto``), keeps a schedule of its own, and is refused beside a gradual one."""
    owner = Planner(None, R(schedule=KDEV))
    assert owner.fill(BlendPlan("blend", 0.5)).schedule == BlendSchedule.single(0.5, selector="kdev")
    assert owner.fill(BlendPlan("blend", AUTO)).schedule == KDEV
    own = BlendPlan("blend", 0.2, BlendSchedule.single(0.2))
    assert owner.fill(own) is own and owner.fill(BlendPlan("reuse")) == BlendPlan("reuse")
    assert Planner(None).fill(BlendPlan("blend", 0.5)) == BlendPlan("blend", 0.5)
    with pytest.raises(BlendPlanError, match="ratios"):
        Planner(None, R(schedule=GRADUAL)).fill(BlendPlan("blend", 0.5))


def test_bad_ratios_are_refused():
    for bad in (1.5, -0.1, True, "lots"):
        with pytest.raises(BlendPlanError):
            plan("blend", bad)


def test_the_engine_refuses_a_ratio_its_gradual_schedule_cannot_take():
    """Bug: ``EngineConfig.schedule`` silently replaced a request's ratio; now a one-ratio config
    schedule runs at the request's ratio and a gradual one refuses it."""
    from ragkv.engine import Engine, EngineConfig
    from tests.helpers import stories_model

    model = stories_model()
    eng = Engine(model, EngineConfig(num_blocks=64, settings=R(schedule=KDEV)))
    req = eng.make_request([1, 5], [[6, 7, 8]], [9], mode="blend", ratio=0.5)
    assert req.plan.blend_schedule() == BlendSchedule.single(0.5, selector="kdev")
    assert eng.make_request([1, 5], [[6, 7, 8]], [9], mode="blend").plan.schedule == KDEV
    # a caller's plan (the RAG's) runs with the engine's blend options at the plan's ratio
    given = eng.make_request([1, 5], [[6, 7, 8]], [9], plan=BlendPlan("blend", 0.5)).plan
    assert given.blend_schedule() == BlendSchedule.single(0.5, selector="kdev")
    gradual = Engine(model, EngineConfig(num_blocks=64, settings=R(schedule=GRADUAL)))
    with pytest.raises(BlendPlanError):
        gradual.make_request([1, 5], [[6, 7, 8]], [9], mode="blend", ratio=0.5)
    with pytest.raises(BlendPlanError):
        gradual.make_request([1, 5], [[6, 7, 8]], [9], plan=BlendPlan("blend", 0.5))
    with pytest.raises(BlendPlanError, match="auto"):
        eng.make_request([1, 5], [[6, 7, 8]], [9], mode="blend", ratio=AUTO)
