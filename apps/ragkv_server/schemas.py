"""Request and response models of the service; request limits come from the settings, so the OpenAPI
schema states the limits the running server enforces."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from ragkv.defaults import MODES
from ragkv.fidelity import parse_fidelity
from ragkv.fidelity.plan import RequestSettings
from ragkv_server.config import Settings

#: a prefill mode's name (the modes: ragkv.defaults.Mode)
ModeName = Literal[MODES]  # type: ignore[valid-type]
#: a fidelity setting (ragkv.fidelity): a name or a same-answer rate, checked and made canonical
Fidelity = Annotated[
    Annotated[str, Field(max_length=32)] | Annotated[float, Field(gt=0.0, le=1.0)],
    AfterValidator(parse_fidelity),
]
FIDELITY_HELP = (
    "where blend without a ratio runs: floor (no more answer changes than a dtype change), exact, fast, "
    "fast:X (TTFT speed-up >= X) or a same-answer rate in (0, 1]"
)
DOC_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
#: a metadata value: a string of at most 4096 characters, a number, a boolean or null
MetaValue = Annotated[str, Field(max_length=4096)] | int | float | bool | None
NOT_BLANK = r"\S"  # somewhere a non-whitespace character (stated in the schema; see _not_blank)
#: the largest integer (ids, seeds) every JSON client holds exactly; above it a JSON Schema checker
#: comparing as floats would call 2**63 + 100 "at most 2**63 - 1"
MAX_ID = MAX_INT = 2**53 - 1


def _not_blank(v: str | None) -> str | None:
    if v is not None and not v.strip():
        raise ValueError("must contain non-whitespace text")
    return v


class StrictModel(BaseModel):
    """A request's part: strict types (``"stream": 0`` is refused, not coerced) and no unknown fields."""

    model_config = ConfigDict(extra="forbid", strict=True)


# ---- responses (no limits) ---------------------------------------------------------------------
class ErrorBody(BaseModel):
    message: str
    type: str
    code: int
    param: str | None = None
    details: list[Any] | dict[str, Any] | None = Field(
        None, description="validation errors (422), or a quota refusal's limit and usage (quota_exceeded)"
    )


class ErrorResponse(BaseModel):
    """Every error: ``{"error": {"message", "type", "code", ...}}`` (the OpenAI shape)."""

    error: ErrorBody


class IngestedDocument(BaseModel):
    id: str
    status: Literal["added", "unchanged", "replaced"]
    chunk_ids: list[int]


class IngestResponse(BaseModel):
    documents: list[IngestedDocument]
    documents_added: int
    documents_unchanged: int
    chunks_added: int
    kv_computed: int
    kv_not_stored: int = Field(
        0,
        description="chunk KV computed but not stored (store full or down, disk full): the documents are "
        "indexed and answerable, and the KV is recomputed when used",
    )
    seconds: float


class DeleteResponse(BaseModel):
    id: str
    deleted: bool


class GarbageReport(BaseModel):
    """What a garbage collection of the chunk store found and deleted."""

    blobs: int = Field(description="stored chunk KV blobs before the collection")
    unreferenced: int = Field(description="blobs no chunk of the index references")
    deleted: int
    bytes_freed: int


class ReloadReport(BaseModel):
    """What a reload took in from the other writers of the data folder."""

    added: int = Field(description="chunk vectors other writers committed since this service looked")
    removed: int = Field(description="chunk vectors other writers deleted since")
    documents: int = Field(description="documents the service serves now")
    chunks: int = Field(description="chunks the service serves now")


class QuotaLimits(BaseModel):
    """The ingest quotas in force (null: unlimited)."""

    max_document_tokens: int | None
    max_collection_tokens: int | None
    max_collection_kv_bytes: int | None


class CollectionUsage(BaseModel):
    """What a collection holds, as its quotas count it."""

    collection: str
    documents: int
    chunks: int
    tokens: int = Field(description="tokens of every chunk (counted against max_collection_tokens)")
    kv_bytes: int = Field(
        description="stored chunk KV bytes accounted to the collection: its distinct chunks' tokens x "
        "kv_bytes_per_token (counted against max_collection_kv_bytes)"
    )
    kv_bytes_per_token: int = Field(
        description="the store codec's bytes per token, measured once on a sample chunk of the served model"
    )
    limits: QuotaLimits


