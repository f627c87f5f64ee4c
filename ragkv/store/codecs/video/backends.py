"""Hardware HEVC decoders the video codec can hand a stream to, chosen by name or automatically.

A hardware decoder (NVDEC through PyNvVideoCodec is the one shipped: :mod:`.nvdec`) registers
itself here. :meth:`ragkv.store.codecs.video.VideoCodec._frames` asks :func:`select_decoder` for one
that serves the output device and accepts the stream's format and frame size; with
``decoder="auto"`` a decoder that then refuses the stream (raises, or returns a frame that fails
its checksum) is remembered as refusing that geometry and the stream is decoded on the CPU
(PyAV) instead, with a warning. The CPU decoder is not registered: it is always the last resort.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import torch


class DecoderRefused(RuntimeError):
    """A hardware decoder cannot decode this stream (size, format, driver, session limit)."""


class HardwareDecoder:
    """What the codec needs of a hardware decoder; subclasses implement :meth:`decode_frames`."""

    #: the name ``VideoCodec(decoder=...)`` selects it by
    name: str = ""
    #: device types whose output tensors this decoder writes (``"cuda"`` for NVDEC)
    device_types: tuple[str, ...] = ("cuda",)

    def available(self) -> bool:
        """Whether the decoder can run here at all (library, driver, device)."""
        return True

    def min_size(self, planes: str, depth: int) -> tuple[int, int]:
        """Smallest coded frame ``(height, width)`` the decoder accepts for this format."""
        return (1, 1)

    def supports_format(self, planes: str, depth: int) -> bool:
        """Whether the plane mode and bit depth are decodable (frame size aside)."""
        return True

    def refusal(self, planes: str, depth: int, height: int, width: int) -> str | None:
        """Why a ``height x width`` stream of this format cannot go to this decoder, or None if it can."""
        if not self.available():
            return f"{self.name} is not available here"
        if not self.supports_format(planes, depth):
            return f"{self.name} cannot decode {planes} at {depth} bits"
        mh, mw = self.min_size(planes, depth)
        if height < mh or width < mw:
            return (
                f"a {width}x{height} frame is below {self.name}'s minimum of {mw}x{mh} for {planes}/{depth}-bit "
                "(encode with small_frames='pad' to pad frames up to it)"
            )
        return None

    def decode_frames(
        self,
        data: bytes | memoryview,
        planes: str,
        num_planes: int,
        depth: int,
        height: int,
        width: int,
        device: torch.device,
    ) -> Iterator[torch.Tensor]:
        """Yield ``[num_planes, height, width]`` integer tensors on ``device``, in display order."""
        raise NotImplementedError


_LOCK = threading.Lock()
_REGISTRY: dict[str, HardwareDecoder] = {}
#: (decoder name, planes, depth, height, width) that refused a stream at run time: skipped by ``auto``
_REFUSED: set[tuple[str, str, int, int, int]] = set()


def register_decoder(decoder: HardwareDecoder) -> None:
    """Make ``decoder`` selectable by its name and by ``auto`` (a later registration replaces one of the same name)."""
    if not decoder.name or decoder.name in ("auto", "cpu"):
        raise ValueError(f"a hardware decoder needs a name other than 'auto'/'cpu', got {decoder.name!r}")
    with _LOCK:
        _REGISTRY[decoder.name] = decoder
        _REFUSED.difference_update([k for k in _REFUSED if k[0] == decoder.name])


def unregister_decoder(name: str) -> None:
    """Remove a registered decoder (and what it refused)."""
    with _LOCK:
        _REGISTRY.pop(name, None)
        _REFUSED.difference_update([k for k in _REFUSED if k[0] == name])


def registered() -> list[str]:
    """Names of the registered hardware decoders, in registration order."""
    with _LOCK:
        return list(_REGISTRY)


def get_decoder(name: str) -> HardwareDecoder | None:
    with _LOCK:
        return _REGISTRY.get(name)


def note_refusal(name: str, planes: str, depth: int, height: int, width: int) -> None:
    """Remember that ``name`` refused streams of this geometry, so ``auto`` sends them to the CPU directly."""
    with _LOCK:
        _REFUSED.add((name, planes, depth, height, width))


def refused(name: str, planes: str, depth: int, height: int, width: int) -> bool:
    with _LOCK:
        return (name, planes, depth, height, width) in _REFUSED


def select_decoder(
    choice: str, planes: str, depth: int, height: int, width: int, device: torch.device
) -> tuple[HardwareDecoder | None, str | None]:
    """``(decoder, None)`` to use for a stream, or ``(None, reason)`` when it goes to the CPU decoder.

    ``choice``: ``"cpu"`` (never hardware), ``"auto"`` (the first registered decoder that serves
    ``device`` and accepts the stream, skipping geometries it refused before) or a registered name.
    """
    if choice == "cpu":
        return None, "the CPU decoder was asked for"
    if choice != "auto" and get_decoder(choice) is None:
        return None, f"no hardware decoder named {choice!r} is registered"
    names = registered() if choice == "auto" else [choice]
    reasons = []
    for name in names:
        dec = get_decoder(name)
        if dec is None:
            continue
        if device.type not in dec.device_types:
            reasons.append(f"{name} does not write {device.type} tensors")
            continue
        why = dec.refusal(planes, depth, height, width)
        if why is None and choice == "auto" and refused(name, planes, depth, height, width):
            why = f"{name} refused {width}x{height} {planes}/{depth}-bit streams earlier in this process"
        if why is None:
            return dec, None
        reasons.append(why)
    return None, "; ".join(reasons) or "no hardware decoder is registered"
