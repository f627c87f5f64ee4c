"""Answer RAG questions with a vLLM OpenAI server (running the ragkv plugin) instead of the in-process engine.

ragkv still retrieves (its index, embedder and chunk records); the server generates. The prompt is
sent as token ids to ``/v1/completions`` (``[prefix] + [chunk_1 .. chunk_n] + [question]``, exactly as
ragkv assembles it), so each chunk's rows are known; ``kv_transfer_params`` names the chunks with
their store keys and spans, and the server's ``RagkvConnector`` blends their stored KV. Token-id
prompts matter: chat-completion text would be re-tokenized by the server and a chunk's tokens
could merge with its neighbours, which the connector detects and then simply recomputes.

:class:`VllmGenerator` is a :class:`ragkv.rag.RAG`'s generator (:mod:`ragkv.rag.generation`):
``RAG(..., generator=VllmGenerator(VllmClient(url)))`` answers every question, framework call and
completion through the server, with real token streaming over the OpenAI SSE protocol. Any server
that speaks vLLM's ``/v1/completions`` with ``kv_transfer_params`` works: vLLM with the ragkv plugin,
or ragkv's own HTTP service (``python -m ragkv_server.server``, docs/API.md). The transport is httpx (one
connection pool per client) and the stream's events are read by httpx-sse.

Errors are typed: :class:`VllmUnavailableError` (cannot connect, timed out: retry later),
:class:`VllmHTTPError` (the server answered with an error status; ``status`` and its message) and
:class:`VllmResponseError` (a response that is not the OpenAI shape), all :class:`VllmServerError`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import httpx
from httpx_sse import EventSource, SSEError

from ragkv.blend.spans import ChunkRef
from ragkv.defaults import DEFAULT_MAX_NEW_TOKENS, MODES, Mode
from ragkv.generate import SamplingParams, TokenEvent
from ragkv.remote.wire import BlendParams

_SAMPLING = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids")
#: prefill modes a served request can ask for (every one): blend / reuse via the connector; full and
#: prefix send no ragkv parameters (prefix caching is then vLLM's own, which is exact)
SERVED_MODES = MODES


class VllmServerError(RuntimeError):
    """The vLLM server could not be reached or answered with an error."""


class VllmUnavailableError(VllmServerError):
    """No answer: connection refused or reset, or no byte within the timeout (HTTP 503 in the app)."""


class VllmHTTPError(VllmServerError):
    """The server answered with an error status (its message kept; HTTP 502 in the app)."""

    def __init__(self, path: str, status: int, message: str):
        super().__init__(f"{path}: HTTP {status}: {message}")
        self.path, self.status, self.message = path, status, message


class VllmResponseError(VllmServerError):
    """A response that is not the OpenAI completions shape (HTTP 502 in the app)."""


@dataclass
class Completion:
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    kv_transfer_params: dict | None = None
    raw: dict = field(default_factory=dict, repr=False)
    ttft_s: float | None = None
    ragkv: dict = field(default_factory=dict)  # what a ragkv server adds (reuse statistics)


def build_prompt(
    prefix_ids: Sequence[int],
    chunks: Sequence[tuple[str, Sequence[int]]],
    suffix_ids: Sequence[int],
    **options,
) -> tuple[list[int], dict]:
    """``(prompt token ids, kv_transfer_params)`` for ``chunks`` given as ``(store key, token ids)``;
    ``options``: :class:`~ragkv.remote.wire.BlendParams` fields (``mode``, ``ratio``, ``check_layers``,
    ``save``...; their defaults are its own)."""
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
    if "check_layers" in options:
        options["check_layers"] = tuple(options["check_layers"])
    params = BlendParams(tuple(refs), **options)
    return prompt, params.to_kv_transfer_params()


def completion_body(
    model: str,
    prompt: list[int],
    kv_transfer_params: dict | None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    stream: bool = False,
    return_token_ids: bool = False,
) -> dict:
    """JSON body of a ``/v1/completions`` request with a token-id prompt (``return_token_ids``: vLLM's
    option to list the generated token ids in each choice; servers without it ignore it)."""
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
        body["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if stop_token_ids is not None:
        body["stop_token_ids"] = [int(t) for t in stop_token_ids]
    if kv_transfer_params:
        body["kv_transfer_params"] = kv_transfer_params
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if return_token_ids:
        body["return_token_ids"] = True
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
            ragkv=dict(data.get("ragkv") or {}),
        )
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise VllmResponseError(f"unexpected completion response: {str(data)[:300]}") from e


def _error_message(response: httpx.Response) -> str:
    """The message of an OpenAI / vLLM error body (``{"error": {"message"}}`` or ``{"message"}``), else
    its text, else the status's reason."""
    try:
        text = response.read().decode(errors="replace")
    except httpx.HTTPError:
        text = ""
    try:
        body = json.loads(text)
        err = body.get("error", body) if isinstance(body, dict) else body
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:1000]
    except ValueError:
        pass
    return text[:1000] or response.reason_phrase


