"""A small Python client for the SpecInfer gateway, and the `specinfer client ...` commands.

    with GatewayClient("127.0.0.1:50051") as client:
        print(client.generate("def add(", max_tokens=32).text)
        for delta in client.generate_stream("def add(", max_tokens=32):
            print(delta.text_delta, end="", flush=True)
        done = client.generate("def add(", max_tokens=8, logprobs=5, stop_token_ids=[13], n=2)
        done.logprobs[0].top  # ((token id, logprob), ...) under done.logprob_space
        done.samples[1].text  # n > 1: every sample, sample 0 repeated in the fields above
        client.generate("Answer:", presence_penalty=0.5, repetition_penalty=1.2, logit_bias={13: -100},
                        json_schema={"type": "object"})  # or regex=, choice=[...], grammar=, json_object=True

Every call has a deadline (`timeout_s`). Results are plain dataclasses and dicts; gRPC errors
are raised as `GatewayError(code, details)`. `token=` sends the gateway's bearer token and
`security=` (a `ChannelSecurity`) sets TLS.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, replace
from typing import Iterator, Mapping, Sequence

import grpc

from specinfer.cli.request_flags import add_request_flags, constraint_fields, processor_values
from specinfer.errors import UserError
from specinfer.limits import DEFAULT_MAX_MESSAGE_BYTES, GATEWAY_PORT
from specinfer.logprobs import TokenLogprob
from specinfer.stats import GenerationStats
from specinfer.serving.convert import logprobs_from_proto, space_from_proto, stats_from_proto
from specinfer.serving.security import CLIENT_TOKEN_ENV, ChannelSecurity, client_security_from_env, open_channel
from specinfer.serving.settings import LOCAL_HOST, message_options
from specinfer.serving.shared_flags import (
    add_declared, client_flags, client_generate_flags, client_shape_flags, request_id_argument, resolve_declared,
)
from specinfer.v1 import specinfer_pb2 as pb
from specinfer.v1 import specinfer_pb2_grpc as pb_grpc

DEFAULT_TARGET = f"{LOCAL_HOST}:{GATEWAY_PORT}"
CALLER_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE,
                 grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS}


class GatewayError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


@dataclass(frozen=True)
class Sample:
    """One of the samples of an n > 1 request."""

    index: int
    request_id: str  # the sample's own id: "<request id>.<index>"
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    finish: str  # the FinishReason enum: "length", "stop", "cancelled" ("" while running)
    stats: GenerationStats
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Completion:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    stats: GenerationStats
    finish: str = ""  # the FinishReason enum, as a name
    logprobs: tuple[TokenLogprob, ...] = ()  # when asked for: one per token
    logprob_space: str = ""  # "raw" (greedy: log_softmax of the logits) or "processed" (the warped distribution)
    samples: tuple[Sample, ...] = ()  # n > 1: every sample by index


@dataclass(frozen=True)
class Delta:
    request_id: str
    text_delta: str
    token_ids: tuple[int, ...]
    token_offset: int
    finish_reason: str = ""  # set on the last delta
    stats: GenerationStats | None = None  # set on the last delta
    finish: str = ""  # set on the last delta: the FinishReason enum, as a name
    logprobs: tuple[TokenLogprob, ...] = ()
    logprob_space: str = ""
    index: int = 0  # n > 1: the sample (each sample's deltas form a stream of their own)


@dataclass(frozen=True)
class RequestInfo:
    request_id: str
    status: str  # running, interrupted, finished, cancelled, failed
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    stats: GenerationStats
    session_id: str
    error: str


def _stats(msg: pb.GenerationStats) -> GenerationStats:
    return stats_from_proto(msg)


def _finish(value: int) -> str:
    return "" if value == pb.FINISH_REASON_UNSPECIFIED else pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def _delta(msg: pb.GenerateStreamResponse) -> Delta:
    return Delta(msg.request_id, msg.text_delta, tuple(msg.token_ids), msg.token_offset, msg.finish_reason,
                 _stats(msg.stats) if msg.HasField("stats") else None, _finish(msg.finish),
                 logprobs_from_proto(msg.logprobs), space_from_proto(msg.logprob_space), msg.index)


def _sample(msg: pb.Sample) -> Sample:
    return Sample(msg.index, msg.request_id, msg.text, tuple(msg.token_ids), msg.finish_reason, _finish(msg.finish),
                  _stats(msg.stats), logprobs_from_proto(msg.logprobs))


def _constraint(json_schema, regex, choice, grammar, json_object: bool) -> pb.Constraint | None:
    given = {name: value for name, value in (("json_schema", json_schema), ("regex", regex), ("choice", choice),
                                             ("grammar", grammar), ("json_object", json_object or None))
             if value is not None}
    if len(given) > 1:
        raise ValueError(f"structured output: give one of json_schema, regex, choice, grammar, json_object, "
                         f"got {', '.join(given)}")
    if not given:
        return None
    ((kind, value),) = given.items()
    if kind == "choice":
        return pb.Constraint(choice=pb.ChoiceConstraint(choices=list(value)))
    if kind == "json_object":
        return pb.Constraint(json_object=pb.JsonObjectConstraint())
    if kind == "json_schema" and not isinstance(value, str):
        value = json.dumps(value)
    return pb.Constraint(**{kind: value})


def _call(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except grpc.RpcError as exc:
        raise GatewayError(exc.code(), exc.details() or "") from None


def _stream(call) -> Iterator[Delta]:
    try:
        for msg in call:
            yield _delta(msg)
    except grpc.RpcError as exc:
        raise GatewayError(exc.code(), exc.details() or "") from None
    finally:
        call.cancel()  # a consumer that stops early disconnects (the request becomes resumable)


class GatewayClient:
    def __init__(self, target: str = DEFAULT_TARGET, timeout_s: float = 300.0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, token: str | None = None,
                 security: ChannelSecurity | None = None):
        self.target = target
        self.timeout_s = timeout_s
        if token is not None:
            security = replace(security or ChannelSecurity(), token=token)
        self.channel = open_channel(target, security, message_options(max_message_bytes))
        self.stub = pb_grpc.GatewayStub(self.channel)

    def __enter__(self) -> "GatewayClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    @staticmethod
    def _request(prompt: str, *, max_tokens: int | None = None, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, stop: Sequence[str] = (), speculate: bool | None = None,
                 tree_width: Sequence[int] | None = None, max_tree_nodes: int = 0, session_id: str = "",
                 request_id: str = "", ignore_eos: bool = False, ssm_names: Sequence[str] = (),
                 tree_policy: str | None = None, stop_token_ids: Sequence[int] = (), logprobs: int | None = None,
                 n: int | None = None, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                 repetition_penalty: float | None = None, min_p: float = 0.0,
                 logit_bias: Mapping[int, float] | None = None, json_schema: str | Mapping | None = None,
                 regex: str | None = None, choice: Sequence[str] | None = None, grammar: str | None = None,
                 json_object: bool = False) -> pb.GenerateRequest:
        """The request; the gateway validates every value (INVALID_ARGUMENT naming the field).
        Penalties, min_p and logit_bias ({token id: bias}) are the logits processors; at most one
        of json_schema (a schema as a dict or JSON text), regex, choice, grammar and json_object
        asks for structured output. repetition_penalty None is 1 (none)."""
        sampling = pb.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                     frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                     repetition_penalty=0.0 if repetition_penalty in (None, 1.0) else repetition_penalty, min_p=min_p,
                                     logit_bias=dict(logit_bias or {}))
        if seed is not None:
            sampling.seed = seed
        policy = {None: pb.TREE_POLICY_UNSPECIFIED, "merge": pb.TREE_POLICY_MERGE, "mixed": pb.TREE_POLICY_MIXED}
        req = pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, sampling=sampling, stop=list(stop),
                                 shape=pb.TreeShape(widths=list(tree_width or ()), max_nodes=max_tree_nodes,
                                                    policy=policy[tree_policy]),
                                 session_id=session_id, request_id=request_id, ignore_eos=ignore_eos,
                                 ssm_names=list(ssm_names), stop_token_ids=list(stop_token_ids))
        if speculate is not None:
            req.speculate = speculate
        if logprobs is not None:
            req.logprobs = logprobs
        if n is not None:
            req.n = n
        constraint = _constraint(json_schema, regex, choice, grammar, json_object)
        if constraint is not None:
            req.constraint.CopyFrom(constraint)
        return req

    def generate(self, prompt: str, *, timeout_s: float | None = None, **params) -> Completion:
        """Generates and returns the whole result. `params`: see `_request`."""
        msg = _call(self.stub.Generate, self._request(prompt, **params), timeout=timeout_s or self.timeout_s)
        return Completion(msg.request_id, msg.text, tuple(msg.token_ids), msg.finish_reason, _stats(msg.stats),
                          _finish(msg.finish), logprobs_from_proto(msg.logprobs), space_from_proto(msg.logprob_space),
                          tuple(_sample(s) for s in msg.samples))

    def generate_stream(self, prompt: str, *, timeout_s: float | None = None, **params) -> Iterator[Delta]:
        """Yields deltas; the first one (no tokens) carries the request id for `resume`. With n > 1
        the samples' deltas interleave; `index` tells them apart, and each sample's first delta
        carries that sample's own request id."""
        return _stream(self.stub.GenerateStream(self._request(prompt, **params), timeout=timeout_s or self.timeout_s))

    def resume(self, request_id: str, token_offset: int = 0, *, timeout_s: float | None = None) -> Iterator[Delta]:
        """Re-attaches to a request, streaming from `token_offset` (the tokens already held)."""
        req = pb.ResumeStreamRequest(request_id=request_id, token_offset=token_offset)
        return _stream(self.stub.ResumeStream(req, timeout=timeout_s or self.timeout_s))

    def cancel(self, request_id: str) -> bool:
        return _call(self.stub.CancelRequest, pb.CancelRequestRequest(request_id=request_id),
                     timeout=self.timeout_s).cancelled

    def get_request(self, request_id: str) -> RequestInfo:
        m = _call(self.stub.GetRequest, pb.GetRequestRequest(request_id=request_id), timeout=self.timeout_s)
        return RequestInfo(m.request_id, m.status, m.text, tuple(m.token_ids), m.finish_reason, _stats(m.stats),
                           m.session_id, m.error)

    def create_session(self, prefix: str = "") -> str:
        return _call(self.stub.CreateSession, pb.CreateSessionRequest(prefix=prefix), timeout=self.timeout_s).session_id

    def delete_session(self, session_id: str) -> bool:
        return _call(self.stub.DeleteSession, pb.DeleteSessionRequest(session_id=session_id),
                     timeout=self.timeout_s).deleted

    def info(self) -> dict:
        m = _call(self.stub.Info, pb.InfoRequest(), timeout=self.timeout_s)
        return {"model": m.model, "ssm_names": list(m.ssm_names), "max_prompt_tokens": m.max_prompt_tokens,
                "max_tokens": m.max_tokens, "max_concurrent_requests": m.max_concurrent_requests,
                "max_stop_sequences": m.max_stop_sequences, "max_logprobs": m.max_logprobs,
                "max_samples": m.max_samples,
                "default_shape": {"widths": list(m.default_shape.widths), "max_nodes": m.default_shape.max_nodes}}