class DocumentList(BaseModel):
    ids: list[str]
    total: int


class Source(BaseModel):
    chunk_id: int
    doc_id: str
    seq: int
    kv_key: str
    score: float
    text: str
    metadata: dict[str, Any] = Field(default_factory=dict)


class Timings(BaseModel):
    """Seconds: waiting for a worker, retrieval, chunk-KV lookup/fetch, time to first token, total
    (``ttft_s`` and ``total_s`` count from the start of the work, after ``queue_s``)."""

    queue_s: float
    retrieval_s: float
    kv_fetch_s: float
    ttft_s: float
    total_s: float


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt rows reused from stored chunk KV or the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class QueryResponse(BaseModel):
    id: str
    answer: str
    mode: str
    finish_reason: Literal["stop", "length"]
    sources: list[Source]
    timings: Timings
    stats: dict[str, Any]
    usage: Usage


class Health(BaseModel):
    status: Literal["ok"]
    model: str
    generation: str = Field(description="where answers are generated: threads, engine or vllm")
    documents: int
    chunks: int
    running: int
    queued: int
    blend_gate: Literal["passed", "failed", "pending"] = Field(
        description="the blending self-check: passed, failed (reuse and blend fall back to full), or "
        "pending (runs before the first reuse or blend)"
    )
    fidelity: dict = Field(
        description="the operating point blend runs at (the fidelity gate's choice for the service's setting): "
        "target, point, mode, ratio, its same-answer rate vs full prefill on the calibration set, the noise "
        "floor's, its TTFT speed-up and charged compute"
    )


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ragkv"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- structured output and log-probabilities (OpenAI's shapes) -------------------------------------
class TextFormat(StrictModel):
    type: Literal["text"]


class JsonObjectFormat(StrictModel):
    """Any JSON object (OpenAI's JSON mode)."""

    type: Literal["json_object"]


class JsonSchemaSpec(StrictModel):
    """``response_format.json_schema``: the schema the output must match (checked when the request
    arrives: an invalid or unsupported schema is a 400 naming ``response_format``)."""

    model_config = ConfigDict(populate_by_name=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=4096)
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="a JSON schema (default: any object)"
    )
    strict: bool | None = Field(
        None, description="accepted; the output always matches the schema (unsupported keywords are refused)"
    )


class JsonSchemaFormat(StrictModel):
    """Output matching a JSON schema (OpenAI's Structured Outputs)."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class FunctionSpec(BaseModel):
    """``tools[].function``: a function the model may be made to call (its arguments' JSON schema)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=4096)
    parameters: dict[str, Any] | None = Field(
        None, description="JSON schema of the arguments (default: any object)"
    )
    strict: bool | None = None


class ToolSpec(StrictModel):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(StrictModel):
    name: str = Field(max_length=64)


class NamedToolChoice(StrictModel):
    """``tool_choice`` naming the function to call."""

    type: Literal["function"]
    function: FunctionName


#: ``response_format`` of the chat and completions routes
ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]
#: most ``top_logprobs`` (chat) / ``logprobs`` (completions) a request may ask for
MAX_TOP_LOGPROBS = 20


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    """``choices[].logprobs`` of a chat completion: one entry per generated token."""

    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as JSON text, matching the function's parameters")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="the answer; null when the message is a forced tool call")
    tool_calls: list[ToolCallOut] | None = Field(
        None,
        description="the forced function call (tool_choice naming a function, or 'required' with one tool)",
    )


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length"]
    token_ids: list[int] | None = Field(None, description="with return_token_ids: the generated token ids")


class RagkvInfo(BaseModel):
    """What ragkv adds to an OpenAI response: sources, timings and prefill statistics."""

    sources: list[Source]
    timings: Timings
    stats: dict[str, Any]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    ragkv: RagkvInfo
    prompt_token_ids: list[int] | None = Field(
        None, description="with return_token_ids: the prompt's token ids, as prefilled"
    )


