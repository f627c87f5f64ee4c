"""ragkv-vllm: ragkv inside vLLM (experimental): a KV connector that blends stored chunk KV, its model hook,
and the HACK attention backend; ``plugin.register`` is the distribution's ``vllm.general_plugins`` entry point.

Importing this package does not import vLLM. The pieces that need vLLM (``connector``,
``plugin.register``) import it themselves; ``model_hook.checkpoint_fingerprint`` works without it. The
wire format and the client that sends it are the core's (``ragkv.remote``). See integrations/vllm/README.md for what has and has not been verified.
"""

SUPPORTED_VLLM = ">=0.32,<0.34"