# -- CLI glue: `specinfer client generate|info|get|cancel` ----------------------------------
def add_client_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the `client` command (with generate, info, get and cancel) to a CLI's subparsers."""
    c = subparsers.add_parser("client", help="call a running gateway")
    sub = c.add_subparsers(dest="client_command", required=True)
    common = client_flags(DEFAULT_TARGET, CLIENT_TOKEN_ENV)

    g = sub.add_parser("generate", help="generate from a prompt; prints JSON (with --stream: the text as it comes "
                                        "and a line of statistics, or JSON lines with --json)")
    add_declared(g, *common, *client_generate_flags())
    add_request_flags(g)
    add_declared(g, *client_shape_flags())
    add_declared(sub.add_parser("info", help="the gateway's model, limits and tree configuration"), *common)
    for name in ("get", "cancel"):
        add_declared(sub.add_parser(name, help=f"{name} a request by id"), *common, request_id_argument())
    return c


def _print(obj) -> None:
    print(json.dumps(obj), flush=True)


def stats_line(stats: GenerationStats, finish: str = "") -> str:
    """One short line of a completion's statistics, for people."""
    n = stats.output_tokens
    ms = f", {1000 * stats.latency_s / n:.1f} ms/token" if n and stats.latency_s else ""
    ended = f", {finish}" if finish else ""
    return f"[{n} tokens in {stats.llm_steps} LLM steps: {stats.tokens_per_step:.2f} tokens/step{ms}{ended}]"


