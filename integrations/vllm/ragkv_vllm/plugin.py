"""The ``vllm.general_plugins`` entry point: registers ragkv's pieces in every vLLM process.

pyproject.toml::

    [project.entry-points."vllm.general_plugins"]
    ragkv = "ragkv_vllm.plugin:register"

vLLM calls ``register()`` in the API server, the engine core and every worker (it must be
re-entrant: it is). It registers

* the KV connector ``RagkvConnector`` with vLLM's ``KVConnectorFactory`` (so
  ``--kv-transfer-config '{"kv_connector": "RagkvConnector", ...}'`` works without
  ``kv_connector_module_path``; giving the module path works too);
* the model hook (wraps ``GPUModelRunner.load_model``) that lets the connector reach the model;
* the HACK attention backend as ``AttentionBackendEnum.CUSTOM`` (``--attention-backend CUSTOM``;
  ``ragkv_vllm.hack_backend``), unless ``RAGKV_VLLM_HACK_BACKEND=0``;
* on vLLM >= 0.33, the KV-cache dtypes ``hack_2bit`` / ``hack_4bit`` / ``hack_8bit``
  (``register_kv_cache_dtype``: uint8 storage, ``KVQuantMode.CUSTOM``). vLLM 0.32 has no such hook:
  there the backend is used with ``--kv-cache-dtype auto`` and still gets HACK-sized pages (its
  ``customize_spec``); the bit width then comes from ``RAGKV_HACK_BITS``.

Set ``RAGKV_VLLM_PLUGIN=0`` to make it a no-op, or filter plugins with vLLM's ``VLLM_PLUGINS``.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("vllm.ragkv")  # under vLLM's logger: shown in its log at INFO

CONNECTOR_NAME = "RagkvConnector"
CONNECTOR_MODULE = "ragkv_vllm.connector"
HACK_BACKEND_PATH = "ragkv_vllm.hack_backend.HackAttentionBackend"
HACK_KV_CACHE_DTYPES = {"hack_2bit": 2, "hack_4bit": 4, "hack_8bit": 8}  # = hack_backend's table

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
        _done.update(
            connector=_register_connector(),
            model_hook=_install_hook(),
            attention_backend=_register_backend(),
            kv_cache_dtypes=_register_kv_cache_dtypes(),
        )
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
        from ragkv_vllm.model_hook import install_load_model_hook

        return install_load_model_hook()
    except Exception as e:
        log.warning("ragkv: model hook not installed (%s: %s); blending disabled", type(e).__name__, e)
        return []


def _hack_enabled() -> bool:
    return os.environ.get("RAGKV_VLLM_HACK_BACKEND", "1").strip().lower() not in ("0", "false", "no", "off")


def _register_backend() -> str | None:
    """``--attention-backend CUSTOM`` -> the HACK backend (imported lazily by vLLM's selector)."""
    if not _hack_enabled():
        return None
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        register_backend(AttentionBackendEnum.CUSTOM, HACK_BACKEND_PATH)
        return HACK_BACKEND_PATH
    except Exception as e:
        log.warning("ragkv: HACK attention backend not registered (%s: %s)", type(e).__name__, e)
        return None


def _dtype_handler(dtype_name: str):
    """A ``KVCacheDTypeHandler`` (vLLM >= 0.33) for one HACK dtype: uint8 pages, self-managed kernels."""

    class HackKVCacheDType:
        name = dtype_name

        def torch_dtype(self):
            import torch

            return torch.uint8

        def quant_mode(self):
            from vllm.v1.kv_cache_interface import KVQuantMode

            return KVQuantMode.CUSTOM

    HackKVCacheDType.__name__ = HackKVCacheDType.__qualname__ = f"HackKVCacheDType_{dtype_name}"
    return HackKVCacheDType


def _register_kv_cache_dtypes() -> list[str]:
    """Register ``hack_<b>bit`` ``--kv-cache-dtype`` values; [] on vLLM 0.32 (no registration hook)."""
    if not _hack_enabled():
        return []
    try:
        from vllm.config.cache import KV_CACHE_DTYPES, register_kv_cache_dtype
    except ImportError:
        return []  # vLLM 0.32: CacheDType is a closed Literal; the backend's customize_spec sizes pages
    try:
        for name in HACK_KV_CACHE_DTYPES:
            if name not in KV_CACHE_DTYPES:
                register_kv_cache_dtype(name)(_dtype_handler(name))
        return list(HACK_KV_CACHE_DTYPES)
    except Exception as e:
        log.warning("ragkv: HACK kv-cache dtypes not registered (%s: %s)", type(e).__name__, e)
        return []
