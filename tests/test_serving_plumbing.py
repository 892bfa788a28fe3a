"""Serving plumbing without models: the error interceptor (user errors vs server bugs, unary and
streaming, mid-stream too, with the trace id in the reply and the log), the services'
flag/environment configuration, and the model services' shared `main`."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specinfer.errors import CapacityError, NotFoundError, UnavailableError, UserError
from specinfer.serving import grpc_server
from specinfer.serving.grpc_server import ServerConfig, start_server, status_for
from specinfer.serving.metrics import RpcMetrics, new_registry
from specinfer.serving.tracing import server_span, setup_tracing

ROOT = Path(__file__).resolve().parents[1]
SERVICE = "plumbing.Test"
LOCAL = "127.0.0.1"
TRACE_ID = re.compile(r"internal error \(trace ([0-9a-f]{32})\): (\w+)$")


# ---- a tiny in-process server: bytes in, bytes out, behaviour chosen by the request ----------
def _fail(kind: str, context):
    if kind == "internal":
        raise ValueError("double free of KV block 7")
    if kind == "keyerror":
        raise KeyError("slot 3")
    if kind == "user":
        raise UserError("prompt is empty")
    if kind == "long":
        raise UserError("request_id: got " + "x" * 5000)
    if kind == "abort":
        context.abort(grpc.StatusCode.NOT_FOUND, "no such session")
    if kind == "downstream":
        raise _Downstream()
    raise AssertionError(kind)


class _Downstream(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self):
        return "the verifier is full"


class _Servicer:
    def __init__(self, tracer):
        self.tracer = tracer

    def unary(self, request: bytes, context):
        kind = request.decode()
        if kind == "ok":
            return b"fine"
        if kind == "traced":
            with server_span(self.tracer, "test.unary", context):
                _fail("internal", context)
        _fail(kind, context)

    def parsed(self, request: health_pb2.HealthCheckRequest, context):
        if request.service != "ok":
            _fail(request.service, context)
        return b"parsed " + request.service.encode()

    def chat(self, requests, context):
        for request in requests:
            yield b"heard " + request.service.encode()

    def sized(self, request: bytes, context):
        return b"x" * int(request.decode())

    def stream(self, request: bytes, context):
        kind, _, when = request.decode().partition("@")
        if when == "mid":
            yield b"first"
            yield b"second"
        if kind == "ok":
            return
        if kind == "traced":
            with server_span(self.tracer, "test.stream", context):
                yield b"in span"
                _fail("internal", context)
        _fail(kind, context)


def _start(cfg: ServerConfig, exporter=None) -> tuple[grpc_server.RunningServer, object]:
    servicer = _Servicer(setup_tracing("test", None, exporter))
    parse = health_pb2.HealthCheckRequest.FromString
    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(servicer.unary),
        "Stream": grpc.unary_stream_rpc_method_handler(servicer.stream),
        "Parsed": grpc.unary_unary_rpc_method_handler(servicer.parsed, request_deserializer=parse),
        "Chat": grpc.stream_stream_rpc_method_handler(servicer.chat, request_deserializer=parse),
        "Sized": grpc.unary_unary_rpc_method_handler(servicer.sized),
    })
    registry = new_registry()
    running = start_server(cfg, [lambda s: s.add_generic_rpc_handlers((handler,))],
                           [SERVICE], rpc_metrics=RpcMetrics.create(registry, "test"))
    return running, registry


@pytest.fixture
def server():
    """(channel, registry, exporter): a server whose servicer traces into `exporter`."""
    exporter = InMemorySpanExporter()
    running, registry = _start(ServerConfig(port=0, grace_s=0), exporter)
    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        yield channel, registry, exporter
    finally:
        channel.close()
        running.stop(0)


def _unary(channel, kind: str, metadata=None):
    return channel.unary_unary(f"/{SERVICE}/Unary")(kind.encode(), timeout=10, metadata=metadata)


def _stream(channel, kind: str) -> tuple[list[bytes], grpc.RpcError | None]:
    received = []
    try:
        for item in channel.unary_stream(f"/{SERVICE}/Stream")(kind.encode(), timeout=10):
            received.append(item)
    except grpc.RpcError as exc:
        return received, exc
    return received, None


def _error_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == grpc_server.__name__ and r.levelno >= logging.ERROR]


def _count(registry, method: str, code: str) -> float:
    value = registry.get_sample_value("specinfer_rpc_requests_total",
                                      {"service": "test", "method": method, "code": code})
    return value or 0.0


# ---- the interceptor -------------------------------------------------------------------------
def _assert_internal(err: grpc.RpcError, caplog, exc_type: str = "ValueError") -> str:
    """INTERNAL, details naming only the exception type and a trace id that the logged
    record (with its traceback) carries too; returns the trace id."""
    assert err.code() == grpc.StatusCode.INTERNAL
    match = TRACE_ID.match(err.details())
    assert match, err.details()
    assert match.group(2) == exc_type
    assert "double free" not in err.details() and "slot" not in err.details()
    records = _error_records(caplog)
    assert len(records) == 1
    record = records[0]
    assert record.exc_info is not None and record.exc_info[0].__name__ == exc_type
    assert record.fields["trace_id"] == match.group(1)
    return match.group(1)


def test_interceptor_internal_error_unary(server, caplog):
    channel, registry, _ = server
    with pytest.raises(grpc.RpcError) as err:
        _unary(channel, "internal")
    _assert_internal(err.value, caplog)
    assert _count(registry, "Unary", "INTERNAL") == 1
    assert _count(registry, "Unary", "INVALID_ARGUMENT") == 0


def test_interceptor_any_unknown_exception_is_internal(server, caplog):
    with pytest.raises(grpc.RpcError) as err:
        _unary(server[0], "keyerror")
    _assert_internal(err.value, caplog, "KeyError")


def test_interceptor_user_error_unary(server, caplog):
    channel, registry, _ = server
    with pytest.raises(grpc.RpcError) as err:
        _unary(channel, "user")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "prompt is empty"
    assert not _error_records(caplog)
    assert _count(registry, "Unary", "INVALID_ARGUMENT") == 1


@pytest.mark.parametrize("when", ["", "@mid"])
def test_interceptor_internal_error_stream(server, caplog, when):
    received, err = _stream(server[0], "internal" + when)
    assert received == ([b"first", b"second"] if when else [])
    _assert_internal(err, caplog)
    assert _count(server[1], "Stream", "INTERNAL") == 1


@pytest.mark.parametrize("when", ["", "@mid"])
def test_interceptor_user_error_stream(server, caplog, when):
    received, err = _stream(server[0], "user" + when)
    assert received == ([b"first", b"second"] if when else [])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details() == "prompt is empty"
    assert not _error_records(caplog)


def test_interceptor_keeps_a_status_the_servicer_set(server, caplog):
    with pytest.raises(grpc.RpcError) as err:
        _unary(server[0], "abort")
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.NOT_FOUND, "no such session")
    received, stream_err = _stream(server[0], "abort@mid")
    assert received == [b"first", b"second"] and stream_err.code() == grpc.StatusCode.NOT_FOUND
    assert not _error_records(caplog)
    assert _count(server[1], "Unary", "NOT_FOUND") == 1


def test_interceptor_keeps_a_downstream_status(server, caplog):
    with pytest.raises(grpc.RpcError) as err:
        _unary(server[0], "downstream")
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == "the verifier is full"
    assert not _error_records(caplog)


def test_interceptor_counts_successes(server):
    assert _unary(server[0], "ok") == b"fine"
    assert _stream(server[0], "ok@mid") == ([b"first", b"second"], None)
    assert _count(server[1], "Unary", "OK") == 1 and _count(server[1], "Stream", "OK") == 1


def test_interceptor_reports_the_server_span_trace(server, caplog):
    channel, _, exporter = server
    with pytest.raises(grpc.RpcError) as err:
        _unary(channel, "traced")
    trace_id = _assert_internal(err.value, caplog)
    (span,) = exporter.get_finished_spans()
    assert format(span.context.trace_id, "032x") == trace_id
    caplog.clear()
    received, stream_err = _stream(channel, "traced")
    assert received == [b"in span"]
    trace_id = _assert_internal(stream_err, caplog)
    assert format(exporter.get_finished_spans()[-1].context.trace_id, "032x") == trace_id


def test_interceptor_reports_the_callers_trace_without_a_server_span(server, caplog):
    caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    metadata = [("traceparent", f"00-{caller_trace}-00f067aa0ba902b7-01")]
    with pytest.raises(grpc.RpcError) as err:
        _unary(server[0], "internal", metadata)
    assert _assert_internal(err.value, caplog) == caller_trace


# ---- malformed and oversize messages ---------------------------------------------------------
MALFORMED = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, length-delimited, longer than the message


def _parsed(channel, data: bytes) -> bytes:
    return channel.unary_unary(f"/{SERVICE}/Parsed")(data, timeout=10)


def test_interceptor_malformed_request_is_invalid_argument(server, caplog):
    channel, registry, _ = server
    assert _parsed(channel, health_pb2.HealthCheckRequest(service="ok").SerializeToString()) == b"parsed ok"
    with pytest.raises(grpc.RpcError) as err:
        _parsed(channel, MALFORMED)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("malformed request: Error parsing message")
    assert not _error_records(caplog)
    assert _count(registry, "Parsed", "INVALID_ARGUMENT") == 1


def test_interceptor_parseable_request_still_reaches_the_servicer(server, caplog):
    """Bytes that parse (unknown fields included) are the servicer's to validate."""
    unknown_field = b"\x78\x01"  # field 15, varint 1: not in the message, kept as unknown
    with pytest.raises(grpc.RpcError) as err:
        _parsed(server[0], health_pb2.HealthCheckRequest(service="user").SerializeToString() + unknown_field)
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")