def print_text(deltas: Iterator[Delta], out) -> None:
    """Plain text: a single sample's text as it comes, then its statistics on one line. Samples of
    an n > 1 request interleave on the stream: each is printed whole once all are done."""
    texts: dict[int, list[str]] = {}
    ends: dict[int, Delta] = {}
    for delta in deltas:
        texts.setdefault(delta.index, []).append(delta.text_delta)
        if delta.stats is not None:
            ends[delta.index] = delta
        if len(texts) == 1 and delta.index == 0 and delta.text_delta:
            out.write(delta.text_delta)
            out.flush()
    if len(texts) <= 1:
        last = ends.get(0)
        out.write("\n" + (stats_line(last.stats, last.finish or last.finish_reason) + "\n" if last else ""))
    else:
        out.write("\n")  # what sample 0 streamed before the others showed up
        for index in sorted(texts):
            last = ends.get(index)
            stats = f" {stats_line(last.stats, last.finish or last.finish_reason)}" if last else ""
            out.write(f"--- sample {index}{stats}\n{''.join(texts[index])}\n")
    out.flush()


def _as_json(result) -> dict:
    """A result as printed: its stats (and its samples') with the figures derived from them."""
    d = asdict(result)
    if result.stats is not None:
        d["stats"] = result.stats.summary()
    for sample, printed in zip(getattr(result, "samples", ()), d.get("samples", ())):
        printed["stats"] = sample.stats.summary()
    return d


