import os

# Tests never reach a model hub: everything they load is local (shared/ or built in the test).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
