"""The KV adapters the package ships: one file per model fingerprint, listed with its digest.

``ragkv/adapter/shipped/manifest.json`` maps a model fingerprint to ``{"file", "sha256", "rank"}``;
:func:`shipped_adapter` loads the model's file and refuses one whose content digest differs from the
manifest's (an edited or swapped file is never used). Whether a loaded adapter is *used* is the
fidelity gate's decision, from the (model, adapter) pair's own report.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ragkv.adapter.kv_adapter import AdapterError, KVAdapter, adapter_format
from ragkv.adapter.links import FORMAT as LINK_FORMAT
from ragkv.adapter.writer import FORMAT as WRITER_FORMAT
from ragkv.adapter.writer import WriterLoRA
from ragkv.defaults import DEFAULT_ADAPTER

log = logging.getLogger(__name__)

SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"
#: an owner's default ``adapter=`` setting: the shipped adapter, where the fidelity gate chooses it
#: the owner setting that takes the package's adapter for the model (the default: ragkv.defaults)
AUTO_ADAPTER = DEFAULT_ADAPTER
MANIFEST = SHIPPED_DIR / "manifest.json"


def manifest(path: Path = MANIFEST) -> dict[str, dict]:
    """The shipped adapters by model fingerprint ({} when none ships)."""
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def shipped_adapter(model, path: Path = MANIFEST) -> KVAdapter | None:
    """The package's adapter for ``model`` (verified by its digest), or None (none ships, or it fails
    verification: logged, never used)."""
    entry = manifest(path).get(model.fingerprint)
    if entry is None:
        return None
    try:
        return KVAdapter.load(path.parent / entry["file"], model, digest=entry["sha256"])
    except (AdapterError, KeyError) as e:
        log.warning("not using the shipped KV adapter for %s: %s", getattr(model, "name", "?"), e)
        return None


def load_adapter(path, model, digest: str | None = None) -> KVAdapter | WriterLoRA:
    """An adapter file of either kind (its format says which): a KV adapter or a chunk-KV writer. Link
    rows (``ragkv adapter train --kind link``) are a measured candidate, not served: refused here."""
    fmt = adapter_format(path)
    if fmt == WRITER_FORMAT:
        return WriterLoRA.load(path, model, digest)
    if fmt == LINK_FORMAT:
        raise AdapterError(
            f"{Path(path).name} holds link rows: a candidate measured with eval.bench_adapter, not served "
            "(docs/ADAPTER.md); serve a KV adapter or a chunk-KV writer"
        )
    return KVAdapter.load(path, model, digest)


def resolve_adapter(model, spec) -> tuple[KVAdapter | WriterLoRA | None, bool]:
    """``(adapter, explicit)`` for an owner's ``adapter=`` setting: ``"auto"`` (the default) is the
    package's adapter for the model if one ships, used where the fidelity gate chooses it; None or
    ``"off"``: none; a path, a :class:`KVAdapter` or a :class:`WriterLoRA`: that one, also used outside
    the gate (explicit). A writer's owner writes chunk KV with :func:`kv_model`."""
    if spec is None or (isinstance(spec, str) and spec.lower() in ("off", "none", "")):
        return None, False
    if isinstance(spec, str) and spec.lower() == "auto":
        return shipped_adapter(model), False
    if isinstance(spec, KVAdapter | WriterLoRA):
        return spec, True
    return load_adapter(spec, model), True


def kv_model(model, adapter):
    """The model that writes (and names) chunk KV for an owner with ``adapter``: a writer's
    :class:`~ragkv.adapter.writer.WriterModel`, else ``model`` itself. A writer still being trained
    (trainable parameters: its KV could not be named) is refused."""
    if adapter is None or not adapter.writes_kv:
        return model
    if adapter.trainable:
        raise AdapterError(
            "a chunk-KV writer being trained cannot write served KV: requires_grad_(False) first"
        )
    return adapter.model(model)


def check_kv_source(resolver, writes_with) -> None:
    """A resolver passed to an owner must hold the chunk KV the owner's ``writes_with`` model writes (a
    writer's KV only with that writer): else a clear error, never KV of another kind."""
    if resolver.model.fingerprint != writes_with.fingerprint:
        raise ValueError(
            "the resolver's chunk KV is another model's (or another chunk-KV writer's) than this owner's"
        )
