"""Generating on a remote server: the ``kv_transfer_params`` wire format (``wire``) and the HTTP generator
(``client``) that speaks it to vLLM with ragkv-vllm, or to ragkv-server's ``/v1/completions``.

The core's because two edges use them: ragkv-server parses the wire format and runs the generator, and
ragkv-vllm's connector parses it inside vLLM. HTTP through httpx (the events of a stream through httpx-sse)."""