def run_client(args: argparse.Namespace) -> int:
    """Runs a `client` subcommand; gRPC errors print one line and return 2 (caller's fault) or 1."""
    try:
        resolve_declared(args)  # the flag, else its variable, else its default (whichever parser read them)
        security = client_security_from_env(os.environ, args.token or None)
    except UserError as exc:
        print(f"specinfer: error: {exc}", file=sys.stderr)
        return 2
    try:
        constraint = constraint_fields(args) if args.client_command == "generate" else {}
    except UserError as exc:  # a file the flags name: before any call
        print(f"specinfer: error: {exc}", file=sys.stderr)
        return 2
    try:
        with GatewayClient(args.target, timeout_s=args.timeout, security=security) as client:
            if args.client_command == "info":
                _print(client.info())
            elif args.client_command == "get":
                _print(_as_json(client.get_request(args.request_id)))
            elif args.client_command == "cancel":
                _print({"request_id": args.request_id, "cancelled": client.cancel(args.request_id)})
            else:
                params = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed, stop=args.stop, tree_width=args.tree_width,
                              ssm_names=args.ssm_name, tree_policy=args.tree_policy,
                              speculate=False if args.no_speculate else None, session_id=args.session,
                              request_id=args.request_id, stop_token_ids=args.stop_token_id,
                              logprobs=args.logprobs, n=args.n, **processor_values(args), **constraint)
                if args.stream and args.json:
                    for delta in client.generate_stream(args.prompt, **params):
                        _print(_as_json(delta))
                elif args.stream:
                    print_text(client.generate_stream(args.prompt, **params), sys.stdout)
                else:
                    _print(_as_json(client.generate(args.prompt, **params)))
    except GatewayError as exc:
        print(f"specinfer: error: {exc.code.name}: {exc.details}", file=sys.stderr)
        return 2 if exc.code in CALLER_ERRORS else 1
    return 0
