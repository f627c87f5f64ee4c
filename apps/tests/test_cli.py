"""The ``ragkv-server`` command (``ragkv_server.cli``): ``ingest``, ``ask``, ``gc`` and ``serve`` over the
service's settings (moved from the core's ``ragkv`` command, issue 55)."""

from __future__ import annotations

import json

import pytest

from ragkv import LLM
from ragkv.blend import DEFAULT_RATIO
from ragkv.model.rope_energy import DEMO_CORPUS
from ragkv.rag import RAG
from ragkv.testing import stories_model, stories_path
from ragkv_server.cli import build_parser, main, settings


@pytest.mark.parametrize("cmd", ["ingest", "ask", "gc", "serve"])
def test_subcommands_have_help(cmd, capfd):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    flag = {"ingest": "--limit", "ask": "--compare", "gc": "--dry-run", "serve": "--port"}[cmd]
    out = capfd.readouterr().out
    assert out.startswith("usage:") and flag in out


def test_ask_takes_the_settings_max_new_tokens():
    assert build_parser().parse_args(["ask", "q"]).max_new_tokens is None  # the settings' (shared with serve)


def test_ingest_and_ask_take_a_collection(tmp_path, capsys, monkeypatch):
    """``ragkv-server ingest --collection`` / ``ragkv-server ask --collection``: the CLI reaches the same collections."""
    monkeypatch.setenv("RAGKV_CACHE_DIR", str(tmp_path / "cache"))
    common = ["--data-dir", str(tmp_path / "data"), "--model", str(stories_path()), "--threads", "1"]
    (tmp_path / "a.txt").write_text("Lily had a red ball. She played with it in the park every day.")
    (tmp_path / "b.txt").write_text("Tom liked to run. He ran to the shop and bought a blue kite.")
    assert main(["ingest", str(tmp_path / "a.txt"), "--collection", "a", "-q", *common]) == 0
    assert main(["ingest", str(tmp_path / "b.txt"), "-q", *common]) == 0
    capsys.readouterr()
    ask = ["ask", "What did Tom buy?", "--max-new-tokens", "2", *common]
    assert main([*ask, "--collection", "a"]) == 0
    out = capsys.readouterr().out
    sources = out.split("sources:")[1]
    assert "Lily had" in sources and "Tom liked" not in sources  # only collection a's chunk
    assert main(ask) == 0
    out = capsys.readouterr().out
    sources = out.split("sources:")[1]
    assert "Tom liked" in sources and "Lily had" not in sources
    assert main([*ask, "--collection", "no/such"]) == 2
    assert "invalid collection name" in capsys.readouterr().err
    json.loads(out.strip().splitlines()[-1])  # the last line stays one JSON object


def test_gc_collects_a_data_folder(tmp_path, embedder, capsys, one_thread):
    from ragkv.model.forward import compute_chunk_kv

    r = RAG(LLM(stories_model()), tmp_path, embedder=embedder, chunk_tokens=64, ratio=DEFAULT_RATIO)
    r.ingest(["Lily had a red ball."], show_progress=False)
    r.store.put(compute_chunk_kv(r.model, [7, 8, 9]))
    r.close()
    args = ["gc", "--data-dir", str(tmp_path), "--model", str(stories_path())]
    assert main([*args, "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["unreferenced"] == 1
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["deleted"] == 1


def test_the_service_stores_kv_with_the_one_codec_constant(tmp_path, monkeypatch):
    """``ragkv-server ingest`` / the service (``ragkv_server.service.build_rag``) store new KV with
    DEFAULT_CODEC; the settings default is that constant."""
    from ragkv.store.codecs import DEFAULT_CODEC
    from ragkv_server.config import Settings
    from ragkv_server.service import build_rag

    monkeypatch.setenv("RAGKV_CACHE_DIR", str(tmp_path / "cache"))  # calibration lands here
    assert Settings().store_codec == DEFAULT_CODEC
    with pytest.raises(ValueError, match="unknown store codec"):
        Settings(store_codec="nope")
    rag = build_rag(Settings(model=str(stories_path()), data_dir=tmp_path / "svc"))
    try:
        assert rag.store.codec.name == DEFAULT_CODEC and "raw" in rag.store.allowed_codecs
        rag.ingest([{"id": "d", "text": "Lily has a red ball. She plays with it in the park every day."}])
        keys = rag.store.keys()
        assert keys and {rag.store.header(k).codec for k in keys} == {DEFAULT_CODEC}
    finally:
        rag.close()
    assert (tmp_path / "cache" / "stepz").is_dir()  # the model was calibrated once, cached by fingerprint


def test_ask_and_serve_take_the_demos_prompt_settings(tmp_path):
    from ragkv.rag import prompt_options, prompt_parts
    from ragkv_server.server import build_parser as server_parser
    from ragkv_server.server import settings_from_args
    from ragkv_server.service import build_rag

    corpus = json.loads(DEMO_CORPUS.read_text())
    served = settings_from_args(server_parser().parse_args(["--prompt-file", str(DEMO_CORPUS)]))
    assert served.prompt_file == DEMO_CORPUS
    flags = ["--model", str(stories_path()), "--data-dir", str(tmp_path), "--prompt-file", str(DEMO_CORPUS)]
    s = settings(build_parser().parse_args(["ask", "Who?", *flags]))
    rag = build_rag(s)
    try:
        assert (
            rag.examples == [tuple(e) for e in corpus["examples"]]
            and rag.instruction == corpus["instruction"]
        )
        want = prompt_parts(rag.model, "Who?", **prompt_options(corpus))  # what `ragkv demo` asks
        assert rag.prompt_parts("Who?") == want != prompt_parts(rag.model, "Who?")
    finally:
        rag.close()
