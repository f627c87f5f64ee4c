"""Old import paths of code that left the core (issue 40), kept for one release with a DeprecationWarning.

``ragkv.integrations.*`` and ``ragkv.apps.*`` are aliases of their new homes: the module imported is
the new one (the same object, so ``isinstance`` and monkeypatching agree). Where the new home is a
distribution that is not installed, the import fails with a ModuleNotFoundError naming what to install.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

#: old module -> (new module(s), distribution that ships it); a longer old prefix wins
MOVED: dict[str, tuple[tuple[str, ...], str]] = {
    "ragkv.integrations.common": (("ragkv.frameworks",), "ragkv"),
    "ragkv.integrations.vllm.params": (("ragkv.remote.wire",), "ragkv"),
    "ragkv.integrations.vllm.client": (("ragkv.remote.client",), "ragkv"),
    "ragkv.integrations.vllm": (("ragkv_vllm",), "ragkv-vllm"),
    "ragkv.integrations.langchain": (("langchain_ragkv",), "langchain-ragkv"),
    "ragkv.integrations.llama_index.llms": (("llama_index.llms.ragkv.base",), "llama-index-llms-ragkv"),
    "ragkv.integrations.llama_index.retrievers": (
        ("llama_index.retrievers.ragkv.base",),
        "llama-index-retrievers-ragkv",
    ),
    "ragkv.integrations.llama_index": (
        ("llama_index.llms.ragkv", "llama_index.retrievers.ragkv"),
        "llama-index-llms-ragkv and llama-index-retrievers-ragkv",
    ),
    "ragkv.apps": (("ragkv_server",), "ragkv-server"),
}
#: old modules with no installable new home
GONE = {
    "ragkv.integrations.standard_paths": "a measurement harness, now eval/standard_paths.py of a source checkout",
}
#: llama_index.retrievers.ragkv's submodules under their old names (the retrievers package's, not llms')
_LLAMA_SUBMODULES = {"embeddings", "node_parser", "query_engine"}


def new_name(old: str) -> tuple[tuple[str, ...], str] | None:
    """The new module name(s) and the distribution of an old module name, or None if it did not move."""
    if old.startswith("ragkv.integrations.llama_index."):
        sub = old.rsplit(".", 1)[1]
        if sub in _LLAMA_SUBMODULES:
            return (f"llama_index.retrievers.ragkv.{sub}",), "llama-index-retrievers-ragkv"
    for prefix in sorted(MOVED, key=len, reverse=True):
        if old == prefix or old.startswith(prefix + "."):
            targets, dist = MOVED[prefix]
            rest = old[len(prefix) :]
            return tuple(t + rest for t in targets) if rest else targets, dist
    return None


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old names and loads them as their new modules."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in ("ragkv.apps", "ragkv.integrations"):
            return None  # the packages themselves are the real shims (they install this finder)
        if fullname in GONE or new_name(fullname) is not None:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        old = spec.name
        if old in GONE:
            raise ModuleNotFoundError(f"{old} was removed from the ragkv package: {GONE[old]}", name=old)
        targets, dist = new_name(old)
        warnings.warn(
            f"{old} is deprecated and will be removed in the next release; import {' / '.join(targets)} "
            f"(distribution {dist})",
            DeprecationWarning,
            stacklevel=2,
        )
        mods = []
        for t in targets:
            try:
                mods.append(importlib.import_module(t))
            except ModuleNotFoundError as e:
                top = t.split(".")
                if e.name is not None and any(e.name == ".".join(top[: i + 1]) for i in range(len(top))):
                    raise ModuleNotFoundError(
                        f"{old} moved to {t}, which is not installed: pip install {dist}", name=old
                    ) from e
                raise
        if len(mods) == 1:
            return mods[0]
        merged = types.ModuleType(old, f"{old}: {', '.join(targets)} (deprecated)")
        for m in mods:
            merged.__dict__.update({k: v for k, v in vars(m).items() if not k.startswith("__")})
        merged.__path__ = []  # a package: its old submodules resolve through this finder
        return merged

    def exec_module(self, module):
        pass  # already the new module


def install() -> None:
    """Put the alias finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
