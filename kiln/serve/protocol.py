"""The chat-completions request: validation, OpenAI-style errors, the prompt and sampling params.

Validation is strict (no "0.5" for a number) and rejects unknown keys, as OpenAI does, so a typo
such as `max_token` is an error instead of a silently ignored setting. A few OpenAI fields are
accepted only at values that change nothing (penalties of 0, `response_format` text), because
clients send them by default; anything kiln cannot honour is refused with a message saying so.
`ignore_eos` and `top_k` are vLLM's extensions, kept under the same names.
"""
from __future__ import annotations

import json
import re
from typing import Any, Literal

from jinja2.exceptions import TemplateError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kiln.engine.sampling import SamplingParams


class APIError(Exception):
    """An error answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON string, as OpenAI sends it back


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    # Clients echo response messages back with fields kiln has no use for (refusal, annotations, audio).
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content"
                             + (" or tool_calls" if self.role == "assistant" else ""))
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")  # schemas carry `strict` and vendor keys
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatRequest(_Strict):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    # "required" and a named function are not enforced (no constrained decoding): the tools are
    # rendered (only the named one, for a named choice) and calls parsed, exactly as for "auto".
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # several calls per reply are always allowed
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=64)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # 0 or -1 (vLLM's spelling) = off
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # what torch's generator takes, n added
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)  # accepted; answered with empty lists
    ignore_eos: bool = False
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _supported(self) -> ChatRequest:
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported by kiln serve (leave it out or 0)")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names function {self.tool_choice.function.name!r}, "
                                 f"which is not among the tools {names}")
        return self

    @property
    def parse_tools(self) -> bool:
        """Tools go into the prompt and calls are parsed out of the reply."""
        return bool(self.tools) and self.tool_choice != "none"

    def rendered_tools(self) -> list[dict] | None:
        if not self.parse_tools:
            return None
        tools = self.tools
        if isinstance(self.tool_choice, NamedToolChoice):
            tools = [t for t in tools if t.function.name == self.tool_choice.function.name]
        return [t.model_dump(exclude_none=True) for t in tools]


class LoadWeights(_Strict):
    checkpoint: str = Field(min_length=1)
    version: int | None = Field(None, ge=0)


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """JSON bytes -> a validated `model`, or an APIError(400) naming the field at fault."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        problems: dict[str, list[str]] = {}  # param -> reasons (a union gives one per branch)
        for err in e.errors(include_url=False):
            msg = "unknown field (kiln serve does not support it)" if err["type"] == "extra_forbidden" else err["msg"]
            problems.setdefault(_param(err["loc"]), []).append(msg.removeprefix("Value error, "))
        text = "; ".join(f"{param or 'body'}: {' or '.join(msgs)}" for param, msgs in problems.items())
        raise APIError(400, text, param=next(iter(problems)) or None) from None


_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_TAGS = {"str", "int", "float", "bool", "none"}  # how pydantic names the branches of a union


def _param(loc: tuple) -> str:
    """pydantic's error location -> OpenAI's param style, e.g. messages[0].content."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _FIELD.match(part) and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
    return out


def template_messages(req: ChatRequest) -> list[dict]:
    """The messages as the chat template reads them: text parts joined, developer = system."""
    out = []
    for m in req.messages:
        content = m.content if not isinstance(m.content, list) else "".join(p.text for p in m.content)
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content,
               "reasoning_content": m.reasoning_content, "tool_call_id": m.tool_call_id, "name": m.name}
        if m.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        out.append(msg)
    return out


def render_prompt(req: ChatRequest, tokenizer) -> str:
    try:
        return tokenizer.apply_chat_template(template_messages(req), tools=req.rendered_tools(),
                                             add_generation_prompt=True)
    except TemplateError as e:
        raise APIError(400, f"the messages cannot be rendered by the chat template: {e}", param="messages") from None


def sampling_params(req: ChatRequest, choice: int, room: int) -> SamplingParams:
    """Choice `choice` of the request; `room` = context left after the prompt (the default length).
    With a seed, choice i uses seed + i, so n seeded choices are n different samples."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0),
                          max_tokens=req.max_completion_tokens or req.max_tokens or max(room, 1),
                          stop=tuple(s for s in stop if s), stop_token_ids=() if req.ignore_eos else None,
                          seed=None if req.seed is None else req.seed + choice)
