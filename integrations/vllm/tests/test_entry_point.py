"""ragkv-vllm is the one distribution that registers ragkv's vLLM plugin (issue 40)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragkv.testing import build_wheel

HERE = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_built_wheel_registers_the_vllm_plugin(tmp_path):
    names, entry_points = build_wheel(HERE, tmp_path)
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"ragkv_vllm"}, sorted(top)
    assert "[vllm.general_plugins]\nragkv = ragkv_vllm.plugin:register" in entry_points, entry_points


def test_the_plugin_entry_point_names_a_real_function():
    """What the entry point names exists (without importing vLLM: the plugin imports it at register time)."""
    import ragkv_vllm.plugin

    assert callable(ragkv_vllm.plugin.register)
