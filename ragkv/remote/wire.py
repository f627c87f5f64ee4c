"""The ragkv entry of vLLM's ``kv_transfer_params``: the one module that owns that wire format.

A request names its retrieved chunks as ``{"ragkv": {"chunks": [{"key": ..., "start": ...,
"length": ...}], "mode": "blend", "ratio": ..., "check_layers": [...], "deviation": ..., "save": ...,
"fresh_check_kv": ...}}``. :class:`BlendParams` holds its fields and bounds, parses it
(:meth:`BlendParams.from_kv_transfer_params`, :class:`KVParamsError` with the reason) and writes it
(:meth:`BlendParams.to_kv_transfer_params`); both receivers use it: the vLLM connector and the ragkv
service's ``/v1/completions`` (``ragkv_server.openai_compat``). The library sees only its neutral types
(:class:`ragkv.blend.spans.ChunkRef`, :class:`ragkv.blend.BlendSchedule`).

Every list and string is bounded (issue 24): at most :data:`MAX_CHUNKS` chunks and
:data:`MAX_CHECK_LAYERS` check layers, keys as the store takes them (:func:`ragkv.store.base.check_key`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ragkv.blend import DEFAULT_RATIO, BlendSchedule
from ragkv.blend.spans import ChunkRef
from ragkv.defaults import Mode
from ragkv.fidelity.plan import RequestSettings
from ragkv.store.base import check_key

PARAMS_KEY = "ragkv"
#: the modes the connector serves: those that read stored chunk KV
MODES = tuple(m.value for m in reversed(Mode) if m.reuses)  # ("blend", "reuse")
DEVIATIONS = ("k", "v", "kv")
#: most chunk references one request may carry (the receivers use at most ragkv.blend.spans.MAX_CHUNK_REFS)
MAX_CHUNKS = 4096
#: most check layers one request may name (a model's layers bound them further where it is known)
MAX_CHECK_LAYERS = 256
_FIELDS = {"chunks", "mode", "ratio", "check_layers", "deviation", "save", "fresh_check_kv"}


class KVParamsError(ValueError):
    """A request's ``kv_transfer_params["ragkv"]`` is malformed (the message says why)."""