# ---- requests (limits from the settings) -------------------------------------------------------
def build_schemas(s: Settings) -> SimpleNamespace:
    """Request models with ``s``'s limits (one set per app). Strict types: ``"stream": 0``,
    ``"temperature": false`` or ``"top_k": "3"`` are refused (422), not coerced; an integer is still
    accepted where a float is expected."""

    class DocumentIn(StrictModel):
        id: Annotated[str, Field(pattern=DOC_ID_PATTERN)] | None = Field(
            None, description="stable id (letters, digits, . _ : -); default: a hash of the text"
        )
        text: str = Field(min_length=1, max_length=s.max_document_chars, pattern=NOT_BLANK)
        metadata: dict[Annotated[str, Field(max_length=128)], MetaValue] = Field(
            default_factory=dict, max_length=64, description="flat metadata returned with the chunks"
        )

        @field_validator("text")
        @classmethod
        def _text(cls, v: str) -> str:
            return _not_blank(v)

    class IngestRequest(StrictModel):
        documents: list[DocumentIn] = Field(min_length=1, max_length=s.max_documents)

    class QueryRequest(StrictModel):
        question: str = Field(min_length=1, max_length=s.max_question_chars, pattern=NOT_BLANK)
        top_k: int | None = Field(None, ge=1, le=s.max_top_k, description="chunks to retrieve")
        chunk_ids: list[Annotated[int, Field(ge=0, le=MAX_ID)]] | None = Field(
            None, max_length=s.max_chunk_ids, description="answer over these chunks instead of retrieving"
        )
        mode: ModeName | None = Field(None, description=f"prefill mode (default {s.mode})")
        ratio: float | None = Field(
            None,
            ge=0.0,
            le=1.0,
            description=f"blend recompute ratio (default {s.ratio}; none: the fidelity gate's operating point)",
        )
        fidelity: Fidelity | None = Field(None, description=f"{FIDELITY_HELP} (default {s.fidelity})")
        max_tokens: int | None = Field(
            None,
            ge=1,
            le=s.max_new_tokens_limit,
            description=f"tokens to generate at most (default {s.max_new_tokens})",
        )
        temperature: float = Field(0.0, ge=0.0, le=2.0)
        top_p: float = Field(1.0, gt=0.0, le=1.0)
        seed: int | None = Field(None, ge=0, le=MAX_INT)
        stop: list[Annotated[str, Field(min_length=1, max_length=64)]] | None = Field(None, max_length=4)
        stream: bool = Field(False, description="server-sent events: `token` events, then one `answer` event")

        @field_validator("question")
        @classmethod
        def _q(cls, v: str) -> str:
            return _not_blank(v)

        def request_settings(self) -> RequestSettings:
            """The request's prefill settings as one value (unset: the service's)."""
            return RequestSettings(self.mode, self.ratio, fidelity=self.fidelity)

    # a message is bounded by the request body (max_body_bytes, 413) and its tokens by the model's
    # context (400 context_length_exceeded), not by a character count: the bound stated here is the
    # body's, which a JSON string cannot exceed
    class ContentPart(BaseModel):
        model_config = ConfigDict(strict=True)
        type: Literal["text"]
        text: str = Field(max_length=s.max_body_bytes)

    class ChatMessageIn(BaseModel):
        model_config = ConfigDict(extra="ignore", strict=True)
        role: Literal["system", "developer", "user", "assistant", "tool"]
        content: (
            Annotated[str, Field(max_length=s.max_body_bytes)]
            | Annotated[list[ContentPart], Field(max_length=64)]
            | None
        ) = Field(None, description="a string, or at most 64 text parts (joined by newlines, as vLLM does)")
        name: str | None = Field(None, max_length=256)

        def text(self) -> str:
            if self.content is None:
                return ""
            return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)

        def template_message(self) -> dict:
            """The message as a chat template reads it: role, content (text) and name if given."""
            m = {"role": self.role, "content": self.text()}
            if self.name is not None:
                m["name"] = self.name
            return m

    class RagkvOptions(StrictModel):
        chunk_ids: list[Annotated[int, Field(ge=0, le=MAX_ID)]] | None = Field(
            None,
            max_length=s.max_chunk_ids,
            description="answer over these chunks, put in the last user message as retrieved ones are",
        )
        retrieve: bool | None = Field(
            None,
            description="retrieve top_k chunks of the collection for the last user message and put them in "
            "it (default: false, or true for the model id '<model>+rag')",
        )
        top_k: int | None = Field(
            None, ge=1, le=s.max_top_k, description="chunks to retrieve (with retrieve)"
        )
        mode: ModeName | None = None
        ratio: float | None = Field(None, ge=0.0, le=1.0)
        fidelity: Fidelity | None = Field(None, description=FIDELITY_HELP)

        def request_settings(self) -> RequestSettings:
            """The request's prefill settings as one value (unset: the service's)."""
            return RequestSettings(self.mode, self.ratio, fidelity=self.fidelity)

    class StreamOptions(BaseModel):
        model_config = ConfigDict(strict=True)
        include_usage: bool = False

    class ChatCompletionRequest(BaseModel):
        """OpenAI chat completion: the messages rendered by the model's chat template as vLLM renders
        them, stored chunks inside them reused. Retrieval on request (``ragkv.retrieve``, or the model
        id ``<model>+rag``). ragkv options go in the extra field ``ragkv`` (``extra_body={"ragkv": {...}}``
        in the client)."""

        model_config = ConfigDict(extra="ignore", strict=True)
        model: str | None = Field(None, max_length=256)
        messages: list[ChatMessageIn] = Field(min_length=1, max_length=s.max_messages)
        max_tokens: int | None = Field(None, ge=1, le=s.max_new_tokens_limit)
        max_completion_tokens: int | None = Field(None, ge=1, le=s.max_new_tokens_limit)
        temperature: float | None = Field(None, ge=0.0, le=2.0)
        top_p: float | None = Field(None, gt=0.0, le=1.0)
        n: int | None = Field(None, ge=1, le=1, description="only 1 is supported")
        stream: bool | None = False
        stream_options: StreamOptions | None = None
        stop: (
            Annotated[str, Field(min_length=1, max_length=64)]
            | Annotated[list[Annotated[str, Field(min_length=1, max_length=64)]], Field(max_length=4)]
            | None
        ) = Field(None, description="at most 4 stop strings")
        seed: int | None = Field(None, ge=0, le=MAX_INT)
        user: str | None = Field(None, max_length=256)
        ragkv: RagkvOptions | None = None
        response_format: ResponseFormat | None = Field(
            None, description="text, json_object (any JSON object) or json_schema (JSON matching the schema)"
        )
        logprobs: bool | None = Field(None, description="each output token's log-probability")
        top_logprobs: int | None = Field(
            None,
            ge=0,
            le=MAX_TOP_LOGPROBS,
            description="the most likely tokens at each position (needs logprobs)",
        )
        tools: list[ToolSpec] | None = Field(
            None,
            max_length=32,
            description="functions; one is called when tool_choice names it (or is 'required' with one tool)",
        )
        return_token_ids: bool | None = Field(
            None, description="vLLM's option: prompt_token_ids in the response, token_ids in the choice"
        )
        tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
            None,
            description='"none", "required" (one tool) or {"type": "function", "function": {"name"}}; "auto" is refused',
        )

        @field_validator("stop")
        @classmethod
        def _stops(cls, v):
            if isinstance(v, list) and len(v) > 4:
                raise ValueError("at most 4 stop sequences")
            return v

    return SimpleNamespace(
        DocumentIn=DocumentIn,
        IngestRequest=IngestRequest,
        QueryRequest=QueryRequest,
        ChatMessageIn=ChatMessageIn,
        RagkvOptions=RagkvOptions,
        ChatCompletionRequest=ChatCompletionRequest,
    )
