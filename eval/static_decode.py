"""Static-shape greedy decode that can be captured as a CUDA graph or compiled with ``torch.compile``.

:func:`ragkv.generate.decode_step` grows a :class:`~ragkv.attention.kvcache.DenseKVCache` by doubling
and slices it to the current length, so every step has new shapes and a graph cannot be replayed;
on a GPU, a small model's per-token time is then mostly Python and kernel launches. Here the KV of
every layer lives in fixed ``[capacity, Hkv, D]`` buffers, the step's inputs (token, position, row)
are device tensors written in place, and attention runs over all ``capacity`` rows with unwritten
rows masked out by a position that no query reaches. One step is :class:`StaticDecoder`'s
``forward`` (an ``nn.Module``): the same layer loop as ``decode_step``
(:func:`ragkv.model.forward.run_layers`) with the static buffers as its K/V, so on the CPU it returns
the same logits and tokens as the growing cache (tested).

Deviation from a fused decode kernel: attention reads the whole static buffer every step (masked),
so its cost is that of ``capacity`` rows, not of the rows written so far; choose ``capacity`` close
to prompt + new tokens. One sequence (batch 1) only: the case where launch overhead dominates.
"""

from __future__ import annotations

import torch
from torch import nn

from ragkv.attention.dense import attention
from ragkv.model.forward import run_layers

#: position of unwritten rows: larger than any query position, so ``k_pos <= q_pos`` masks them
_NEVER = 2**62


class StaticDecoder(nn.Module):
    """One-token decode step of ``model`` over static KV buffers; see the module docstring."""

    def __init__(self, model, capacity: int):
        super().__init__()
        c = model.config
        self.model = model  # a plain object: its weights are used in place, not copied
        self.capacity = int(capacity)
        shape = (c.num_layers, self.capacity, c.num_kv_heads, c.head_dim)
        dev = model.device
        # zeros, not empty: masked rows still enter the P@V product as 0 * value, and garbage NaNs would poison it
        self.register_buffer("k", torch.zeros(shape, dtype=model.dtype, device=dev), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=model.dtype, device=dev), persistent=False)
        self.register_buffer(
            "k_pos", torch.full((self.capacity,), _NEVER, dtype=torch.long, device=dev), persistent=False
        )
        # the step's inputs, updated in place so that a captured graph sees them
        self.register_buffer("token", torch.zeros(1, dtype=torch.long, device=dev), persistent=False)
        self.register_buffer("position", torch.zeros(1, dtype=torch.long, device=dev), persistent=False)
        self.register_buffer("row", torch.zeros(1, dtype=torch.long, device=dev), persistent=False)
        self.length = 0
        self._graph = None
        self._graph_logits: torch.Tensor | None = None

    def reset(self) -> None:
        """Forget every row (buffers keep their addresses, so a captured graph stays valid)."""
        self.k_pos.fill_(_NEVER)
        self.k.zero_()
        self.v.zero_()
        self.length = 0

    @torch.inference_mode()
    def load_prompt(self, result) -> None:
        """Write a prefill's KV (a :class:`ragkv.blend.core.PrefillResult`) into rows ``[0, n)``."""
        kv = result.kv
        n = kv.num_tokens
        if n >= self.capacity:
            raise ValueError(f"a {n}-token prompt leaves no room in a {self.capacity}-row static cache")
        self.reset()
        self.k[:, :n] = kv.k.to(self.k.device, self.k.dtype)
        self.v[:, :n] = kv.v.to(self.v.device, self.v.dtype)
        self.k_pos[:n] = kv.positions.to(self.k_pos.device)
        self.length = n

    def forward(self) -> torch.Tensor:
        """Decode ``self.token`` at ``self.position`` into row ``self.row``; returns fp32 logits ``[vocab]``.

        No host synchronisation and fixed shapes throughout, so it can be captured and replayed.
        """
        m = self.model
        self.k_pos.index_copy_(0, self.row, self.position)
        h, _ = run_layers(m, m.embed(self.token), self.position, self)
        return m.logits(h)[0].float()

    # ---- the step's LayerKV (ragkv.model.forward): in-place writes, attention over every row ----
    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, self.row, k)
        self.v[layer].index_copy_(0, self.row, v)

    def attend(self, layer: int, q: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        m = self.model
        return attention(
            q, self.k[layer], self.v[layer], q_pos, self.k_pos, m.scale, sliding_window=m.config.window(layer)
        )

    def _set_inputs(self, token_id: int, position: int) -> None:
        if self.length >= self.capacity:
            raise ValueError(f"the static cache is full ({self.capacity} rows)")
        self.token.fill_(int(token_id))
        self.position.fill_(int(position))
        self.row.fill_(self.length)

    @torch.inference_mode()
    def step(self, token_id: int, position: int) -> torch.Tensor:
        """One eager step (same math as :func:`ragkv.generate.decode_step`); appends the token's KV."""
        self._set_inputs(token_id, position)
        logits = self.forward()
        self.length += 1
        return logits

    @torch.inference_mode()
    def capture(self, warmup: int = 2) -> None:
        """Capture :meth:`forward` as a CUDA graph (CUDA models only); :meth:`replay` then runs it.

        Warm-up runs write row ``capacity - 1`` (reset by :meth:`load_prompt` / :meth:`reset`), so
        capture after construction and before loading a prompt.
        """
        if self.k.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA model")
        self.row.fill_(self.capacity - 1)
        side = torch.cuda.Stream(device=self.k.device)
        side.wait_stream(torch.cuda.current_stream(self.k.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.forward()
        torch.cuda.current_stream(self.k.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._graph_logits = self.forward()
        self._graph = graph
        self.reset()

    @torch.inference_mode()
    def replay(self, token_id: int, position: int) -> torch.Tensor:
        """One step through the captured graph; the returned logits are overwritten by the next replay."""
        if self._graph is None:
            raise RuntimeError("call capture() first")
        self._set_inputs(token_id, position)
        self._graph.replay()
        self.length += 1
        return self._graph_logits

    def greedy(self, result, max_new_tokens: int, use_graph: bool = False) -> list[int]:
        """Greedy tokens after ``result``'s prefill (no stop tokens): the decode loop benchmarks time."""
        self.load_prompt(result)
        n = result.kv.num_tokens
        tok = int(result.logits.argmax())
        out = [tok]
        run = self.replay if use_graph else self.step
        for i in range(max_new_tokens - 1):
            tok = int(run(tok, n + i).argmax())
            out.append(tok)
        return out