@dataclass(frozen=True)
class BlendParams:
    """What a request asks of the receiver; travels as ``kv_transfer_params["ragkv"]``."""

    chunks: tuple[ChunkRef, ...]
    mode: str = "blend"
    ratio: float = DEFAULT_RATIO
    check_layers: tuple[int, ...] = (1,)
    deviation: str = BlendSchedule.deviation  # the library default (K)
    #: store the KV of chunks that missed (computed alone, chunk convention); absent from a request it
    #: is the receiver's default (``save_default``): the vLLM connector saves, the ragkv service does not
    save: bool = True
    fresh_check_kv: bool = False  # see BlendSchedule.fresh_check_kv

    def __post_init__(self):
        if self.mode not in MODES:
            raise KVParamsError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.deviation not in DEVIATIONS:
            raise KVParamsError(f"deviation must be one of {DEVIATIONS}, got {self.deviation!r}")
        if not _is_number(self.ratio) or not 0.0 <= float(self.ratio) <= 1.0:
            raise KVParamsError(f"ratio must be a number in [0, 1], got {self.ratio!r}")
        if len(self.chunks) > MAX_CHUNKS:
            raise KVParamsError(f"at most {MAX_CHUNKS} chunks per request, got {len(self.chunks)}")
        if len(self.check_layers) > MAX_CHECK_LAYERS:
            raise KVParamsError(f"at most {MAX_CHECK_LAYERS} check_layers, got {len(self.check_layers)}")
        try:
            self._check_layer_schedule()
        except ValueError as e:
            raise KVParamsError(f"invalid blend schedule: {e}") from None

    def _check_layer_schedule(self) -> BlendSchedule:
        """``ratio`` at every check layer, selected by K/V deviation there (CacheBlend's selection)."""
        n = len(self.check_layers)
        return BlendSchedule(
            tuple(self.check_layers),
            (float(self.ratio),) * n,
            self.deviation,
            self.fresh_check_kv,
            selector="kdev",
        )

    def schedule(self, question_pass: bool = False) -> BlendSchedule | None:
        """The blend schedule, or None for full reuse (mode "reuse").

        The vLLM hook replays layers with no question pass: check-layer selection (K deviation) with
        the library's default per-chunk offsets. In process (``question_pass``, the ragkv service) a
        request that keeps the default check layers, deviation and check-layer KV gets the library's
        default schedule at ``ratio``, so a served answer equals a local one."""
        if self.mode == "reuse":
            return None
        default = BlendSchedule()
        keeps_defaults = (tuple(self.check_layers), self.deviation, self.fresh_check_kv) == (
            default.check_layers,
            default.deviation,
            default.fresh_check_kv,
        )
        if question_pass and keeps_defaults:
            return BlendSchedule.single(float(self.ratio))
        return self._check_layer_schedule()

    def request_settings(self) -> RequestSettings:
        """What an in-process receiver (the ragkv service) runs for these parameters: their mode and
        the blend schedule of :meth:`schedule` (question pass)."""
        return RequestSettings(self.mode, schedule=self.schedule(question_pass=True))

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
    def from_kv_transfer_params(cls, params: object, save_default: bool = True) -> BlendParams | None:
        """Parse a request's ``kv_transfer_params``; None when it carries no ``"ragkv"`` entry.

        Strict: wrong types are refused, not coerced (``true`` is no number, ``"1"`` no layer); unknown
        fields are refused. ``save_default``: ``save`` when the request does not say."""
        if params is None:
            return None
        if not isinstance(params, dict):
            raise KVParamsError(f"must be a dict, got {type(params).__name__}")
        body = params.get(PARAMS_KEY)
        if body is None:
            return None
        if not isinstance(body, dict):
            raise KVParamsError(f"{PARAMS_KEY!r} must be a dict, got {type(body).__name__}")
        unknown = set(body) - _FIELDS
        if unknown:
            raise KVParamsError(f"unknown {PARAMS_KEY!r} fields: {sorted(unknown)}")
        raw = body.get("chunks")
        if not isinstance(raw, list):
            raise KVParamsError("'chunks' must be a list of {key, start?, length?} objects or key strings")
        if len(raw) > MAX_CHUNKS:  # before parsing each one
            raise KVParamsError(f"at most {MAX_CHUNKS} chunks per request, got {len(raw)}")
        layers = body.get("check_layers", [1])
        if not isinstance(layers, list) or not all(_is_int(x) and x >= 0 for x in layers):
            raise KVParamsError("'check_layers' must be a list of non-negative integers")
        save, fresh = body.get("save", save_default), body.get("fresh_check_kv", False)
        if not isinstance(save, bool) or not isinstance(fresh, bool):
            raise KVParamsError("'save' and 'fresh_check_kv' must be booleans")
        return cls(
            chunks=tuple(_chunk_ref(c) for c in raw),
            mode=body.get("mode", "blend"),
            ratio=body.get("ratio", DEFAULT_RATIO),
            check_layers=tuple(layers),
            deviation=body.get("deviation", BlendSchedule.deviation),
            save=save,
            fresh_check_kv=fresh,
        )


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _chunk_dict(c: ChunkRef) -> dict:
    d: dict = {"key": c.key}
    if c.start is not None:
        d["start"], d["length"] = c.start, c.length
    return d


def _chunk_ref(c) -> ChunkRef:
    """One chunk: a key string, or ``{key, start?, length?}`` (both of start and length, or neither)."""
    if isinstance(c, str):
        c = {"key": c}
    if not isinstance(c, dict):
        raise KVParamsError(f"a chunk must be a key string or a dict, got {type(c).__name__}")
    key = c.get("key")
    try:
        check_key(key)  # the store's rule: 1 to 200 of [0-9A-Za-z_.:-], not starting with "."
    except ValueError:
        raise KVParamsError(
            f"invalid chunk key {str(key)[:40]!r}: expected 1-200 chars of [0-9A-Za-z_.:-]"
        ) from None
    start, length = c.get("start"), c.get("length")
    if (start is None) != (length is None):
        raise KVParamsError(f"chunk {key[:16]}: give both 'start' and 'length' or neither")
    if start is not None and not (_is_int(start) and _is_int(length) and start >= 0 and length > 0):
        raise KVParamsError(f"chunk {key[:16]}: 'start' must be >= 0 and 'length' > 0 integers")
    extra = set(c) - {"key", "start", "length"}
    if extra:
        raise KVParamsError(f"chunk {key[:16]}: unknown fields {sorted(extra)}")
    return ChunkRef(key, start, length)
