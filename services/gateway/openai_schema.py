"""The OpenAI-compatible HTTP API's messages: requests as strict pydantic models, responses as dicts.

A request is parsed strictly (no coercion of "5" to 5; an unknown field is an error, so a typo
never silently changes a request) and converted once to the domain types of `specinfer.params`,
which validate themselves against `specinfer.limits`, exactly as a gRPC request is. Fields that
OpenAI defines and this server does not implement are accepted only at their neutral value.
Our own knobs (`top_k`, `speculate`, `tree_width`, `ssm_names`, `ignore_eos`, `stop_token_ids`)
ride as extra body fields, the way vLLM takes them, and so do vLLM's sampling extras
(`repetition_penalty`, `min_p`). Responses carry OpenAI's `usage` and our speculation
statistics (SpecInfer Section 6's metrics) in an extra `metrics` object.

Structured output (a `Constraint`) comes from OpenAI's `response_format` (`json_object`, or
`json_schema` with the schema as an object), or from vLLM's extra body `structured_outputs`
(exactly one of `json`, `regex`, `choice`, `grammar`, `json_object`), or from vLLM's older
top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`; one request names
one of these at most. A schema or grammar that does not compile is found by the verifier, and
answers 400 as any other bad field does.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from specinfer import limits
from specinfer.errors import UserError
from specinfer.logprobs import TokenLogprob
from specinfer.params import Constraint, GenerationParams, SamplingParams, TreeShape
from specinfer.stats import GenerationStats

OPENAI_DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when a request names none (sampling, not greedy)
MAX_USER_CHARS = 256


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


MAX_TOKEN_ID = (1 << 32) - 1  # token ids travel as uint32: a larger one is in no vocabulary
MAX_SCHEMA_NAME_CHARS = 64  # OpenAI's bound on json_schema.name


class JsonSchemaFormat(_Strict):
    """OpenAI's `response_format.json_schema`. `strict` is accepted and changes nothing: the
    output always follows the schema."""

    name: str = Field(max_length=MAX_SCHEMA_NAME_CHARS)
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: free text, any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('response_format.json_schema: required with type "json_schema"')
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError('response_format.json_schema: only with type "json_schema"')
        return self

    def constraint(self) -> Constraint | None:
        if self.type == "json_object":
            return _constraint("response_format", "json_object")
        if self.type == "json_schema":
            return _constraint("response_format.json_schema.schema", "json_schema", _json_text(self.json_schema.schema_))
        return None


class StructuredOutputs(_Strict):
    """vLLM's extra body `structured_outputs`: exactly one of its fields."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")  # a JSON Schema, as an object or as JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [name for name in STRUCTURED_FIELDS if getattr(self, STRUCTURED_FIELDS[name]) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: give exactly one of {', '.join(STRUCTURED_FIELDS)}"
                             + (f", got {', '.join(given)}" if given else ""))
        return self

    def constraint(self) -> Constraint:
        return _structured("structured_outputs.", self.json_, self.regex, self.choice, self.grammar)


STRUCTURED_FIELDS = {"json": "json_", "regex": "regex", "choice": "choice", "grammar": "grammar",
                     "json_object": "json_object"}  # the JSON name -> the attribute
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _json_text(schema: dict | str, field: str = "") -> str:
    """A schema as JSON text (`Constraint.spec`); a string must already be JSON."""
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except ValueError as exc:
            raise UserError(f"{field}: not valid JSON ({exc})") from None
        return schema
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def _constraint(field: str, kind: str, spec: str = "", choices: Sequence[str] = ()) -> Constraint:
    """The domain constraint; its UserError names the request's own field."""
    try:
        return Constraint(kind, spec, tuple(choices))
    except UserError as exc:
        raise UserError(f"{field}: {str(exc).removeprefix(kind + ':').strip()}") from None


def _structured(prefix: str, schema, regex, choice, grammar) -> Constraint:
    """The constraint of vLLM's fields (one of them given, else json_object), named `prefix` + the
    field in errors."""
    if schema is not None:
        return _constraint(f"{prefix}json", "json_schema", _json_text(schema, f"{prefix}json"))
    if regex is not None:
        return _constraint(f"{prefix}regex", "regex", regex)
    if choice is not None:
        return _constraint(f"{prefix}choice", "choice", choices=choice)
    if grammar is not None:
        return _constraint(f"{prefix}grammar", "grammar", grammar)
    return _constraint(f"{prefix}json_object", "json_object")


