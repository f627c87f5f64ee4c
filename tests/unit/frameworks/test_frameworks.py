"""What the LangChain and LlamaIndex distributions share (ragkv.frameworks): a flat prompt's documents,
joined and split on the chunk separator. The wrappers themselves: tests/e2e/test_integrations.py."""

from ragkv.frameworks import CHUNK_SEPARATOR, format_docs, split_prompt


def test_split_prompt_and_format_docs():
    assert split_prompt("plain prompt") == ("", [], "plain prompt")
    text = "Read:" + format_docs(["A a.", "B b."]) + "Q?"
    assert split_prompt(text) == ("Read:", ["A a.", "B b."], "Q?")
    assert format_docs([]) == ""
    assert CHUNK_SEPARATOR in format_docs(["x"])
