"""ragkv inside vLLM (experimental): a KV connector that blends stored chunk KV, its model hook, and a client.

Importing this package does not import vLLM. The pieces that need vLLM (``connector``,
``plugin.register``) import it themselves; ``client`` and ``model_hook.checkpoint_fingerprint``
work without it. See ragkv/integrations/vllm/README.md for what has and has not been verified.
"""

SUPPORTED_VLLM = ">=0.32,<0.34"
