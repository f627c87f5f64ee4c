"""``kv_transfer_params["ragkv"]`` has one owner (ragkv/remote/wire.py): parse/serialize round
trip, the bounds on every list and string, and both receivers (the vLLM connector, the service's
``/v1/completions``) parsing with it."""

from __future__ import annotations

import ast
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ragkv.blend import BlendSchedule
from ragkv.blend.spans import ChunkRef
from ragkv.remote.wire import MAX_CHECK_LAYERS, MAX_CHUNKS, BlendParams, KVParamsError
from ragkv.store.base import check_key
from tests.helpers import REPO

KEY = st.text("0123456789abcdefABCDEF_.:-", min_size=1, max_size=200).filter(lambda k: not k.startswith("."))
CHUNK = st.builds(ChunkRef, KEY) | st.builds(ChunkRef, KEY, st.integers(0, 10**6), st.integers(1, 10**6))
LAYERS = st.lists(st.integers(0, 200), max_size=8, unique=True).map(lambda xs: tuple(sorted(xs)) or (1,))


@given(
    chunks=st.lists(CHUNK, max_size=20).map(tuple),
    mode=st.sampled_from(["blend", "reuse"]),
    ratio=st.floats(0.0, 1.0),
    layers=LAYERS,
    deviation=st.sampled_from(["k", "v", "kv"]),
    save=st.booleans(),
    fresh=st.booleans(),
)
def test_round_trip_through_json(chunks, mode, ratio, layers, deviation, save, fresh):
    p = BlendParams(chunks, mode, ratio, layers, deviation, save, fresh)
    wire = json.loads(json.dumps(p.to_kv_transfer_params()))
    assert BlendParams.from_kv_transfer_params(wire) == p
    assert BlendParams.from_kv_transfer_params(wire, save_default=not save) == p  # an explicit save wins


@pytest.mark.parametrize(
    "body, why",
    [
        ({"chunks": ["k"] * (MAX_CHUNKS + 1)}, "at most"),
        ({"chunks": [], "check_layers": list(range(MAX_CHECK_LAYERS + 1))}, "check_layers"),
        ({"chunks": ["a" * 201]}, "invalid chunk key"),
        ({"chunks": ["k\n"]}, "invalid chunk key"),  # `$` would let a trailing newline through
        ({"chunks": [".hidden"]}, "invalid chunk key"),
        ({"chunks": [{"key": "k", "start": 0}]}, "both"),
        ({"chunks": [], "mode": "reuse", "deviation": "q"}, "deviation"),  # checked in every mode
        ({"chunks": [], "mode": "reuse", "check_layers": [2, 1]}, "schedule"),
        ({"chunks": [], "ratio": float("nan")}, "ratio"),
        ({"chunks": [], "ratio": True}, "ratio"),
        ({"chunks": [], "turbo": 1}, "unknown"),
        ("not a dict", "must be a dict"),
    ],
)
def test_bounds_and_types_refused_with_the_reason(body, why):
    with pytest.raises(KVParamsError, match=why):
        BlendParams.from_kv_transfer_params({"ragkv": body})


def test_the_store_and_the_wire_share_one_key_rule():
    for bad in ("k\n", ".k", "a/b", "", "a" * 201):
        with pytest.raises(ValueError):
            check_key(bad)
    assert check_key("ab:c-1.2_3") == "ab:c-1.2_3"


def test_schedules_by_receiver():
    """The vLLM hook (no question pass) selects at the check layers; in process the defaults are the
    library's default schedule, so a served answer equals a local one."""
    p = BlendParams((), ratio=0.3)
    assert p.schedule() == BlendSchedule((1,), (0.3,), selector="kdev")
    assert p.schedule(question_pass=True) == BlendSchedule.single(0.3)
    q = BlendParams((), ratio=0.3, check_layers=(1, 3), deviation="v")
    assert (
        q.schedule(question_pass=True)
        == q.schedule()
        == BlendSchedule((1, 3), (0.3, 0.3), "v", selector="kdev")
    )
    assert BlendParams((), mode="reuse").schedule(question_pass=True) is None


def test_no_other_module_defines_the_format():
    """Only params.py reads the ``"ragkv"`` entry's fields: the receivers import BlendParams."""
    for rel in (
        "apps/ragkv_server/openai_compat.py",
        "integrations/vllm/ragkv_vllm/connector.py",
        "ragkv/remote/client.py",
    ):
        tree = ast.parse((REPO / rel).read_text())
        imported = {
            a.name
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module == "ragkv.remote.wire"
            for a in n.names
        }
        assert "BlendParams" in imported, rel
        classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        assert not classes & {"BlendRequest", "ChunkParam"}, rel
