"""The Python API's RAG answers never emit a stop string, streamed or not, and report the finish reason
of the generation (the wrappers' and the service's own checks are in their distributions' tests)."""

import pytest

from ragkv.testing import check_stop_strings, musique_rag, musique_samples

STOP_MAX = 24


@pytest.fixture(scope="module")
def rag(tmp_path_factory, one_thread, embedder):
    r = musique_rag(tmp_path_factory.mktemp("stops") / "data", embedder)
    yield r
    r.close()


def test_python_api_rag_answer_stop_strings(rag):
    q = musique_samples(1)[0]["question"]
    chunks = rag.retrieve(q)

    def complete(stop, n, streamed):
        items = list(rag.answer_stream(q, chunks=chunks, max_new_tokens=n, stop=(stop,)))
        events, ans = items[:-1], items[-1]
        text = (
            "".join(e.text for e in events)
            if streamed
            else rag.answer(q, chunks=chunks, max_new_tokens=n, stop=(stop,)).text
        )
        assert ans.text == "".join(e.text for e in events)
        return text, events[-1].finish_reason

    pieces = [e.text for e in list(rag.answer_stream(q, chunks=chunks, max_new_tokens=STOP_MAX))[:-1]]
    check_stop_strings(pieces, STOP_MAX, complete)
