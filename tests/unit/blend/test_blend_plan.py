"""The blend plan: a request's mode, ratio, schedule and fidelity resolved once, by one rule
(:func:`ragkv.fidelity.plan.plan_blend`); a contradiction is an error, never a silent override."""

from __future__ import annotations

import pytest

from ragkv.blend.core import BlendSchedule
from ragkv.blend.plan import AUTO, BlendPlan, BlendPlanError
from ragkv.defaults import DEFAULT_RATIO
from ragkv.fidelity.plan import plan_blend

GRADUAL = BlendSchedule((1, 3), (0.3, 0.2), selector="kdev")
KDEV = BlendSchedule.single(0.3, selector="kdev")


def test_explicit_settings_run_as_asked_outside_the_gate():
    p = plan_blend(None, "blend", 0.4)
    assert (p.mode, p.ratio, p.schedule) == ("blend", 0.4, None) and p.outside_gate
    assert p.blend_schedule() == BlendSchedule.single(0.4)
    assert p.prefill_args() == {"mode": "blend", "ratio": 0.4, "schedule": BlendSchedule.single(0.4)}
    assert plan_blend(None, "blend", "0.25").ratio == 0.25  # a ratio as text (a form, a CLI flag)
    full = plan_blend(None, "full", 0.4)
    assert (full.mode, full.ratio, full.blend_schedule()) == ("full", 0.0, None)


def test_defaults_fill_only_what_the_request_does_not_set():
    assert plan_blend(None, None, None, default_mode="blend", default_ratio=0.2).ratio == 0.2
    assert plan_blend(None, "blend", 0.5, default_ratio=0.2).ratio == 0.5
    assert plan_blend(None, "reuse", None, default_mode="blend").mode == "reuse"
    # a request's whole schedule carries its ratio: the owner's default ratio does not apply
    p = plan_blend(None, "blend", None, schedule=KDEV)
    assert p.schedule == KDEV and p.ratio == 0.3
    assert BlendSchedule().target_ratio == DEFAULT_RATIO  # the one default


def test_a_ratio_beside_another_schedule_is_refused():
    with pytest.raises(BlendPlanError, match="contradicts"):
        plan_blend(None, "blend", 0.5, schedule=KDEV)
    assert plan_blend(None, "blend", 0.3, schedule=KDEV).schedule == KDEV  # the same ratio: no conflict
    with pytest.raises(BlendPlanError, match="contradicts"):
        BlendPlan("blend", 0.5, KDEV)
    with pytest.raises(BlendPlanError, match="mode 'blend'"):
        plan_blend(None, "reuse", None, schedule=KDEV)


def test_the_owners_schedule_gives_options_and_a_request_ratio_replaces_its_one_ratio():
    p = plan_blend(None, "blend", 0.5, owner_schedule=KDEV)
    assert p.schedule == BlendSchedule.single(0.5, selector="kdev")
    assert plan_blend(None, "blend", None, owner_schedule=KDEV).schedule == KDEV  # its own ratio
    with pytest.raises(BlendPlanError, match="ratios"):  # gradual: a per-request ratio cannot replace them
        plan_blend(None, "blend", 0.5, owner_schedule=GRADUAL)
    assert plan_blend(None, "blend", None, owner_schedule=GRADUAL).schedule == GRADUAL


def test_auto_is_chosen_before_prefill():
    p = plan_blend(None, "blend", AUTO)
    assert p.auto and p.outside_gate
    with pytest.raises(BlendPlanError, match="auto"):
        p.blend_schedule()
    assert p.with_ratio(0.2).blend_schedule() == BlendSchedule.single(0.2)
    assert plan_blend(None, "blend", AUTO, owner_schedule=KDEV).with_ratio(
        0.2
    ).schedule == BlendSchedule.single(0.2, selector="kdev")


def test_bad_ratios_are_refused():
    for bad in (1.5, -0.1, True, "lots"):
        with pytest.raises(BlendPlanError):
            plan_blend(None, "blend", bad)


def test_the_engine_refuses_a_ratio_its_gradual_schedule_cannot_take():
    """Bug: ``EngineConfig.schedule`` silently replaced a request's ratio; now a one-ratio config
    schedule runs at the request's ratio and a gradual one refuses it."""
    from ragkv.engine import Engine, EngineConfig
    from tests.helpers import stories_model

    model = stories_model()
    eng = Engine(model, EngineConfig(num_blocks=64, schedule=KDEV))
    req = eng.make_request([1, 5], [[6, 7, 8]], [9], mode="blend", ratio=0.5)
    assert req.plan.blend_schedule() == BlendSchedule.single(0.5, selector="kdev")
    assert eng.make_request([1, 5], [[6, 7, 8]], [9], mode="blend").plan.schedule == KDEV
    gradual = Engine(model, EngineConfig(num_blocks=64, schedule=GRADUAL))
    with pytest.raises(BlendPlanError):
        gradual.make_request([1, 5], [[6, 7, 8]], [9], mode="blend", ratio=0.5)
    with pytest.raises(BlendPlanError, match="auto"):
        eng.make_request([1, 5], [[6, 7, 8]], [9], mode="blend", ratio=AUTO)
