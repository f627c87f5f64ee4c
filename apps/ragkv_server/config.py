"""Service settings: defaults < config file (TOML / YAML / JSON) < ``RAGKV_*`` env vars < explicit overrides.

The config file is named by ``--config PATH`` or ``RAGKV_CONFIG``; its keys are the field names
below (unknown keys are an error). Env vars are the upper-cased names with the ``RAGKV_`` prefix,
e.g. ``RAGKV_STORE=redis://localhost:6379/0`` or ``RAGKV_MAX_CONCURRENCY=4``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from ragkv import DEFAULT_MODEL  # a model name, resolved by ragkv.load_model
from ragkv.defaults import (
    CHUNK_ORDERS,
    DEFAULT_ADAPTER,
    DEFAULT_CHUNK_ORDER,
    DEFAULT_FIDELITY,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MODE,
    MODES,
)
from ragkv.fidelity import parse_fidelity
from ragkv.fidelity.plan import RequestSettings
from ragkv.rag.collections import COLLECTION_PATTERN
from ragkv.rag.quotas import DEFAULT_MAX_DOCUMENT_TOKENS, Quotas
from ragkv.store.codecs import DEFAULT_CODEC

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
MIN_API_KEY_CHARS = 16
#: a list setting from a config file (a list) or an env var (JSON list, or comma-separated)
StrList = Annotated[list[str], NoDecode]
#: most collections one API key may be limited to
MAX_KEY_COLLECTIONS = 256


class ApiKey(BaseModel):
    """An API key, optionally limited to some collections. In settings a plain string is a key that
    sees every collection; ``{"key": ..., "collections": [...]}`` one limited to those collections
    (its first is where its requests go when they name none)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    key: SecretStr
    collections: tuple[Annotated[str, Field(pattern=COLLECTION_PATTERN)], ...] | None = Field(
        None, min_length=1, max_length=MAX_KEY_COLLECTIONS
    )

    @model_validator(mode="before")
    @classmethod
    def _plain(cls, v: Any) -> Any:
        """A plain string (or secret) is an unlimited key: the settings' old form."""
        return {"key": v} if isinstance(v, (str, SecretStr)) else v


KeyList = Annotated[list[ApiKey], NoDecode]


class ConfigError(ValueError):
    """A config file that cannot be read, or settings that do not make sense together."""


