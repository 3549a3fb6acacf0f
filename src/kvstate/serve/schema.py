"""The server's request and response bodies as pydantic models: what ``/openapi.json`` publishes.

Requests are strict (a JSON ``"x"`` is no boolean, ``1.5`` no integer) and closed (an unknown
field is a 400, as in OpenAI). Every number has the bounds its use can take: ``seed`` is an
int64, token ids and ``top_k`` fit an int32, penalties and probabilities their documented
ranges. Strings must be valid Unicode: a lone UTF-16 surrogate (``"\\ud800"`` in JSON) cannot
be tokenized or encoded, so it is refused here. Whatever the schema cannot say (a token id
within the model's vocabulary, ``max_tokens`` within the server's bound) ``params`` and the
``Server`` check. Responses are documented for the clients and the schema fuzz test; the app
builds them as plain dicts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, field_validator, model_validator


def _integral(value: Any) -> Any:
    """JSON has one number type: ``3.0`` is the integer 3 (as JSON Schema's ``integer`` says); ``3.5`` and
    ``"3"`` stay what they are, and the strict check refuses them."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


INT32 = 2**31 - 1
# bounds first, then the validator: so the published schema carries the bounds
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63), BeforeValidator(_integral)]  # lt: 2**63 is an exact float
TokenId = Annotated[int, Field(ge=0, le=INT32), BeforeValidator(_integral)]
Count = Annotated[int, Field(ge=1, le=INT32), BeforeValidator(_integral)]
TopK = Annotated[int, Field(ge=-1, le=INT32), BeforeValidator(_integral)]
TopLogprobs = Annotated[int, Field(ge=0, le=20), BeforeValidator(_integral)]
BestOf = Annotated[int, Field(ge=1, le=20), BeforeValidator(_integral)]
Logprobs = Annotated[int, Field(ge=0, le=5), BeforeValidator(_integral)]
# floats are finite: JSON's NaN and Infinity (which Python's parser reads) are refused as what they are
Bias = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]
StopText = Annotated[str, Field(min_length=1)]  # count and length: the server's limits (params, published by app)
_TOKEN_KEY = r"^[0-9]{1,10}$"
LogitBias = Annotated[dict[Annotated[str, Field(pattern=_TOKEN_KEY)], Bias], WithJsonSchema({
    "type": "object", "propertyNames": {"pattern": _TOKEN_KEY},
    "additionalProperties": {"type": "number", "minimum": -100.0, "maximum": 100.0}})]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
Probability = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]


def surrogate_path(value: Any) -> str | None:
    """Where in a decoded JSON value a string (or key) is not valid Unicode, else None; iterative,
    as a body may nest as deep as the JSON parser allowed."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                stack.extend([(path, key), (f"{path}.{key}" if path else str(key), child)])
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child) for i, child in enumerate(item))
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
    return None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ImageURL(_Request):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Request):
    type: Literal["image_url"]
    image_url: ImageURL


Parts = list[Annotated[TextPart | ImagePart, Field(discriminator="type")]]


class Message(_Request):
    """A system, developer or user message: its content is required."""

    role: Literal["system", "developer", "user"]
    content: str | Parts
    name: str | None = None


class AssistantTurn(_Request):
    """An earlier answer: its content may be null (an empty answer). Clients replaying OpenAI's answers send
    ``refusal: null`` and ``tool_calls: []``; kvstate makes no tool calls, so only those are accepted."""

    role: Literal["assistant"]
    content: str | Parts | None = None
    name: str | None = None
    refusal: None = None
    tool_calls: Annotated[list[dict[str, Any]], Field(max_length=0)] | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class _Common(_Request):
    """Fields both routes take (``docs/serve.md`` maps them onto ``Session.generate``)."""

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:  # the whole body once, before any field
        where = surrogate_path(data)
        if where is not None:
            raise ValueError(f"'{where}' holds a string that is not valid Unicode (a lone UTF-16 surrogate)")
        return data

    model: str
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Probability | None = None
    n: Count | None = None
    stop: StopText | list[StopText] | None = None
    seed: Int64 | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None
    max_tokens: Count | None = None
    top_k: TopK | None = None
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, Field(ge=0.01, le=100.0, allow_inf_nan=False)] | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None


class ChatRequest(_Common):
    messages: Annotated[list[Annotated[Message | AssistantTurn, Field(discriminator="role")]], Field(min_length=1)]
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    modalities: list[Literal["text", "audio"]] | None = None


class CompletionRequest(_Common):
    # one prompt: text or token ids, alone or as a batch of one (n=1, one sequence per request)
    prompt: (Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=1)])
    echo: bool | None = None
    suffix: str | None = None
    best_of: BestOf | None = None
    logprobs: Logprobs | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        """A batch (several texts, or several lists of ids) is refused as what it is, before the union's branches
        each refuse it for another reason."""
        if isinstance(value, list) and len(value) > 1 and (all(isinstance(v, str) for v in value)
                                                           or all(isinstance(v, list) for v in value)):
            raise ValueError(f"a batch of {len(value)} prompts; kvstate serve answers one prompt per request "
                             "(send one request per prompt)")
        return value


# ----- responses (documentation only) --------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


class CachedTokens(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: CachedTokens


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """A chat choice's ``logprobs`` (``kvstate.serve.logprobs``: the raw model distribution)."""

    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """A completion choice's ``logprobs``: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    finish_reason: str
    logprobs: ChatLogprobs | None
    message: AssistantMessage


class CompletionChoice(BaseModel):
    index: int
    finish_reason: str
    logprobs: CompletionLogprobs | None
    text: str


class _Completed(BaseModel):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None
    usage: Usage


class ChatCompletion(_Completed):
    choices: list[ChatChoice]


class Completion(_Completed):
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: str
    model: str
    queue: int
    max_queue: int
    store: dict[str, Any] | None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: str | None
    logprobs: ChatLogprobs | None


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None


class _Chunk(BaseModel):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None
    usage: Usage | None = None  # only on the last chunk, with stream_options.include_usage


class ChatChunk(_Chunk):
    choices: list[ChatChunkChoice]


class CompletionChunk(_Chunk):
    choices: list[CompletionChunkChoice]


def event_schema(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a stream (OpenAPI before 3.2 describes a stream by its events): ``data``
    is a JSON chunk, an error, or the closing ``[DONE]``."""
    payload = {"anyOf": [{"$ref": f"#/components/schemas/{chunk.__name__}"},
                         {"$ref": "#/components/schemas/ErrorBody"}]}
    return {"type": "object", "required": ["data"], "properties": {
        "event": {"type": "string"}, "id": {"type": "string"},
        "data": {"anyOf": [{"const": "[DONE]"}, {"type": "string", "contentMediaType": "application/json",
                                                  "contentSchema": payload}]}}}
