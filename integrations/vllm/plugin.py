"""The ``vllm.general_plugins`` entry point: registers ragkv's pieces in every vLLM process.

pyproject.toml::

    [project.entry-points."vllm.general_plugins"]
    ragkv = "integrations.vllm.plugin:register"

vLLM calls ``register()`` in the API server, the engine core and every worker (it must be
re-entrant: it is). It registers

* the KV connector ``RagkvConnector`` with vLLM's ``KVConnectorFactory`` (so
  ``--kv-transfer-config '{"kv_connector": "RagkvConnector", ...}'`` works without
  ``kv_connector_module_path``; giving the module path works too);
* the model hook (wraps ``GPUModelRunner.load_model``) that lets the connector reach the model.

It registers no attention backend: a HACK (2-bit) decode backend for vLLM's paged cache is not
written yet (see integrations/vllm/README.md, "Not done").

Set ``RAGKV_VLLM_PLUGIN=0`` to make it a no-op, or filter plugins with vLLM's ``VLLM_PLUGINS``.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("vllm.ragkv")  # under vLLM's logger: shown in its log at INFO

CONNECTOR_NAME = "RagkvConnector"
CONNECTOR_MODULE = "integrations.vllm.connector"

_lock = threading.Lock()
_done: dict[str, object] = {}


def register() -> dict[str, object]:
    """Register the connector and install the model hook; idempotent.

    Returns what was registered (for logs and tests). Never raises: a failure in one part is
    logged and the others still register, so a broken optional piece cannot stop vLLM starting.
    """
    if os.environ.get("RAGKV_VLLM_PLUGIN", "1").strip().lower() in ("0", "false", "no", "off"):
        return {"disabled": True}
    with _lock:
        if _done:
            return dict(_done)
        _done.update(connector=_register_connector(), model_hook=_install_hook())
        log.info("ragkv vLLM plugin registered: %s", _done)
        return dict(_done)


def _register_connector() -> str | None:
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        if CONNECTOR_NAME not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
        return CONNECTOR_NAME
    except Exception as e:
        log.warning("ragkv: KV connector not registered (%s: %s)", type(e).__name__, e)
        return None


def _install_hook() -> list[str]:
    try:
        from integrations.vllm.model_hook import install_load_model_hook

        return install_load_model_hook()
    except Exception as e:
        log.warning("ragkv: model hook not installed (%s: %s); blending disabled", type(e).__name__, e)
        return []