class VllmClient:
    """Client of a vLLM OpenAI-compatible server (``/v1/models``, ``/v1/completions``, plain and streamed).

    ``connect_timeout``: seconds to open the connection; ``timeout``: seconds the server may stay
    silent once connected (for a whole non-streamed answer, or between two streamed chunks). One
    httpx connection pool per client (:meth:`close` releases it).
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        model: str | None = None,
        api_key: str | None = None,
        timeout: float = 300.0,
        connect_timeout: float = 10.0,
    ):
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[:-3]
        url = httpx.URL(self.base_url)
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"server URL must be http(s)://host[:port], got {base_url!r}")
        if timeout <= 0 or connect_timeout <= 0:
            raise ValueError("timeouts must be positive")
        self.api_key = api_key
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._model = model
        headers = {"Accept": "application/json, text/event-stream"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            trust_env=False,  # the server named here, never a proxy from the environment
        )

    def close(self) -> None:
        """Close the client's connections."""
        self._http.close()

    def __enter__(self) -> VllmClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- transport ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _open(self, path: str, body: dict | None) -> Iterator[httpx.Response]:
        """The open response of a 2xx status, else a typed error; closed after the block."""
        request = self._http.build_request("GET" if body is None else "POST", path, json=body)
        try:
            response = self._http.send(request, stream=True)
        except httpx.TransportError as e:  # refused, reset, timed out (connect or first byte)
            raise VllmUnavailableError(f"{self.base_url}{path}: {type(e).__name__}: {e}") from e
        try:
            if response.status_code >= 300:
                raise VllmHTTPError(path, response.status_code, _error_message(response))
            yield response
        finally:
            response.close()

    def _request(self, path: str, body: dict | None = None) -> dict:
        with self._open(path, body) as response:
            try:
                raw = response.read()
            except httpx.TransportError as e:
                raise VllmUnavailableError(f"{path}: reading the response: {type(e).__name__}: {e}") from e
        return _json_object(raw, f"{path}: response")

    # ---- API ------------------------------------------------------------------------------------
    def models(self) -> list[str]:
        """Names of the served models (``GET /v1/models``)."""
        data = self._request("/v1/models").get("data")
        if not isinstance(data, list) or not all(isinstance(m, dict) and "id" in m for m in data):
            raise VllmResponseError(f"/v1/models: unexpected response {str(data)[:200]}")
        return [str(m["id"]) for m in data]

    @property
    def model(self) -> str:
        """The served model name (the first one the server lists, unless given)."""
        if self._model is None:
            models = self.models()
            if not models:
                raise VllmResponseError("the server lists no models")
            self._model = models[0]
        return self._model

    def _body(self, prompt: list[int], kv_transfer_params: dict | None, stream: bool, sampling: dict) -> dict:
        unknown = set(sampling) - set(_SAMPLING)
        if unknown:
            raise TypeError(f"unknown sampling arguments {sorted(unknown)}")
        return completion_body(
            self.model, prompt, kv_transfer_params, stream=stream, return_token_ids=True, **sampling
        )

    def complete(self, prompt: list[int], kv_transfer_params: dict | None = None, **sampling) -> Completion:
        """One completion of a token-id prompt (not streamed)."""
        body = self._body(prompt, kv_transfer_params, False, sampling)
        t0 = time.perf_counter()
        data = self._request("/v1/completions", body)
        return parse_completion(data, time.perf_counter() - t0)

    def stream(
        self, prompt: list[int], kv_transfer_params: dict | None = None, **sampling
    ) -> Iterator[TokenEvent | Completion]:
        """Stream a completion (``stream: true``, SSE): a :class:`TokenEvent` per chunk with text or
        tokens, then the :class:`Completion` (usage from the final chunk). ``token_id`` is the chunk's
        last token id when the server returns token ids, else -1; the chunk with the finish reason
        gives it to its event (a chunk without text: a closing event, ``token_id`` None)."""
        body = self._body(prompt, kv_transfer_params, True, sampling)
        t0 = time.perf_counter()
        parts: list[str] = []
        finish, usage, ragkv, ttft, last = None, {}, {}, None, None
        with self._open("/v1/completions", body) as response:
            try:
                for event in EventSource(response).iter_sse():
                    if event.data == "[DONE]":
                        break
                    obj = _json_object(event.data, "stream: chunk")
                    if "error" in obj:  # an error after the headers (the server's generation failed)
                        err = obj["error"] if isinstance(obj["error"], dict) else {"message": obj["error"]}
                        raise VllmHTTPError(
                            "/v1/completions", int(err.get("code") or 500), str(err.get("message"))
                        )
                    last = obj
                    usage = obj.get("usage") or usage
                    ragkv = obj.get("ragkv") or ragkv
                    for ch in obj.get("choices") or []:
                        text = ch.get("text") or ""
                        ids = ch.get("token_ids") or []
                        end = ch.get("finish_reason")
                        finish = end or finish
                        if text or ids:
                            ttft = ttft if ttft is not None else time.perf_counter() - t0
                            yield TokenEvent(int(ids[-1]) if ids else -1, text, len(parts), end)
                            parts.append(text)
                        elif end:  # a final chunk without text: a closing event with the finish reason
                            yield TokenEvent(None, "", len(parts), end)
                else:
                    raise VllmResponseError("stream: the server closed it before 'data: [DONE]'")
            except httpx.TimeoutException as e:
                raise VllmUnavailableError("stream: no chunk within the timeout") from e
            except httpx.TransportError as e:
                raise VllmUnavailableError(f"stream: connection lost: {type(e).__name__}: {e}") from e
            except SSEError as e:  # a 2xx answer that is not an event stream
                raise VllmResponseError(f"stream: {e}") from e
        total = time.perf_counter() - t0
        yield Completion(
            text="".join(parts),
            finish_reason=finish,
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", len(parts))),
            seconds=total,
            kv_transfer_params=(last or {}).get("kv_transfer_params"),
            raw=last or {},
            ttft_s=ttft if ttft is not None else total,
            ragkv=dict(ragkv),
        )


