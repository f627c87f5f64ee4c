"""Answer RAG questions with a vLLM OpenAI server (running the ragkv plugin) instead of the in-process engine.

ragkv still retrieves (its index, embedder and chunk records); the server generates. The prompt is
sent as token ids to ``/v1/completions`` (``[prefix] + [chunk_1 .. chunk_n] + [question]``, exactly as
ragkv assembles it), so each chunk's rows are known; ``kv_transfer_params`` names the chunks with
their store keys and spans, and the server's ``RagkvConnector`` blends their stored KV. Token-id
prompts matter: chat-completion text would be re-tokenized by the server and a chunk's tokens
could merge with its neighbours, which the connector detects and then simply recomputes.

:class:`VllmRAG` has the ``answer(question, k, mode, ratio, chunks=..., **sampling) -> RagAnswer``
shape of :class:`ragkv.rag.RAG`, so code written against ``RAG.answer`` (the LangChain and
LlamaIndex wrappers, the FastAPI app) can be pointed at it. Stdlib HTTP only (no new dependency).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

from ragkv.blend.spans import BlendParams, ChunkRef

_SAMPLING = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")


class VllmServerError(RuntimeError):
    """The vLLM server could not be reached or answered with an error."""


@dataclass
class Completion:
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    kv_transfer_params: dict | None = None
    raw: dict = field(default_factory=dict, repr=False)


def build_prompt(
    prefix_ids: Sequence[int],
    chunks: Sequence[tuple[str, Sequence[int]]],
    suffix_ids: Sequence[int],
    mode: str = "blend",
    ratio: float = 0.15,
    check_layers: Sequence[int] = (1,),
    save: bool = True,
) -> tuple[list[int], dict]:
    """``(prompt token ids, kv_transfer_params)`` for ``chunks`` given as ``(store key, token ids)``."""
    prompt = [int(t) for t in prefix_ids]
    refs = []
    for key, toks in chunks:
        toks = [int(t) for t in toks]
        if not toks:
            raise ValueError(f"chunk {key[:16]} has no tokens")
        refs.append(ChunkRef(key, len(prompt), len(toks)))
        prompt += toks
    prompt += [int(t) for t in suffix_ids]
    if not prompt:
        raise ValueError("empty prompt")
    params = BlendParams(tuple(refs), mode=mode, ratio=ratio, check_layers=tuple(check_layers), save=save)
    return prompt, params.to_kv_transfer_params()


def completion_body(
    model: str,
    prompt: list[int],
    kv_transfer_params: dict | None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] | None = None,
) -> dict:
    """JSON body of a ``/v1/completions`` request with a token-id prompt."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    body: dict = {
        "model": model,
        "prompt": prompt,
        "max_tokens": int(max_new_tokens),
        "temperature": float(temperature),
        "top_p": float(top_p),
    }
    if top_k is not None and top_k > 0:
        body["top_k"] = int(top_k)
    if seed is not None:
        body["seed"] = int(seed)
    if stop:
        body["stop"] = list(stop)
    if kv_transfer_params:
        body["kv_transfer_params"] = kv_transfer_params
    return body


def parse_completion(data: dict, seconds: float = 0.0) -> Completion:
    """A :class:`Completion` from a ``/v1/completions`` JSON response."""
    try:
        choice = data["choices"][0]
        usage = data.get("usage") or {}
        return Completion(
            text=choice["text"],
            finish_reason=choice.get("finish_reason"),
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", 0)),
            seconds=seconds,
            kv_transfer_params=data.get("kv_transfer_params"),
            raw=data,
        )
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise VllmServerError(f"unexpected completion response: {str(data)[:300]}") from e


class VllmClient:
    """Minimal client of a vLLM OpenAI-compatible server (``/v1/models``, ``/v1/completions``)."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        model: str | None = None,
        api_key: str | None = None,
        timeout: float = 300.0,
    ):
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        self.api_key = api_key
        self.timeout = timeout
        self._model = model

    def _request(self, path: str, body: dict | None = None) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.base_url + path, data=data, headers=headers, method="POST" if body is not None else "GET"
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise VllmServerError(f"{path}: HTTP {e.code}: {detail}") from e
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise VllmServerError(f"{path}: {type(e).__name__}: {e}") from e

    @property
    def model(self) -> str:
        """The served model name (the first one the server lists, unless given)."""
        if self._model is None:
            models = self._request("/v1/models").get("data") or []
            if not models:
                raise VllmServerError("the server lists no models")
            self._model = models[0]["id"]
        return self._model

    def complete(self, prompt: list[int], kv_transfer_params: dict | None = None, **sampling) -> Completion:
        unknown = set(sampling) - set(_SAMPLING)
        if unknown:
            raise TypeError(f"unknown sampling arguments {sorted(unknown)}")
        body = completion_body(self.model, prompt, kv_transfer_params, **sampling)
        t0 = time.perf_counter()
        data = self._request("/v1/completions", body)
        return parse_completion(data, time.perf_counter() - t0)


class VllmRAG:
    """ragkv retrieval + generation by a vLLM server with the ragkv plugin (same ``answer`` as ``RAG``).

    The server must serve the same checkpoint and dtype that ragkv used to store the chunk KV
    (the connector checks the model fingerprint; other KV is never used, only recomputed).
    """

    def __init__(self, rag, client: VllmClient, check_layers: Sequence[int] = (1,), save: bool = True):
        self.rag = rag
        self.client = client
        self.check_layers = tuple(check_layers)
        self.save = save

    def answer(
        self,
        question: str,
        k: int | None = None,
        mode: str | None = None,
        ratio: float | None = None,
        chunks: list | None = None,
        **sampling,
    ):
        from ragkv.rag import RagAnswer, prompt_parts

        mode = mode or self.rag.mode
        if mode not in ("blend", "reuse", "full"):
            raise ValueError(f"mode {mode!r} is not served through vLLM (blend, reuse or full)")
        ratio = self.rag.ratio if ratio is None else ratio
        if not isinstance(ratio, (int, float)):
            raise ValueError(f"ratio must be a number for vLLM serving, got {ratio!r}")
        t0 = time.perf_counter()
        recs = chunks if chunks is not None else self.rag.retrieve(question, k)
        t_ret = time.perf_counter() - t0
        prefix, suffix = prompt_parts(self.rag.model, question)
        pairs = [(r.kv_key, r.token_ids) for r in recs]
        prompt, params = build_prompt(
            prefix,
            pairs,
            suffix,
            mode="blend" if mode == "full" else mode,
            ratio=float(ratio),
            check_layers=self.check_layers,
            save=self.save,
        )
        out = self.client.complete(prompt, None if mode == "full" else params, **sampling)
        return RagAnswer(
            text=out.text,
            sources=list(recs),
            mode=mode,
            timings={
                "retrieval_s": t_ret,
                "kv_fetch_s": 0.0,
                "ttft_s": float("nan"),
                "total_s": time.perf_counter() - t0,
                "server_s": out.seconds,
            },
            stats={
                "prompt_tokens": out.prompt_tokens,
                "completion_tokens": out.completion_tokens,
                "finish_reason": out.finish_reason,
                "backend": "vllm",
            },
        )
