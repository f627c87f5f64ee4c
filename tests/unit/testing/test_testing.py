"""ragkv.testing, what every suite shares: the tiny model and the corpus are found from an editable
install (or where the environment points), stop cases are cut where they first occur, ports are free."""

from __future__ import annotations

import socket

from ragkv import testing


def test_the_tiny_model_and_the_corpus_are_found(monkeypatch, tmp_path):
    assert (testing.stories_path() / "config.json").is_file()
    assert (
        testing.stories_model().config.num_layers >= 1 and testing.stories_model() is testing.stories_model()
    )  # loaded once
    samples = testing.musique_samples(2)
    assert len(samples) == 2 and all(s["question"] and s["ctxs"] for s in samples)
    monkeypatch.setenv("RAGKV_TEST_MODEL", str(tmp_path))
    assert testing.stories_path() == tmp_path


def test_stop_cases_start_where_they_first_occur():
    pieces = ["Once", " upon", " a", " time", " there", " was", " a", " girl"]
    cases = testing.stop_cases(pieces)
    text = "".join(pieces)
    for stop, n in cases.values():
        assert text.find(stop) < len("".join(pieces[:n])) <= len(text)
    assert cases["multi"][0] == " upon a time"


def test_free_port_can_be_bound():
    port = testing.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_templated_checkpoint_renders_with_its_template(tmp_path):
    ckpt = testing.templated_checkpoint(tmp_path / "chatml", testing.CHATML_TEMPLATE)
    ids = testing.template_ids(ckpt, [{"role": "user", "content": "Hi"}])
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(ckpt).decode(ids)
    assert "<|im_start|>user" in text and "Hi" in text and text.endswith("<|im_start|>assistant\n")
