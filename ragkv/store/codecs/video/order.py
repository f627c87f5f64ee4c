"""Token order of the frame chain: a similarity path, so consecutive frames hold similar tokens.

Measured on real KV (docs/VIDEO_CODEC.md): in the small trained models here, the delta between a
token and the *previous* token has a higher entropy than the quantized values themselves, so the
paper's "token order = frame order" gives inter prediction nothing to work with. A greedy
nearest-neighbour path over the quantized token vectors makes the temporal predecessor of each
tile a similar token; the permutation costs ``ceil(log2 T)`` bits per token and layer order.
"""

from __future__ import annotations

import numpy as np
import torch

#: token vectors wider than this are randomly projected first (distances roughly kept, cost bounded)
PROJECT_DIM = 256


def greedy_chain(x: np.ndarray, seed: int = 0) -> np.ndarray:
    """Permutation ``order`` (chain position -> token) of rows of ``x [T, C]``: greedy nearest neighbour.

    Starts at token 0 and always moves to the closest unvisited token (L2 on the integers).
    """
    t = x.shape[0]
    if t <= 2:
        return np.arange(t)
    a = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    if a.shape[1] > PROJECT_DIM:
        g = torch.Generator().manual_seed(seed)
        a = a @ torch.randn(a.shape[1], PROJECT_DIM, generator=g) / PROJECT_DIM**0.5
    sq = (a * a).sum(1)
    d = (sq[:, None] + sq[None, :] - 2.0 * (a @ a.T)).numpy()
    np.fill_diagonal(d, np.inf)
    order = np.zeros(t, dtype=np.int64)  # the chain starts at token 0
    d[:, 0] = np.inf
    for i in range(1, t):
        order[i] = np.argmin(d[order[i - 1]])
        d[:, order[i]] = np.inf
    return order


def index_bits(tokens: int) -> int:
    """Bits per stored token index."""
    return max(1, (tokens - 1).bit_length())


def pack_orders(orders: np.ndarray, tokens: int) -> bytes:
    """Bit-pack permutations ``[n, T]`` at :func:`index_bits` bits per entry."""
    nb = index_bits(tokens)
    flat = orders.reshape(-1).astype(np.int64)
    bits = ((flat[:, None] >> np.arange(nb - 1, -1, -1)) & 1).astype(np.uint8)
    return np.packbits(bits.reshape(-1)).tobytes()


def packed_size(count: int, tokens: int) -> int:
    return (count * tokens * index_bits(tokens) + 7) // 8


def unpack_orders(data: bytes, count: int, tokens: int) -> np.ndarray:
    """Inverse of :func:`pack_orders`; raises ``ValueError`` unless every row is a permutation."""
    nb = index_bits(tokens)
    if len(data) != packed_size(count, tokens):
        raise ValueError("token order section has the wrong length")
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))[: count * tokens * nb]
    vals = (bits.reshape(count * tokens, nb).astype(np.int64) << np.arange(nb - 1, -1, -1)).sum(1)
    orders = vals.reshape(count, tokens)
    if not (np.sort(orders, axis=1) == np.arange(tokens)).all():
        raise ValueError("token order section is not a permutation")
    return orders