def _logit_bias(bias: dict[str, float]) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (token id, bias) pairs in token order."""
    pairs = []
    for key, value in bias.items():
        text = key.strip()
        if not (text.isascii() and text.lstrip("-").isdigit()):
            raise UserError(f"logit_bias: keys must be token ids (integers as strings), got {key!r}")
        token_id = int(text)
        if token_id > MAX_TOKEN_ID:
            raise UserError(f"logit_bias: token {token_id} is outside the vocabulary")
        pairs.append((token_id, value))
    return tuple(sorted(pairs))


def _sampling(**fields) -> SamplingParams:
    """The domain sampling parameters; a bad value's UserError names the request's field."""
    try:
        return SamplingParams(**fields)
    except UserError as exc:
        raise UserError(str(exc).removeprefix("sampling.")) from None


class _GenerateBody(_Strict):
    """The fields completions and chat completions share."""

    model: str = Field(max_length=limits.MAX_NAME_CHARS)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=MAX_USER_CHARS)  # accepted for compatibility; not used
    presence_penalty: float | None = None  # in [-2, 2]
    frequency_penalty: float | None = None  # in [-2, 2]
    logit_bias: dict[str, float] | None = None  # {"token id": bias in [-100, 100]}
    response_format: ResponseFormat | None = None
    # extra body fields (vLLM-style)
    top_k: int = Field(0, ge=-1)  # 0 or -1: no top-k filter
    repetition_penalty: float | None = None  # in (0, 10]; 1 = none
    min_p: float | None = None  # in [0, 1]
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names for structured_outputs' fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    speculate: bool = True
    tree_width: list[int] | str | None = None  # [1, 1, 3, 1] or "1,1,3,1"; unset: the server's shape
    ssm_names: list[str] | None = Field(None, max_length=limits.MAX_SSM_NAMES)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    @model_validator(mode="after")
    def _consistent(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream=true")
        guided = [name for name in GUIDED_FIELDS if getattr(self, name) is not None]
        if self.response_format is not None and (self.structured_outputs is not None or guided):
            other = "structured_outputs" if self.structured_outputs is not None else guided[0]
            raise ValueError(f"{other}: give response_format or {other}, not both")
        if self.structured_outputs is not None and guided:
            raise ValueError(f"{guided[0]}: give structured_outputs or {guided[0]}, not both")
        if len(guided) > 1:
            raise ValueError(f"{guided[1]}: give one of {', '.join(GUIDED_FIELDS)}, got {', '.join(guided)}")
        return self

    def constraint(self) -> Constraint | None:
        """The request's structured output, from whichever field names it (one at most)."""
        if self.response_format is not None:
            return self.response_format.constraint()
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        if any(getattr(self, name) is not None for name in GUIDED_FIELDS):
            return _structured("guided_", self.guided_json, self.guided_regex, self.guided_choice,
                               self.guided_grammar)
        return None

    @property
    def num_top_logprobs(self) -> int | None:
        """None: no logprobs; else how many alternatives per token."""
        raise NotImplementedError

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def generation_params(self, max_tokens: int | None = None) -> GenerationParams:
        """The domain parameters; a bad value raises UserError naming the field."""
        max_tokens = self.max_tokens if max_tokens is None else max_tokens
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if isinstance(self.tree_width, str):
            widths = limits.parse_tree_width(self.tree_width)
        else:
            widths = tuple(self.tree_width or ())
        temperature = OPENAI_DEFAULT_TEMPERATURE if self.temperature is None else self.temperature
        sampling = _sampling(
            temperature=temperature, top_p=1.0 if self.top_p is None else self.top_p, top_k=max(0, self.top_k),
            seed=self.seed, frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0, logit_bias=_logit_bias(self.logit_bias or {}),
        )
        return GenerationParams(
            max_new_tokens=max_tokens or 0, sampling=sampling,
            shape=TreeShape(widths=widths) if widths else TreeShape(),
            is_speculative=self.speculate, ssm_names=tuple(self.ssm_names or ()), stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()), is_ignore_eos=self.ignore_eos,
            num_logprobs=self.num_top_logprobs, num_samples=self.n, constraint=self.constraint(),
        )