def _json_object(raw: bytes | str, what: str) -> dict:
    """``raw`` parsed as a JSON object; :class:`VllmResponseError` (naming ``what``) when it is not one."""
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise VllmResponseError(f"{what} is not JSON: {raw[:200]!r}") from e
    if not isinstance(data, dict):
        raise VllmResponseError(f"{what} is not a JSON object: {raw[:200]!r}")
    return data


# ---- the RAG generator ---------------------------------------------------------------------------------
def served_params(params: SamplingParams) -> dict:
    """Client sampling arguments of ragkv's :class:`SamplingParams`."""
    out = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "seed": params.seed,
        "stop": list(params.stop),
    }
    if params.stop_token_ids is not None:
        out["stop_token_ids"] = list(params.stop_token_ids)
    return out


class VllmGenerator:
    """A :class:`ragkv.rag.RAG`'s generation on a vLLM OpenAI server with the ragkv plugin (or ragkv's
    own service): ``RAG(..., generator=VllmGenerator(client))``.

    The RAG keeps what is local: tokenizing, retrieval, the prompt, the index and the chunk KV it
    precomputes at ingest into the store the server reads. The prompt goes as token ids;
    ``kv_transfer_params`` names each stored chunk in it by key and span. A chunk that a flat prompt
    cut at its ends is sent as plain text (the connector checks a key against the prompt's tokens).
    The server must serve the checkpoint and dtype the KV was stored with (the connector checks the
    model fingerprint; other KV is recomputed, never used).
    """

    name = "vllm"

    def __init__(self, client: VllmClient, check_layers: Sequence[int] = (1,), save: bool = True):
        self.client = client
        self.check_layers = tuple(check_layers)
        self.save = save

    def kv_transfer_params(self, job) -> dict | None:
        """The connector's parameters for ``job``: its chunks; none named for modes that reuse
        nothing (``full``, ``prefix``: an exact prefill, where a ragkv server would otherwise locate
        stored chunks in the prompt); None when a reusing job has no whole chunk (the server may
        locate them itself)."""
        from ragkv.rag.generation import OptionNotServedError

        if not Mode(job.mode).reuses:
            return BlendParams((), save=False).to_kv_transfer_params()
        whole = [c for c in job.chunks if c.lo == 0 and c.hi == len(c.token_ids)]
        if not whole:
            return None
        sched = job.schedule
        ratio = sched.target_ratio if sched is not None else job.ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
            raise OptionNotServedError(f"ratio must be a number for vLLM serving, got {ratio!r}")
        opts = {"check_layers": self.check_layers}
        if sched is not None and (sched.ape_temperature, sched.ape_scale) != (1.0, 1.0):
            raise OptionNotServedError("APE tempering (ape_temperature/ape_scale) is not served by vLLM")
        if sched is not None:
            opts = {
                "check_layers": tuple(sched.check_layers),
                "deviation": sched.deviation,
                "fresh_check_kv": sched.fresh_check_kv,
            }
        refs = tuple(ChunkRef(c.key, c.start, len(c.token_ids)) for c in whole)
        params = BlendParams(refs, mode=job.mode, ratio=float(ratio), save=self.save or job.save, **opts)
        return params.to_kv_transfer_params()

    def stream(self, rag, job) -> Iterator:
        """Token events as the server streams them, then a :class:`ragkv.rag.generation.Generated`."""
        from ragkv.blend import UnknownModeError
        from ragkv.rag.generation import Generated

        if job.mode not in SERVED_MODES:
            raise UnknownModeError(f"unknown mode {job.mode!r}; use one of {SERVED_MODES}")
        if job.params.constraint is not None or job.params.logprobs is not None:
            from ragkv.rag.generation import OptionNotServedError

            raise OptionNotServedError(
                "structured output and logprobs are computed in process: not with a vLLM server"
            )
        kv = self.kv_transfer_params(job)
        if job.params.max_new_tokens == 0:
            yield TokenEvent(None, "", 0, "length")
            yield Generated("", [], "length", job.mode, {"backend": "vllm"})
            return
        out: list[int] = []
        for item in self.client.stream(job.prompt_ids, kv, **served_params(job.params)):
            if not isinstance(item, Completion):
                if item.is_token:
                    out.append(item.token_id)
                yield item
                continue
            counters = rag.counters  # a server that reports its chunk hits (ragkv's) feeds ours
            for name in ("kv_hits", "kv_misses", "kv_recomputed_bad"):
                if isinstance(item.ragkv.get(name), int) and name in counters:
                    counters[name] += item.ragkv[name]
            stats = {
                **item.ragkv,
                "num_tokens": item.prompt_tokens,
                "completion_tokens": item.completion_tokens,
                "finish_reason": item.finish_reason,
                "backend": "vllm",
                "server_model": item.raw.get("model"),
            }
            yield Generated(
                item.text,
                out,
                item.finish_reason,
                str(item.ragkv.get("mode") or job.mode),
                stats,
                kv_fetch_s=float(item.ragkv.get("t_load_wait_s", 0.0)),
                timings={"server_s": item.seconds},
            )

    def close(self) -> None:
        self.client.close()
