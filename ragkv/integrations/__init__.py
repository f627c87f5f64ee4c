"""Framework integrations: ``ragkv.integrations.langchain`` and ``ragkv.integrations.llama_index`` (optional extras)."""
