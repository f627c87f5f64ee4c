"""KV codecs (tensors <-> bytes per layer group): ``raw`` and ``int8``/``int4`` built in, ``video`` lazily."""

from ragkv.store.codecs.base import CodecError, KVCodec, available_codecs, get_codec, register_codec
from ragkv.store.codecs.quant import QuantCodec  # registers int8 and int4
from ragkv.store.codecs.raw import RawCodec  # registers raw

__all__ = [
    "CodecError",
    "KVCodec",
    "QuantCodec",
    "RawCodec",
    "available_codecs",
    "get_codec",
    "register_codec",
]