def test_interceptor_malformed_message_mid_stream_is_invalid_argument(server, caplog):
    channel, registry, _ = server
    sent = [health_pb2.HealthCheckRequest(service="a").SerializeToString(), MALFORMED,
            health_pb2.HealthCheckRequest(service="b").SerializeToString()]
    received = []
    with pytest.raises(grpc.RpcError) as err:
        for reply in channel.stream_stream(f"/{SERVICE}/Chat")(iter(sent), timeout=10):
            received.append(reply)
    assert received == [b"heard a"]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("malformed request: ")
    assert not _error_records(caplog)
    assert _count(registry, "Chat", "INVALID_ARGUMENT") == 1


def test_interceptor_cuts_long_details(server):
    from specinfer.limits import MAX_STATUS_DETAILS_CHARS

    with pytest.raises(grpc.RpcError) as err:
        _unary(server[0], "long")
    details = err.value.details()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(details) == MAX_STATUS_DETAILS_CHARS and details.startswith("request_id: got xxx")
    assert details.endswith("...")


def test_server_bounds_message_size_and_stays_healthy():
    from specinfer.limits import MIN_MESSAGE_BYTES

    running, registry = _start(ServerConfig(port=0, grace_s=0, max_message_bytes=MIN_MESSAGE_BYTES))
    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        sized = channel.unary_unary(f"/{SERVICE}/Sized")
        assert len(sized(b"1000" + b" " * (MIN_MESSAGE_BYTES - 10), timeout=10)) == 1000  # just under: fine
        with pytest.raises(grpc.RpcError) as err:  # a request over the bound
            sized(b"1" + b" " * MIN_MESSAGE_BYTES, timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as err:  # a reply over the bound
            sized(str(MIN_MESSAGE_BYTES + 1).encode(), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for _ in range(5):  # headers under the metadata bound (gRPC's default refuses some of these)
            assert sized(b"1", metadata=[("x-big", "y" * 14_000)], timeout=10) == b"x"
        with pytest.raises(grpc.RpcError) as err:  # headers over it
            sized(b"1", metadata=[("x-big", "y" * 32_000)], timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        reply = channel.unary_unary("/grpc.health.v1.Health/Check")(
            health_pb2.HealthCheckRequest().SerializeToString(), timeout=5)
        assert health_pb2.HealthCheckResponse.FromString(reply).status == health_pb2.HealthCheckResponse.SERVING
        assert sized(b"10", timeout=10) == b"x" * 10
    finally:
        channel.close()
        running.stop(0)


def _info_server(num_bytes: int):
    """A server answering every Info method with a reply of about `num_bytes`."""
    from specinfer.v1 import specinfer_pb2 as pb

    name = "m" * num_bytes
    replies = {"specinfer.v1.Gateway": pb.GatewayInfo(model=name), "specinfer.v1.Verifier": pb.VerifierInfo(model=name),
               "specinfer.v1.Speculator": pb.SpeculatorInfo(ssm_names=[name])}
    handlers = [grpc.method_handlers_generic_handler(service, {"Info": grpc.unary_unary_rpc_method_handler(
        lambda request, context, reply=reply: reply.SerializeToString())}) for service, reply in replies.items()]
    return start_server(ServerConfig(port=0, grace_s=0, max_message_bytes=4 * num_bytes),
                        [lambda s: s.add_generic_rpc_handlers(tuple(handlers))], list(replies))


@pytest.mark.parametrize("client", ["gateway_client", "verifier_client", "speculator_stub"])
def test_the_channels_a_service_opens_are_bounded(client):
    """GatewayClient, the gateway's verifier channel and the verifier's speculator channels take
    the message bound: a reply over it is RESOURCE_EXHAUSTED, one under it arrives."""
    from services.gateway.verifier_client import VerifierClient
    from services.verifier.speculators import speculator_stub
    from specinfer.cli.client import GatewayClient, GatewayError
    from specinfer.limits import MIN_MESSAGE_BYTES
    from specinfer.v1 import specinfer_pb2 as pb

    running = _info_server(MIN_MESSAGE_BYTES + 100)
    target = f"127.0.0.1:{running.port}"

    def info(max_message_bytes: int):
        if client == "gateway_client":
            with GatewayClient(target, timeout_s=10, max_message_bytes=max_message_bytes) as c:
                return c.info()["model"]
        if client == "verifier_client":
            c = VerifierClient(target, max_message_bytes)
            try:
                return c.info(10, []).model
            finally:
                c.close()
        return speculator_stub(target, max_message_bytes).Info(pb.InfoRequest(), timeout=10).ssm_names[0]

    try:
        assert len(info(2 * MIN_MESSAGE_BYTES)) == MIN_MESSAGE_BYTES + 100
        with pytest.raises((grpc.RpcError, GatewayError, CapacityError)) as err:
            info(MIN_MESSAGE_BYTES)
        if isinstance(err.value, GatewayError):
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        elif isinstance(err.value, grpc.RpcError):
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # else the verifier client's CapacityError: RESOURCE_EXHAUSTED in the domain's words
    finally:
        running.stop(0)


def test_the_message_bounds_fit_the_largest_tree_and_response():
    """The largest token tree (MAX_TREE_NODES nodes, the largest token ids a 2**21 vocabulary has)
    fits even the smallest bound; a whole response with logprobs of every sample at the default
    request limits fits the default one (see DEFAULT_MAX_MESSAGE_BYTES)."""
    from specinfer.limits import (DEFAULT_MAX_MESSAGE_BYTES, MAX_LOGPROBS, MAX_SAMPLES, MAX_TREE_NODES,
                                  MIN_MESSAGE_BYTES, RequestLimits)
    from specinfer.v1 import specinfer_pb2 as pb

    top = (1 << 21) - 1
    tree = pb.TokenTree(tokens=[top - i for i in range(MAX_TREE_NODES)], parents=[-1] + list(range(MAX_TREE_NODES - 1)))
    assert pb.SpeculateResponse(tree=tree, step=(1 << 32) - 1, speculate_s=1.0, ssm_levels=16).ByteSize() < 5.1e3
    assert 5.1e3 < MIN_MESSAGE_BYTES
    num_tokens = RequestLimits().max_new_tokens
    logprob = pb.TokenLogprob(token_id=top, logprob=-1.5, top_token_ids=[top] * MAX_LOGPROBS,
                              top_logprobs=[-1.5] * MAX_LOGPROBS)
    stats = pb.GenerationStats(prompt_tokens=2048, output_tokens=num_tokens, llm_steps=num_tokens, tokens_per_step=1.0)
    fields = dict(text="abcd" * num_tokens, token_ids=[top] * num_tokens, finish_reason="length", stats=stats,
                  logprobs=[logprob] * num_tokens)
    samples = [pb.Sample(index=i, request_id="r" * 128, **fields) for i in range(MAX_SAMPLES)]
    response = pb.GenerateResponse(request_id="r" * 128, samples=samples, **fields)
    assert response.ByteSize() < 1.43e6 < DEFAULT_MAX_MESSAGE_BYTES


@pytest.mark.parametrize("exc,code", [
    (UserError("bad"), grpc.StatusCode.INVALID_ARGUMENT),
    (ValueError("double free of KV block 1"), grpc.StatusCode.INTERNAL),
    (KeyError("x"), grpc.StatusCode.INTERNAL),
    (RuntimeError("x"), grpc.StatusCode.INTERNAL),
    (NotFoundError("r1"), grpc.StatusCode.NOT_FOUND),
    (CapacityError("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (UnavailableError("redis"), grpc.StatusCode.UNAVAILABLE),
    (ConnectionError("gone"), grpc.StatusCode.UNAVAILABLE),
    (TimeoutError(), grpc.StatusCode.DEADLINE_EXCEEDED),
])
def test_interceptor_status_mapping(exc, code):
    assert status_for(exc)[0] == code


# ---- configuration ---------------------------------------------------------------------------
def _verifier(argv=(), env=None):
    from services.verifier.config import parse_config

    return parse_config(["--model", "/models/llm", *argv], env or {})


def _speculator(argv=(), env=None):
    from services.speculator.config import parse_config

    return parse_config(["--ssm", "/models/ssm", *argv], env or {})


def test_config_defaults_are_the_product_constants():
    from services.speculator.config import SpeculatorConfig
    from services.verifier.config import VerifierConfig
    from specinfer import limits
    from specinfer.serving import settings

    v, s = _verifier(), _speculator()
    assert v.tree_width == limits.PAPER_TREE_WIDTH == VerifierConfig(Path("m")).tree_width
    assert v.max_tree_nodes == limits.DEFAULT_MAX_TREE_NODES
    assert (v.port, s.port) == (limits.VERIFIER_PORT, limits.SPECULATOR_PORT)
    assert s.max_kv_tokens == limits.DEFAULT_KV_TOKENS and v.kv_budget == (0, 0) and v.kv_memory_fraction is None
    assert v.max_batch == s.max_batch == limits.DEFAULT_MAX_BATCH
    assert v.host == s.host == settings.LOCAL_HOST
    from specinfer.engine.scheduling.scheduler import SchedulerConfig

    sc = SchedulerConfig()  # the verifier's scheduler flags default to the scheduler's own defaults
    assert (v.max_batch, v.token_budget, v.max_waiting, v.admission_timeout_s, v.max_sessions) == (
        sc.max_batch, sc.token_budget, sc.max_waiting, sc.admission_timeout_s, sc.max_sessions)
    assert v.is_load_aware and v.speculators == () and v.otlp_endpoint is None

    # Without speculators the command line co-locates the model-free members (a verifier alone
    # still speculates); the model-free members join a speculator's SSMs; both cache load-time
    # measurements in the default cache directory; every other field is the dataclass's default.
    assert v.co_located == limits.MODEL_FREE_NAMES
    from specinfer.util import default_cache_dir

    cache_dir = default_cache_dir(env={})
    assert v.cache_dir == s.cache_dir == cache_dir and v.ssm_dtype == s.dtype == limits.DEFAULT_SSM_DTYPE
    assert v == VerifierConfig(Path("/models/llm"), co_located=limits.MODEL_FREE_NAMES, cache_dir=cache_dir)
    assert s == SpeculatorConfig((Path("/models/ssm"),), model_free=limits.MODEL_FREE_NAMES, cache_dir=cache_dir)


def test_config_flag_beats_env_beats_default():
    env = {"SPECINFER_VERIFIER_PORT": "6000", "SPECINFER_TREE_WIDTH": "2,2", "SPECINFER_SPECULATORS": "a:1, b:2",
           "SPECINFER_KV_TOKENS": "1024", "SPECINFER_LOAD_AWARE": "false", "SPECINFER_LOG_LEVEL": "DEBUG"}
    v = _verifier([], env)
    assert (v.port, v.tree_width, v.speculators, v.kv_budget) == (6000, (2, 2), ("a:1", "b:2"), (1024, 0))
    assert not v.is_load_aware and v.log_level == "debug"
    v = _verifier(["--port", "7000", "--speculator", "c:3", "--kv-budget", "2GiB"], env)
    assert (v.port, v.speculators, v.kv_budget) == (7000, ("c:3",), (0, 2 << 30))
    assert _verifier(["--fixed-tree"]).is_load_aware is False
    assert _verifier([], {"SPECINFER_KV_BUDGET": "512", "SPECINFER_KV_TOKENS": "1024"}).kv_budget == (512, 0)
    assert _verifier(["--kv-budget", "auto"], env).kv_budget == (0, 0)
    assert _verifier([], {"SPECINFER_KV_MEMORY_FRACTION": "0.5"}).kv_memory_fraction == 0.5
    for bad in ("0", "1.5", "x"):
        with pytest.raises(UserError, match="KV_MEMORY_FRACTION"):
            _verifier([], {"SPECINFER_KV_MEMORY_FRACTION": bad})
    s = _speculator([], {"SPECINFER_SPECULATOR_PORT": "6001", "SPECINFER_SSM_KV_TOKENS": "4096"})
    assert (s.port, s.max_kv_tokens) == (6001, 4096)
    from services.speculator.config import parse_config

    assert parse_config([], {"SPECINFER_SSM_DIRS": "/a,/b"}).ssm_dirs == (Path("/a"), Path("/b"))


@pytest.mark.parametrize("name,value", [
    ("SPECINFER_VERIFIER_PORT", "abc"), ("SPECINFER_MAX_BATCH", "1.5"), ("SPECINFER_TREE_WIDTH", "1,x"),
    ("SPECINFER_MAX_TREE_NODES", "many"), ("SPECINFER_DEFAULT_DEADLINE_S", "soon"), ("SPECINFER_LOAD_AWARE", "maybe"),
    ("SPECINFER_KV_BUDGET", "lots"), ("SPECINFER_DTYPE", "int8"), ("SPECINFER_THREADS", "four"),
])
def test_config_verifier_bad_env_value_names_the_variable(name, value):
    with pytest.raises(UserError, match=f"environment variable {name}={value!r}"):
        _verifier([], {name: value})


@pytest.mark.parametrize("name,value", [
    ("SPECINFER_SPECULATOR_PORT", "abc"), ("SPECINFER_SSM_KV_TOKENS", "64k"), ("SPECINFER_GRACE_S", "ten"),
    ("SPECINFER_METRICS_PORT", "x"), ("SPECINFER_LOG_LEVEL", "loud"),
])
def test_config_speculator_bad_env_value_names_the_variable(name, value):
    with pytest.raises(UserError, match=f"environment variable {name}={value!r}"):
        _speculator([], {name: value})


@pytest.mark.parametrize("argv,match", [
    (["--max-tree-nodes", "0"], "--max-tree-nodes"), (["--port", "70000"], "--port"),
    (["--max-batch", "0"], "--max-batch"), (["--default-deadline-s", "0"], "--default-deadline-s"),
])
def test_config_out_of_range_values_are_user_errors(argv, match):
    with pytest.raises(UserError, match=match):
        _verifier(argv)


def _gateway(argv=(), env=None):
    from services.gateway.config import config_from_args

    return config_from_args(["--model-dir", "/models/llm", *argv], env or {})


@pytest.mark.parametrize("parse", [_gateway, _verifier, _speculator])
def test_config_max_message_bytes_of_every_service(parse):
    from specinfer.limits import DEFAULT_MAX_MESSAGE_BYTES

    assert parse().max_message_bytes == DEFAULT_MAX_MESSAGE_BYTES == 4 << 20
    env = {"SPECINFER_MAX_MESSAGE_BYTES": "8MiB"}
    assert parse([], env).max_message_bytes == 8 << 20
    assert parse(["--max-message-bytes", "524288"], env).max_message_bytes == 512 << 10
    with pytest.raises(UserError, match="environment variable SPECINFER_MAX_MESSAGE_BYTES='lots'"):
        parse([], {"SPECINFER_MAX_MESSAGE_BYTES": "lots"})
    with pytest.raises(UserError, match=r"--max-message-bytes \(SPECINFER_MAX_MESSAGE_BYTES\) must be >= 65536"):
        parse(["--max-message-bytes", "1KiB"])
    with pytest.raises(UserError, match="must be <= 2147483647"):
        parse([], {"SPECINFER_MAX_MESSAGE_BYTES": "2GiB"})


@pytest.mark.parametrize("text,value", [("4194304", 4 << 20), ("4MiB", 4 << 20), ("512 KiB", 512 << 10),
                                        ("4MB", 4_000_000), ("1gib", 1 << 30), ("100b", 100)])
def test_config_sizes_parse(text, value):
    from specinfer.serving.settings import format_bytes, parse_bytes

    assert parse_bytes(text) == value
    assert parse_bytes(format_bytes(value)) == value


@pytest.mark.parametrize("text", ["", "4 MiBs", "-1", "1.5MiB", "MiB"])
def test_config_bad_sizes_are_user_errors(text):
    from specinfer.serving.settings import parse_bytes

    with pytest.raises(UserError, match="expected a size in bytes"):
        parse_bytes(text)


def test_config_help_shows_the_message_bound():
    from services.gateway.config import build_parser

    assert "SPECINFER_MAX_MESSAGE_BYTES, default 4MiB" in " ".join(build_parser().format_help().split())


def test_config_required_models_are_user_errors():
    from services.speculator.config import parse_config as speculator_config
    from services.verifier.config import parse_config as verifier_config

    with pytest.raises(UserError, match="SPECINFER_MODEL_DIR"):
        verifier_config([], {})
    with pytest.raises(UserError, match="SPECINFER_SSM_DIRS"):
        speculator_config([], {})


def test_config_error_in_main_is_one_line_and_exit_code_2(monkeypatch, capsys):
    from services.speculator.server import main

    monkeypatch.setenv("SPECINFER_SSM_DIRS", "/models/ssm")
    monkeypatch.setenv("SPECINFER_SSM_KV_TOKENS", "abc")
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err == "specinfer-speculator: error: environment variable SPECINFER_SSM_KV_TOKENS='abc' is not a valid int\n"


def test_config_load_error_in_main_is_one_log_line_and_exit_code_2(monkeypatch, caplog):
    from specinfer.serving import logs

    monkeypatch.setattr(logs, "setup_logging", lambda service, level: None)  # keep pytest's log capture

    class Cfg:
        log_level, num_threads, parent_pid = "info", 0, 0

    def build(cfg, is_worker_threaded):
        raise UserError("no config.json in /models/llm")

    assert grpc_server.model_service_main("verifier", [], lambda argv: Cfg(), build) == 2
    (record,) = _error_records(caplog)
    assert "no config.json" in record.getMessage() and record.exc_info is None


def test_config_paper_width_is_written_once():
    listed = subprocess.run(["git", "grep", "-l", "-E", r"1, ?1, ?3, ?1, ?1, ?1, ?1, ?1", "--", "specinfer", "services"],
                            cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert listed == ["specinfer/limits.py"]


def test_config_serving_imports_neither_the_cli_nor_torch_for_the_cpu_runtime():
    for path in (ROOT / "specinfer" / "serving").glob("*.py"):
        assert "specinfer.cli" not in path.read_text(), path
    code = ("import sys; import specinfer.engine.runtime.cpu, specinfer.serving.grpc_server, specinfer.serving.settings; "
            "assert 'torch' not in sys.modules and 'specinfer.cli' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_signal_stops_a_model_service_whose_worker_loop_runs_on_the_main_thread(monkeypatch):
    """`model_service_main`: the worker loop runs on the calling thread until SIGTERM has
    drained the server and stopped the loop; then `main` returns 0."""
    from specinfer.engine.runtime import cpu as runtime
    from specinfer.serving import logs

    monkeypatch.setattr(logs, "setup_logging", lambda service, level: None)
    monkeypatch.setattr(runtime, "configure_cpu_runtime", lambda: None)

    class Loop:
        def __init__(self):
            self.stopped, self.ran_on = threading.Event(), None

        def run(self):
            self.ran_on = threading.current_thread()
            os.kill(os.getpid(), signal.SIGTERM)  # the handlers are installed by now
            assert self.stopped.wait(30)

        def stop(self):
            self.stopped.set()

    class Cfg:
        host, port, grace_s, metrics_port, otlp_endpoint, log_level, num_threads = LOCAL, 0, 0, 0, None, "info", 0
        max_message_bytes, parent_pid = 1 << 20, 0

    loop = Loop()

    def build(cfg, is_worker_threaded):
        assert not is_worker_threaded
        return grpc_server.start_model_service(
            "test", cfg, None, lambda tracer, registry: ("servicer", loop), lambda servicer, s: None, SERVICE)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert grpc_server.model_service_main("test", [], lambda argv: Cfg(), build) == 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert loop.ran_on is threading.main_thread() and loop.stopped.is_set()


def test_prefix_cache_counters_carry_vllms_names():
    from specinfer.serving.metrics import ModelMetrics

    registry = new_registry()
    ModelMetrics.create(registry, "verifier").observe_prefix_cache(100, 80)
    labels = {"service": "verifier"}
    assert registry.get_sample_value("specinfer_prefix_cache_queries_total", labels) == 100
    assert registry.get_sample_value("specinfer_prefix_cache_hits_total", labels) == 80
