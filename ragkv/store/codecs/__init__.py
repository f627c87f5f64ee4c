"""KV codecs (tensors <-> bytes per layer group): ``raw``, ``int8``/``int4`` and ``stepz`` built in,
``video`` lazily.

:data:`DEFAULT_CODEC` is the stored-KV codec of ``ragkv-server ingest``, the service and the demo (chosen by
measurement: docs/BENCHMARKS.md, "Compact stored KV (issue 25)"); ``raw`` stays available
(``?codec=raw``) and stores built with those defaults still decode :data:`LEGACY_CODECS` blobs.
"""

from ragkv.store.codecs.base import CodecError, KVCodec, available_codecs, get_codec, register_codec
from ragkv.store.codecs.quant import QuantCodec  # registers int8 and int4
from ragkv.store.codecs.raw import RawCodec  # registers raw
from ragkv.store.codecs.stepz import StepZCodec  # registers stepz

#: the one default stored-KV codec every application default reads (ingest, service, demo)
DEFAULT_CODEC = "stepz"
#: codecs of earlier defaults that application stores keep decoding (raw: lossless, bounded size)
LEGACY_CODECS = ("raw",)

__all__ = [
    "DEFAULT_CODEC",
    "LEGACY_CODECS",
    "CodecError",
    "KVCodec",
    "QuantCodec",
    "RawCodec",
    "StepZCodec",
    "available_codecs",
    "get_codec",
    "register_codec",
]