class Settings(BaseSettings):
    """Everything the service, ``ragkv-server ingest`` and ``ragkv-server ask`` need (see the module docstring)."""

    model_config = SettingsConfigDict(env_prefix="RAGKV_", extra="forbid", protected_namespaces=())

    # model
    model: str = Field(
        DEFAULT_MODEL,
        description="model name (default: the real default model, fetched on first use), GGUF file, local folder or hub id of a Llama / Mistral / Qwen2 model",
    )
    served_model_name: str | None = Field(None, description="model name reported by the OpenAI API")
    dtype: str = "float32"
    device: str = "cpu"
    decode_weights: str | None = Field(
        None,
        description="what decode steps read: auto (default: the GGUF file's own low-bit blocks where the model is "
        "one), gguf, float32, or q8_0 / q4_1 / q4_0 (another checkpoint's weights quantized for decode); "
        "prefill always uses float32 weights",
    )
    torch_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads (None: torch's default)"
    )
    vllm_url: str | None = Field(None, description="base URL of the vLLM server (generation='vllm')")
    vllm_model: str | None = Field(
        None, description="model name on the vLLM server (None: its first listed model)"
    )
    vllm_api_key: SecretStr | None = Field(None, description="bearer token for the vLLM server")
    vllm_timeout_s: float = Field(
        300.0,
        gt=0,
        description="longest silence from the vLLM server: whole answer, or between streamed tokens",
    )
    vllm_connect_timeout_s: float = Field(
        10.0, gt=0, description="longest wait to connect to the vLLM server"
    )
    # storage and retrieval
    data_dir: Path = Field(
        Path("ragkv_data/server"), description="index (FAISS + SQLite) and, by default, KV"
    )
    store: str | None = Field(
        None, description="chunk KV store URL (file://, redis://, memory://); None: data_dir/kv"
    )
    store_codec: str = Field(
        DEFAULT_CODEC,
        description="codec of newly stored chunk KV when the store URL names none (raw: lossless fp32, "
        "~16x larger); the store keeps decoding raw blobs of earlier defaults",
    )
    store_hmac_key: SecretStr | None = Field(
        None,
        description="secret (16+ characters) that authenticates stored chunk KV (HMAC-SHA256): KV written "
        "without it is never used, only recomputed and rewritten. Give every process sharing the store "
        "the same key. None: sha256 digests (integrity, not authenticity)",
    )
    embedder: str = "all-MiniLM-L6-v2"
    chunk_tokens: int | None = Field(
        None, ge=1, description="tokens per chunk (None: top_k chunks + prompt fit the context, <= 512)"
    )
    overlap: int = Field(0, ge=0)
    top_k: int = Field(6, ge=1)
    chunk_order: Literal[CHUNK_ORDERS] = Field(  # type: ignore[valid-type]
        DEFAULT_CHUNK_ORDER,
        description="order of retrieved chunks in a prompt: 'score' (retrieval order), 'random' (seeded), or "
        "'cache': the KV tree's longest cached path first (opt-in: the prompt changes, so answers may; "
        "docs/EXACT_REUSE.md)",
    )
    prompt_file: Path | None = Field(
        None,
        description="JSON with the RAG prompt settings (instruction, question_template, system, examples: "
        "few-shot [user, answer] turns), e.g. the demo corpus ragkv/demo/corpus.json; None: ragkv's defaults",
    )
    mode: Literal[MODES] = DEFAULT_MODE.value  # type: ignore[valid-type]
    ratio: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="blend recompute ratio; None (default): the fidelity gate's operating point for `fidelity`",
    )
    fidelity: str = Field(
        DEFAULT_FIDELITY,
        description="how blend without a ratio runs (ragkv.fidelity): floor (default: changes no more answers "
        "than a dtype change, per the model's fidelity report), exact, fast, fast:X (TTFT speed-up >= X) or a "
        "same-answer rate in (0, 1]",
    )
    adapter: str = Field(
        DEFAULT_ADAPTER,
        description="KV adapter (ragkv.adapter): auto (default: the package's adapter for the model, where "
        "the fidelity gate chooses it), off, or a file: a KV adapter, or a chunk-KV writer (ingest writes "
        "chunk KV through it, keyed as its own; not with generation 'vllm')",
    )
    # generation
    generation: Literal["threads", "engine", "vllm"] = Field(
        "threads",
        description="where answers are generated (ragkv.rag.generation; retrieval, prompt, ingest and "
        "chunk-KV precompute stay here): 'threads', one generation per worker thread (max_concurrency); "
        "'engine', ragkv.engine's continuous batching (engine_max_seqs decode together); 'vllm', the vLLM "
        "OpenAI server at vllm_url (with the ragkv plugin, or another ragkv server), chunk keys in "
        "kv_transfer_params",
    )
    engine_max_seqs: int = Field(32, ge=1, description="requests decoding together with generation='engine'")
    max_new_tokens: int = Field(
        DEFAULT_MAX_NEW_TOKENS, ge=1, description="default max_tokens of a query or chat request"
    )
    max_new_tokens_limit: int = Field(1024, ge=1, description="largest max_tokens a request may ask for")
    # limits
    max_concurrency: int = Field(2, ge=1, description="generations running at once (worker threads)")
    max_queue: int = Field(64, ge=0, description="requests waiting for a worker before 429")
    queue_timeout_s: float = Field(120.0, gt=0, description="longest wait for a worker before 503")
    max_ingest_queue: int = Field(8, ge=0, description="ingest requests waiting before 429")
    max_body_bytes: int = Field(8 << 20, ge=1024, description="largest JSON request body (413 beyond)")
    max_upload_bytes: int = Field(
        256 << 20, ge=1024, description="largest NDJSON document upload (413 beyond)"
    )
    max_upload_line_bytes: int = Field(
        16 << 20, ge=1024, description="longest line (one document) of an NDJSON upload (413 beyond)"
    )
    max_documents: int = Field(1000, ge=1, description="documents per JSON ingest request")
    max_document_chars: int = Field(2_000_000, ge=1)
    # quotas (ragkv.rag.quotas): checked before an ingest writes anything; one refusal refuses the request
    max_document_tokens: int | None = Field(
        DEFAULT_MAX_DOCUMENT_TOKENS,
        ge=1,
        description="tokens of one document (its chunks'), beyond that the ingest is refused (413); "
        "None: unlimited",
    )
    max_collection_tokens: int | None = Field(
        None,
        ge=1,
        description="tokens of every chunk of a collection; an ingest that would go beyond is refused "
        "(429, quota_exceeded); None: unlimited",
    )
    max_collection_kv_bytes: int | None = Field(
        None,
        ge=1,
        description="stored chunk KV bytes a collection accounts for (its distinct chunks' tokens x the "
        "store codec's measured bytes per token); an ingest that would go beyond is refused (429, "
        "quota_exceeded); None: unlimited (the store's own byte cap still bounds it)",
    )
    max_question_chars: int = Field(8000, ge=1)
    max_top_k: int = Field(32, ge=1)
    max_chunk_ids: int = Field(64, ge=1)
    max_messages: int = Field(64, ge=1)
    max_prompt_chars: int = Field(
        262_144, ge=1, description="longest text prompt of /v1/completions (checked before tokenizing)"
    )
    max_prompt_tokens: int = Field(131_072, ge=1, description="longest token-id prompt of /v1/completions")
    ingest_batch_chunks: int = Field(
        32, ge=1, description="chunks per ingest batch (write-ahead record, KV, embedding)"
    )
    ingest_yield_s: float = Field(
        0.5,
        ge=0,
        description="between its steps (a chunk's KV, 8 embeddings), an ingest waits up to this long "
        "for queries in flight to finish: queries go first, a constant query stream slows ingest down",
    )
    ingest_nice: int = Field(
        10, ge=0, le=19, description="CPU niceness added to the ingest thread (Linux; 0: same as queries)"
    )
    # authentication and origin checks
    api_keys: KeyList = Field(
        default_factory=list,
        description="keys with read and write scope (ingest, delete); when any key is set, writes need "
        "one (Authorization: Bearer KEY or X-API-Key: KEY). An entry is a key (every collection) or "
        '{"key": KEY, "collections": [NAME, ...]} (only those). Env: JSON list, or comma-separated keys',
    )
    read_api_keys: KeyList = Field(
        default_factory=list,
        description="read-only keys (queries, listings): refused writes get 403; entries as api_keys'",
    )
    require_key_for_reads: bool = Field(
        True,
        description="kept for old config files; ignored: with keys configured every route but /healthz "
        "needs a key (reads a read or write key, anything that writes a write key)",
    )
    allowed_hosts: StrList | None = Field(
        None,
        description="Host header allow-list (DNS-rebinding defence); None: the loopback names when host "
        "is loopback, else any ('*')",
    )
    # connection limits (uvicorn)
    max_connections: int = Field(256, ge=1, description="open connections + requests before 503 (uvicorn)")
    max_pending_connections: int = Field(
        64,
        ge=1,
        description="connections still waiting to send a request head (half-open, slowloris); one more "
        "closes the oldest. Below max_connections, so they never make real requests get 503",
    )
    header_timeout_s: float = Field(10.0, gt=0, description="longest wait for a request's headers")
    body_timeout_s: float = Field(30.0, gt=0, description="longest wait for the next piece of a body")
    keep_alive_timeout_s: float = Field(5.0, gt=0, description="idle keep-alive connections close after")
    max_header_bytes: int = Field(64 << 10, ge=1024, description="largest request head (h11)")
    shutdown_timeout_s: float = Field(
        10.0, gt=0, description="longest wait for running work (and open streams) on shutdown"
    )
    # server
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    @field_validator("api_keys", "read_api_keys", "allowed_hosts", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        """Env vars: a JSON list, or comma-separated values."""
        if isinstance(v, str):
            v = v.strip()
            if v.startswith("["):
                return json.loads(v)
            return [x.strip() for x in v.split(",") if x.strip()]
        return v

    @field_validator("max_document_tokens", "max_collection_tokens", "max_collection_kv_bytes", mode="before")
    @classmethod
    def _quota(cls, v: Any, info) -> Any:
        """Env vars and files: ``none`` / ``unlimited`` (or empty) for no limit; byte sizes as ``10GiB``."""
        if isinstance(v, str):
            if v.strip().lower() in ("", "none", "null", "unlimited"):
                return None
            if info.field_name == "max_collection_kv_bytes" and not v.strip().isdigit():
                from ragkv.store import parse_bytes

                return parse_bytes(v)
        return v

    @field_validator("api_keys", "read_api_keys")
    @classmethod
    def _long_keys(cls, v: list[ApiKey]) -> list[ApiKey]:
        if any(len(k.key.get_secret_value()) < MIN_API_KEY_CHARS for k in v):
            raise ValueError(f"API keys must have at least {MIN_API_KEY_CHARS} characters")
        return v

    @field_validator("fidelity")
    @classmethod
    def _fidelity(cls, v: str) -> str:
        return parse_fidelity(v)

    def request_settings(self) -> RequestSettings:
        """The service's request settings (mode, ratio, fidelity, KV adapter): every request's
        defaults, parsed once and passed whole to the LLM and the engine."""
        return RequestSettings(self.mode, self.ratio, fidelity=self.fidelity, adapter=self.adapter)

    @field_validator("store_codec")
    @classmethod
    def _known_codec(cls, v: str) -> str:
        from ragkv.store.codecs import available_codecs

        if v not in available_codecs():
            raise ValueError(f"unknown store codec {v!r}; known: {available_codecs()}")
        return v

    @field_validator("store_hmac_key")
    @classmethod
    def _long_hmac_key(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(v.get_secret_value().encode()) < MIN_API_KEY_CHARS:
            raise ValueError(f"store_hmac_key must have at least {MIN_API_KEY_CHARS} characters")
        return v

    def host_allow_list(self) -> list[str]:
        """The Host names accepted (see ``allowed_hosts``)."""
        if self.allowed_hosts is not None:
            return list(self.allowed_hosts)
        return list(LOOPBACK_HOSTS) if self.is_loopback() else ["*"]

    def is_loopback(self) -> bool:
        """Whether the service binds to a loopback address only."""
        import ipaddress

        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    @model_validator(mode="before")
    @classmethod
    def _no_backend(cls, data: Any) -> Any:
        if (isinstance(data, dict) and "backend" in data) or "RAGKV_BACKEND" in os.environ:
            raise ValueError(
                "'backend' is now part of 'generation': generation='vllm' generates on vllm_url, "
                "'threads' or 'engine' in this process"
            )
        return data

    @model_validator(mode="after")
    def _coherent(self) -> Settings:
        if self.max_new_tokens > self.max_new_tokens_limit:
            raise ValueError("max_new_tokens must not exceed max_new_tokens_limit")
        if self.top_k > self.max_top_k:
            raise ValueError("top_k must not exceed max_top_k")
        if self.max_pending_connections >= self.max_connections:
            raise ValueError("max_pending_connections must be below max_connections")
        if self.generation == "vllm" and not self.vllm_url:
            raise ValueError("generation 'vllm' needs vllm_url (e.g. http://127.0.0.1:8000)")
        return self

    def chunk_tokens_for(self, max_position: int, prompt_overhead: int = 0) -> int:
        """Chunk size: the setting, else what lets ``top_k`` chunks fit the context next to the prompt
        (``prompt_overhead`` tokens), a 64-token question and ``max_new_tokens``; at most 512."""
        if self.chunk_tokens:
            return self.chunk_tokens
        room = max_position - prompt_overhead - 64 - self.max_new_tokens
        return max(16, min(512, room // self.top_k))

    def quotas(self) -> Quotas:
        """The ingest quotas of these settings (:class:`ragkv.rag.quotas.Quotas`)."""
        return Quotas(
            max_document_tokens=self.max_document_tokens,
            max_collection_tokens=self.max_collection_tokens,
            max_collection_kv_bytes=self.max_collection_kv_bytes,
        )

    def model_name(self) -> str:
        return self.served_model_name or Path(self.model.rstrip("/")).name or self.model


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Settings from a ``.toml``, ``.yaml``/``.yml`` or ``.json`` file (a table ``[ragkv]`` is accepted)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e}") from e
    try:
        if p.suffix == ".toml":
            import tomllib

            data = tomllib.loads(raw.decode())
        elif p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(raw) or {}
        elif p.suffix == ".json":
            data = json.loads(raw)
        else:
            raise ConfigError(f"config file {p} must end in .toml, .yaml, .yml or .json")
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - any parser's error is a bad file
        raise ConfigError(f"cannot parse config file {p}: {e}") from e
    if isinstance(data, dict) and set(data) == {"ragkv"}:
        data = data["ragkv"]
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a table of settings")
    return data


class _FileSource(PydanticBaseSettingsSource):
    """Values read from the config file, below env vars in precedence."""

    def __init__(self, settings_cls, values: dict[str, Any]):
        super().__init__(settings_cls)
        self.values = values

    def get_field_value(self, field, field_name):  # pragma: no cover - __call__ is what pydantic uses
        return self.values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self.values)


def load_settings(config_file: str | os.PathLike | None = None, **overrides: Any) -> Settings:
    """Settings from ``config_file`` (or ``$RAGKV_CONFIG``), env vars and ``overrides`` (None values skipped)."""
    path = config_file or os.environ.get("RAGKV_CONFIG")
    values = read_config_file(path) if path else {}
    overrides = {k: v for k, v in overrides.items() if v is not None}

    class _Settings(Settings):
        @classmethod
        def settings_customise_sources(
            cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
        ):
            return init_settings, env_settings, _FileSource(settings_cls, values)

    from pydantic import ValidationError

    try:
        return Settings.model_validate(_Settings(**overrides).model_dump())
    except ValidationError as e:
        raise ConfigError(f"invalid settings: {e}") from e
