"""Framework integrations: ``integrations.langchain`` and ``integrations.llama_index`` (optional extras)."""
