"""``video`` KV codec (KVFetcher): quantized KV as lossless HEVC video, CPU (PyAV) or NVDEC decode.

Importing this package registers the codec as ``video`` (``get_codec("video", **options)``).
See docs/VIDEO_CODEC.md for the format, the layout and the measurements behind the defaults.
"""

from ragkv.store.codecs.base import register_codec
from ragkv.store.codecs.video.codec import DEFAULT_VERSIONS, VideoCodec
from ragkv.store.codecs.video.hevc_cpu import HAVE_PYAV, HevcError
from ragkv.store.codecs.video.layout import FrameLayout, Tiling, candidate_tilings, default_tiling
from ragkv.store.codecs.video.quantize import QuantConfig, QuantizeError, quantize

if not HAVE_PYAV:  # keep the store's lazy import contract: no PyAV -> the codec is simply not offered
    raise ImportError("ragkv video codec needs PyAV (pip install 'ragkv[video]')")

register_codec("video", VideoCodec)

__all__ = [
    "DEFAULT_VERSIONS",
    "FrameLayout",
    "HevcError",
    "QuantConfig",
    "QuantizeError",
    "Tiling",
    "VideoCodec",
    "candidate_tilings",
    "default_tiling",
    "quantize",
]
