"""Adaptive resolution (KVFetcher Algorithm 1) and a bandwidth-limited fetch simulator to exercise it.

Each chunk is stored in several resolution versions (token slots per frame). Smaller frames give
smaller videos (cheaper transfer) but decode slower (more frames, less parallelism per frame);
before fetching each chunk, :func:`choose_version` picks the version whose transfer time best matches
its decode time plus any switching penalty, ``argmin_r |S_r / B - t_dec(r, load) - t_pen(r)|``, with
``B`` estimated from the last transfer. Decode times come from :func:`profile_decode` run on this
machine (the paper's H20/L20/A100 tables do not transfer to other hardware).

The simulator runs on a virtual clock: a :class:`TokenBucket` link (piecewise-constant rate trace
plus a burst allowance) serializes transfers of the bytes actually read from a store, while
decoders take the chunks as they arrive; decode durations are measured for real (or looked up in
the profile for a deterministic run).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from ragkv.store.codecs.video.codec import VideoCodec


@dataclass
class VersionProfile:
    """One resolution version: mean bytes per chunk, decode seconds per chunk by pool load, switch penalty."""

    slots: int
    size_bytes: float
    decode_s: dict[int, float]
    penalty_s: float = 0.0


@dataclass
class DecodeProfile:
    """Per-machine decode-time table (the paper's Tables 1-3, measured here instead)."""

    versions: dict[int, VersionProfile]

    def decode_time(self, slots: int, load: int = 1) -> float:
        """Seconds to decode one chunk of ``slots`` with ``load`` concurrent decodes (nearest measured load)."""
        table = self.versions[slots].decode_s
        loads = sorted(table)
        below = [x for x in loads if x <= load]
        return table[below[-1] if below else loads[0]]

    def to_json(self) -> dict:
        return {str(s): asdict(v) for s, v in self.versions.items()}

    @classmethod
    def from_json(cls, obj: dict) -> DecodeProfile:
        vs = {}
        for key, v in obj.items():
            vs[int(key)] = VersionProfile(
                slots=int(v["slots"]), size_bytes=float(v["size_bytes"]),
                decode_s={int(a): float(b) for a, b in v["decode_s"].items()}, penalty_s=float(v["penalty_s"]),
            )  # fmt: skip
        return cls(vs)


def encode_chunk_versions(
    codec: VideoCodec, k: torch.Tensor, v: torch.Tensor, versions: Sequence[int]
) -> dict[int, list[bytes]]:
    """All layer-group segments of one chunk ``[L, T, Hkv, D]`` for every version."""
    out: dict[int, list[bytes]] = {int(s): [] for s in versions}
    for start, stop in codec.groups(k.shape[0]):
        segs = codec.encode_versions(k[start:stop], v[start:stop], versions, layer_start=start)
        for s, data in segs.items():
            out[s].append(data)
    return out


def decode_chunk(codec: VideoCodec, segments: Sequence[bytes], device: str | torch.device = "cpu") -> None:
    """Decode every segment of a chunk into fresh output tensors (what a fetch has to do)."""
    for data in segments:
        codec.decode(data, device=device)


def profile_decode(
    codec: VideoCodec,
    samples: Sequence[tuple[torch.Tensor, torch.Tensor]],
    versions: Sequence[int],
    loads: Sequence[int] = (1, 2),
    repeats: int = 3,
) -> DecodeProfile:
    """Measure decode seconds per chunk for each version and pool load, and the switching penalty.

    ``samples`` are whole chunks ``(k, v) [L, T, Hkv, D]``. Load ``n`` runs ``n`` decodes at once in
    threads (PyAV releases the GIL while decoding) and records the wall time of the batch. The
    penalty is how much slower a version decodes right after another version than after itself
    (clamped at 0; on the CPU every segment opens a fresh decoder, so it is near zero).
    """
    enc = [encode_chunk_versions(codec, k, v, versions) for k, v in samples]
    profile: dict[int, VersionProfile] = {}
    for s in versions:
        size = statistics.mean(sum(len(b) for b in chunk[s]) for chunk in enc)
        table = {}
        for load in loads:
            times = []
            for r in range(repeats):
                chunk = enc[r % len(enc)][s]
                times.append(_concurrent_wall(codec, [chunk] * load))
            table[int(load)] = statistics.median(times)
        profile[int(s)] = VersionProfile(slots=int(s), size_bytes=float(size), decode_s=table)
    if len(versions) > 1:
        for s in versions:
            other = next(x for x in versions if x != s)
            same, switched = [], []
            for r in range(repeats):
                chunk = enc[r % len(enc)]
                decode_chunk(codec, chunk[s])
                t0 = time.perf_counter()
                decode_chunk(codec, chunk[s])
                same.append(time.perf_counter() - t0)
                decode_chunk(codec, chunk[other])
                t0 = time.perf_counter()
                decode_chunk(codec, chunk[s])
                switched.append(time.perf_counter() - t0)
            profile[int(s)].penalty_s = max(0.0, statistics.median(switched) - statistics.median(same))
    return DecodeProfile(profile)


def _concurrent_wall(codec: VideoCodec, chunks: Sequence[Sequence[bytes]]) -> float:
    threads = [threading.Thread(target=decode_chunk, args=(codec, c)) for c in chunks]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def choose_version(
    profile: DecodeProfile,
    bandwidth_bps: float,
    load: int = 1,
    current: int | None = None,
    sizes: dict[int, int] | None = None,
) -> int:
    """Algorithm 1: the version minimizing ``|transfer - decode - switching penalty|``.

    ``bandwidth_bps`` is in bytes per second; ``sizes`` (bytes per version of the chunk about to be
    fetched) default to the profile's mean sizes; the penalty applies only to a version other than
    ``current``.

    Deviation: versions that another version beats on both size and decode time are dropped
    first. The paper's versions trade size against decode speed (lower resolution = smaller but
    slower), where balancing the two stages is right; here a version can be both smaller and
    faster (measured: 16 slots vs 4 on short chunks), and balancing would then pick a dominated one.
    """
    if bandwidth_bps <= 0:
        raise ValueError("bandwidth estimate must be positive")
    size_of = {s: (sizes or {}).get(s, vp.size_bytes) for s, vp in profile.versions.items()}
    dec_of = {s: profile.decode_time(s, load) for s in profile.versions}
    pareto = [
        s
        for s in profile.versions
        if not any(
            size_of[o] <= size_of[s]
            and dec_of[o] <= dec_of[s]
            and (size_of[o], dec_of[o]) != (size_of[s], dec_of[s])
            for o in profile.versions
        )
    ]
    best, best_delta = None, float("inf")
    for s in sorted(pareto):
        vp = profile.versions[s]
        size = size_of[s]
        t_trans = size / bandwidth_bps
        t_dec = profile.decode_time(s, load)
        t_pen = vp.penalty_s if current is not None and s != current else 0.0
        delta = abs(t_trans - t_dec - t_pen)
        if delta < best_delta:
            best, best_delta = s, delta
    assert best is not None
    return best


class BandwidthEstimator:
    """Bandwidth from the last transfer (the paper's estimator); ``alpha < 1`` smooths it (EWMA)."""

    def __init__(self, initial_bps: float, alpha: float = 1.0) -> None:
        if initial_bps <= 0 or not 0 < alpha <= 1:
            raise ValueError("initial bandwidth must be positive and 0 < alpha <= 1")
        self.estimate = float(initial_bps)
        self.alpha = alpha

    def update(self, nbytes: int, seconds: float) -> float:
        if seconds > 0 and nbytes > 0:
            self.estimate = self.alpha * (nbytes / seconds) + (1 - self.alpha) * self.estimate
        return self.estimate


class TokenBucket:
    """A link whose rate follows ``trace`` ``[(start_s, bytes_per_s), ...]``, with ``burst`` bytes of credit.

    Credit accrues at the current rate while the link is idle, up to ``burst``; a transfer spends
    credit first, then drains at the rate in force (piecewise, across trace changes).
    """

    def __init__(self, trace: Sequence[tuple[float, float]], burst_bytes: float = 0.0) -> None:
        if not trace or trace[0][0] != 0 or any(r <= 0 for _, r in trace):
            raise ValueError("trace must start at t=0 with positive rates")
        if any(b[0] <= a[0] for a, b in zip(trace, trace[1:], strict=False)):
            raise ValueError("trace start times must increase")
        self.trace = [(float(t), float(r)) for t, r in trace]
        self.burst = float(burst_bytes)
        self._tokens = self.burst
        self._t = 0.0

    def rate(self, t: float) -> float:
        r = self.trace[0][1]
        for start, rate in self.trace:
            if start <= t:
                r = rate
        return r

    def _next_change(self, t: float) -> float:
        return next((s for s, _ in self.trace if s > t), float("inf"))

    def send(self, nbytes: int, start: float) -> float:
        """Virtual time at which ``nbytes`` sent from ``start`` (>= the end of the previous send) arrive."""
        start = max(start, self._t)
        t = self._t
        while t < start and self._tokens < self.burst:  # idle: bank credit
            seg_end = min(start, self._next_change(t))
            self._tokens = min(self.burst, self._tokens + (seg_end - t) * self.rate(t))
            t = seg_end
        left = float(nbytes)
        used = min(left, self._tokens)
        self._tokens -= used
        left -= used
        t = start
        while left > 1e-9:
            r = self.rate(t)
            seg_end = self._next_change(t)
            can = (seg_end - t) * r
            if can >= left:
                t += left / r
                left = 0.0
            else:
                left -= can
                t = seg_end
        self._t = t
        return t


@dataclass
class ChunkFetch:
    index: int
    slots: int
    nbytes: int
    sent_s: float
    arrived_s: float
    decode_start_s: float
    decoded_s: float
    bubble_s: float  # decoder idle time waiting for this chunk's bytes


@dataclass
class FetchReport:
    policy: str
    chunks: list[ChunkFetch] = field(default_factory=list)

    @property
    def total_s(self) -> float:
        return max((c.decoded_s for c in self.chunks), default=0.0)

    @property
    def total_bytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    @property
    def bubble_s(self) -> float:
        return sum(c.bubble_s for c in self.chunks)

    def versions_used(self) -> list[int]:
        return [c.slots for c in self.chunks]


def simulate_fetch(
    num_chunks: int,
    fetch: Callable[[int, int], bytes],
    decode_seconds: Callable[[int, int, bytes], float],
    link: TokenBucket,
    policy: int | str,
    profile: DecodeProfile,
    initial_bps: float,
    decoders: int = 1,
) -> FetchReport:
    """Fetch ``num_chunks`` chunks over ``link`` and decode them on ``decoders`` decoders (virtual clock).

    ``fetch(i, slots)`` returns chunk ``i``'s bytes in that version (read from a store);
    ``decode_seconds(i, slots, data)`` decodes them and returns the seconds it took (measured, or
    looked up). ``policy`` is ``"adaptive"`` (Algorithm 1) or a fixed version.
    """
    if policy != "adaptive" and policy not in profile.versions:
        raise ValueError(f"policy must be 'adaptive' or one of {sorted(profile.versions)}")
    est = BandwidthEstimator(initial_bps)
    free = [0.0] * decoders
    report = FetchReport(policy=str(policy))
    t_link = 0.0
    current: int | None = None
    for i in range(num_chunks):
        load = max(1, sum(1 for f in free if f > t_link))
        slots = choose_version(profile, est.estimate, load, current) if policy == "adaptive" else int(policy)
        data = fetch(i, slots)
        sent = t_link
        arrived = link.send(len(data), sent)
        t_link = arrived
        est.update(len(data), arrived - sent)
        dur = decode_seconds(i, slots, data)
        j = min(range(decoders), key=lambda x: free[x])
        start = max(arrived, free[j])
        bubble = max(0.0, arrived - free[j]) if i >= decoders else 0.0
        free[j] = start + dur
        report.chunks.append(ChunkFetch(i, slots, len(data), sent, arrived, start, free[j], bubble))
        current = slots
    return report
