"""What the LangChain and LlamaIndex distributions share (ragkv_frameworks): a flat prompt's documents,
joined and split on the chunk separator. The wrappers themselves: each integration's tests."""

from ragkv_frameworks import CHUNK_SEPARATOR, format_docs, split_prompt


def test_split_prompt_and_format_docs():
    assert split_prompt("plain prompt") == ("", [], "plain prompt")
    text = "Read:" + format_docs(["A a.", "B b."]) + "Q?"
    assert split_prompt(text) == ("Read:", ["A a.", "B b."], "Q?")
    assert format_docs([]) == ""
    assert CHUNK_SEPARATOR in format_docs(["x"])


def test_the_options_take_the_one_generation_default():
    """``RagkvOptions.max_new_tokens`` is ragkv's one default (ragkv.defaults), as every other surface's."""
    from ragkv.defaults import DEFAULT_MAX_NEW_TOKENS
    from ragkv_frameworks import RagkvOptions

    assert RagkvOptions.model_fields["max_new_tokens"].default == DEFAULT_MAX_NEW_TOKENS
