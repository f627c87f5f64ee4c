"""The ragkv entry of vLLM's ``kv_transfer_params``: the one module that owns that wire format.

A request names its retrieved chunks as ``{"ragkv": {"chunks": [{"key": ..., "start": ...,
"length": ...}], "mode": "blend", "ratio": ..., "check_layers": [...], "deviation": ..., "save": ...,
"fresh_check_kv": ...}}``. :class:`BlendParams` parses and writes it; the library sees only its
neutral types (:class:`ragkv.blend.spans.ChunkRef`, :class:`ragkv.blend.BlendSchedule`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ragkv.blend import DEFAULT_RATIO, BlendSchedule
from ragkv.blend.spans import ChunkRef

PARAMS_KEY = "ragkv"
MODES = ("blend", "reuse")
_KEY_RE = re.compile(r"^[0-9A-Za-z_.:-]{1,200}$")
MAX_CHUNKS = 4096
_FIELDS = {"chunks", "mode", "ratio", "check_layers", "deviation", "save", "fresh_check_kv"}


class KVParamsError(ValueError):
    """A request's ``kv_transfer_params["ragkv"]`` is malformed."""


@dataclass(frozen=True)
class BlendParams:
    """What a request asks of the connector; travels as ``kv_transfer_params["ragkv"]``."""

    chunks: tuple[ChunkRef, ...]
    mode: str = "blend"
    ratio: float = DEFAULT_RATIO
    check_layers: tuple[int, ...] = (1,)
    deviation: str = BlendSchedule.deviation  # the library default (K)
    save: bool = True  # store the KV of chunks that missed (computed alone, chunk convention)
    fresh_check_kv: bool = False  # see BlendSchedule.fresh_check_kv

    def __post_init__(self):
        if self.mode not in MODES:
            raise KVParamsError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.ratio, (int, float)) or not 0.0 <= float(self.ratio) <= 1.0:
            raise KVParamsError(f"ratio must be a number in [0, 1], got {self.ratio!r}")
        if len(self.chunks) > MAX_CHUNKS:
            raise KVParamsError(f"at most {MAX_CHUNKS} chunks per request, got {len(self.chunks)}")
        try:
            self.schedule()
        except ValueError as e:
            raise KVParamsError(f"invalid blend schedule: {e}") from None

    def schedule(self) -> BlendSchedule | None:
        """The HKVD schedule (one ratio at every check layer), or None for full reuse."""
        if self.mode == "reuse":
            return None
        return BlendSchedule(
            tuple(self.check_layers),
            (float(self.ratio),) * len(self.check_layers),
            self.deviation,
            self.fresh_check_kv,
            # the hook replays layers with no question pass: check-layer selection (K deviation),
            # with the library's default per-chunk offsets (ragkv.blend.BlendSchedule)
            selector="kdev",
        )

    def to_kv_transfer_params(self) -> dict:
        """``{"ragkv": {...}}``: JSON-safe, for the OpenAI server's ``kv_transfer_params`` field."""
        return {
            PARAMS_KEY: {
                "chunks": [_chunk_dict(c) for c in self.chunks],
                "mode": self.mode,
                "ratio": float(self.ratio),
                "check_layers": list(self.check_layers),
                "deviation": self.deviation,
                "save": self.save,
                "fresh_check_kv": self.fresh_check_kv,
            }
        }

    @classmethod
    def from_kv_transfer_params(cls, params: dict | None) -> BlendParams | None:
        """Parse a request's ``kv_transfer_params``; None when it carries no ``"ragkv"`` entry."""
        if params is None:
            return None
        if not isinstance(params, dict):
            raise KVParamsError(f"kv_transfer_params must be a dict, got {type(params).__name__}")
        body = params.get(PARAMS_KEY)
        if body is None:
            return None
        if not isinstance(body, dict):
            raise KVParamsError(f"kv_transfer_params[{PARAMS_KEY!r}] must be a dict")
        unknown = set(body) - _FIELDS
        if unknown:
            raise KVParamsError(f"unknown kv_transfer_params[{PARAMS_KEY!r}] fields: {sorted(unknown)}")
        raw = body.get("chunks")
        if not isinstance(raw, list):
            raise KVParamsError("'chunks' must be a list of {key, start?, length?} objects or key strings")
        chunks = tuple(_chunk_ref(c) for c in raw)
        layers = body.get("check_layers", [1])
        if not isinstance(layers, list) or not all(_is_int(x) and x >= 0 for x in layers):
            raise KVParamsError("'check_layers' must be a list of non-negative integers")
        save, fresh = body.get("save", True), body.get("fresh_check_kv", False)
        if not isinstance(save, bool) or not isinstance(fresh, bool):
            raise KVParamsError("'save' and 'fresh_check_kv' must be booleans")
        ratio = body.get("ratio", DEFAULT_RATIO)
        if isinstance(ratio, bool):
            raise KVParamsError("'ratio' must be a number")
        return cls(
            chunks=chunks,
            mode=body.get("mode", "blend"),
            ratio=ratio,
            check_layers=tuple(int(x) for x in layers),
            deviation=body.get("deviation", BlendSchedule.deviation),
            save=save,
            fresh_check_kv=fresh,
        )


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _chunk_dict(c: ChunkRef) -> dict:
    d: dict = {"key": c.key}
    if c.start is not None:
        d["start"], d["length"] = c.start, c.length
    return d


def _chunk_ref(c) -> ChunkRef:
    if isinstance(c, str):
        c = {"key": c}
    if not isinstance(c, dict):
        raise KVParamsError(f"a chunk must be a key string or a dict, got {type(c).__name__}")
    key = c.get("key")
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise KVParamsError(f"invalid chunk key {key!r}")
    start, length = c.get("start"), c.get("length")
    if (start is None) != (length is None):
        raise KVParamsError(f"chunk {key[:16]}: give both 'start' and 'length' or neither")
    if start is not None and not (_is_int(start) and _is_int(length) and start >= 0 and length > 0):
        raise KVParamsError(f"chunk {key[:16]}: 'start' must be >= 0 and 'length' > 0 integers")
    extra = set(c) - {"key", "start", "length"}
    if extra:
        raise KVParamsError(f"chunk {key[:16]}: unknown fields {sorted(extra)}")
    return ChunkRef(key, start, length)
