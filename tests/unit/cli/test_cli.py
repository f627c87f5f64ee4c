"""The core's ``ragkv`` command: what the core owns (demo, models, calibrate, adapter, eval); the service's
commands are ragkv-server's (``ragkv-server``)."""

from __future__ import annotations

import pytest

from ragkv.cli import build_parser, main
from ragkv.defaults import DEFAULT_MAX_NEW_TOKENS
from ragkv.store import LocalDirStore
from ragkv.store.codecs import DEFAULT_CODEC
from tests.helpers import stories_path


@pytest.mark.parametrize("cmd", ["demo", "models", "calibrate", "adapter", "eval"])
def test_subcommands_have_help(cmd, capfd):
    if cmd == "eval":  # runs the checkout's eval.run as a child process: its exit status is returned
        assert main([cmd, "--help"]) == 0
    else:
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
    flag = {
        "demo": "--questions",
        "models": "pull",
        "calibrate": "--ladder",
        "adapter": "--rank",
        "eval": "--dataset",
    }[cmd]
    out = capfd.readouterr().out
    assert out.startswith("usage:") and flag in out


@pytest.mark.parametrize("cmd", ["ingest", "ask", "gc", "serve"])
def test_the_services_commands_are_not_the_cores(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_the_demo_stores_kv_with_the_one_codec_constant(tmp_path, monkeypatch):
    """The demo stores new KV with DEFAULT_CODEC (``--codec`` None) and its answers with the defaults'
    ``max_new_tokens``."""
    monkeypatch.setenv("RAGKV_CACHE_DIR", str(tmp_path / "cache"))  # calibration lands here
    parsed = build_parser().parse_args(["demo"])
    assert parsed.codec is None and parsed.max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    demo_dir = tmp_path / "demo"
    args = ["demo", "--model", str(stories_path()), "--data-dir", str(demo_dir), "--passages", "2"]
    assert main([*args, "--questions", "1", "--max-new-tokens", "2", "-q"]) == 0
    (kv_dir,) = demo_dir.glob("*/kv")
    demo_store = LocalDirStore(kv_dir, codec=DEFAULT_CODEC)
    assert demo_store.keys() and {demo_store.header(k).codec for k in demo_store.keys()} == {DEFAULT_CODEC}