class CompletionRequest(_GenerateBody):
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion_only(self):
        if self.echo:
            raise ValueError("echo: not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: not supported (only equal to n)")
        if self.suffix:
            raise ValueError("suffix: not supported")
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise ValueError("prompt: one prompt per request (a list must hold exactly one string)")
        return self

    @property
    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    @property
    def num_top_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=limits.MAX_NAME_CHARS)

    def as_template_input(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or ())
        message = {"role": self.role, "content": content}
        if self.name:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_GenerateBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _chat_only(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("max_completion_tokens: give max_tokens or max_completion_tokens, not both")
        return self

    @property
    def num_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_params(self) -> GenerationParams:
        return self.generation_params(self.max_tokens or self.max_completion_tokens)


def parse_body(model: type[_GenerateBody], body: bytes) -> Any:
    """A request body as `model`; malformed JSON or a bad field is a UserError naming the field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise UserError(describe_validation_error(exc)) from None


def describe_validation_error(exc: ValidationError) -> str:
    """The first error, as 'field: what is wrong' (union branches are not listed one by one)."""
    err = exc.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in ("str", "int", "float")))]
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        message = "unknown field"
    if not loc or message.startswith((loc[0] + ":", loc[0] + ".")):
        return message
    return f"{'.'.join(loc)}: {message}"


# ---- responses --------------------------------------------------------------------------------
FINISH_REASONS = {"stop": "stop", "length": "length"}  # ours -> OpenAI's; others pass through


def finish_reason(reason: str) -> str | None:
    return FINISH_REASONS.get(reason, reason) or None


def usage(samples: Sequence[GenerationStats | None]) -> dict:
    """OpenAI's token counts: the prompt once, the completion tokens of every sample."""
    stats = [s for s in samples if s is not None] or [GenerationStats()]
    prompt, completion = stats[0].prompt_tokens, sum(s.output_tokens for s in stats)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": stats[0].cached_prompt_tokens}}


def speculation_metrics(stats: GenerationStats | None) -> dict | None:
    """Our per-request speculation statistics; a figure the verifier did not measure is null."""
    if stats is None:
        return None
    return {"llm_steps": stats.llm_steps, "tokens_per_step": stats.tokens_per_step,
            "mean_accepted": stats.mean_accepted, "mean_tree_nodes": stats.mean_tree_nodes,
            "acceptance_rate": stats.acceptance_rate, "latency_s": stats.latency_s, "fell_back": stats.fell_back}


def completion_logprobs(logprobs: Sequence[TokenLogprob], decode: Callable[[int], str], text_offset: int,
                        space: str) -> dict:
    """The completions API's logprobs object for some tokens; `text_offset` is where the first
    one starts in the choice's text. `logprob_space` (ours) says which distribution they are of."""
    tokens = [decode(lp.token_id) for lp in logprobs]
    offsets = [text_offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            # alternatives that decode to the same text share a key: the likeliest one keeps it
            "top_logprobs": [_by_text(lp.top, decode) for lp in logprobs], "text_offset": offsets,
            "logprob_space": space}


def _by_text(top: Sequence[tuple[int, float]], decode: Callable[[int], str]) -> dict[str, float]:
    """Alternatives by their text, most likely first as OpenAI and vLLM list them; of several
    that decode alike, the most likely."""
    out: dict[str, float] = {}
    for token_id, logprob in top:  # most likely first
        out.setdefault(decode(token_id), logprob)
    return out


def chat_logprobs(logprobs: Sequence[TokenLogprob], decode: Callable[[int], str], space: str) -> dict:
    """The chat API's logprobs object for some tokens (`logprob_space` is ours, as above)."""

    def entry(token_id: int, logprob: float) -> dict:
        token = decode(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs], "logprob_space": space}


def envelope(kind: str, request_id: str, model: str, created: int | None = None) -> dict:
    """The fields every response and stream chunk starts with."""
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    return {"id": f"{prefix}-{request_id}", "object": kind, "created": created or int(time.time()), "model": model}


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
