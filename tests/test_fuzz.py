"""Every method of every service, fed random and mutated bytes over raw channels.

Whatever arrives, the answer is the caller's fault (INVALID_ARGUMENT, NOT_FOUND, ...) or a normal
reply, never INTERNAL or UNKNOWN: bytes that do not parse stop at the error interceptor, and
bytes that parse (protobuf accepts many) go through the services' ordinary validation.

The number of messages is SPECINFER_FUZZ_MESSAGES (default 1000, a few seconds); a longer run by
hand: `SPECINFER_FUZZ_MESSAGES=10000 pytest -q tests/test_fuzz.py -s` (its tally is printed).
"""

from __future__ import annotations

import math
import os
import random
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from specinfer.limits import RequestLimits
from specinfer.v1 import specinfer_pb2 as pb
from util import start_stack

NUM_MESSAGES = int(os.environ.get("SPECINFER_FUZZ_MESSAGES", "1000"))
MAX_MESSAGE_BYTES = 1 << 20  # every service of the stack is started with this bound
SEED = 20240611
CALL_TIMEOUT_S = 5.0
BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


# ---- valid requests, the seeds of the mutations ----------------------------------------------
def _sampling() -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7)


def _shape() -> pb.TreeShape:
    return pb.TreeShape(widths=[1, 2, 1], max_nodes=8, sampled=True, proposal_top_k=8,
                        policy=pb.TREE_POLICY_MERGE, min_path_prob=0.01)


def _generate(request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="def add(", max_tokens=4, sampling=_sampling(), stop=["\n\n"], speculate=True,
                              shape=_shape(), request_id=request_id, ssm_names=["ssm"])


def _start() -> pb.SpeculateRequest:
    return pb.SpeculateRequest(start=pb.SpeculateStart(request_id="fuzz-2", context_ids=[5, 6, 7, 8],
                                                       sampling=_sampling(), shape=_shape(), max_depth=3))


def _feedback() -> pb.SpeculateRequest:
    return pb.SpeculateRequest(feedback=pb.SpeculateFeedback(accepted=[9], bonus=10, max_depth=3, shape=_shape()))


@dataclass(frozen=True)
class Method:
    service: str  # "gateway", "verifier" or "speculator": whose port
    path: str
    kind: str  # unary_unary, unary_stream, stream_stream
    seeds: tuple  # valid request messages; a stream sends them in order
    max_replies: int = 3  # a stream still answering after this many replies is cancelled


def _methods() -> list[Method]:
    gw, vf, sp = "/specinfer.v1.Gateway/", "/specinfer.v1.Verifier/", "/specinfer.v1.Speculator/"
    methods = [
        Method("gateway", gw + "Generate", "unary_unary", (_generate(),)),
        Method("gateway", gw + "GenerateStream", "unary_stream", (_generate("fuzz-1"),)),
        Method("gateway", gw + "ResumeStream", "unary_stream", (pb.ResumeStreamRequest(request_id="fuzz-1",
                                                                                       token_offset=1),)),
        Method("gateway", gw + "CancelRequest", "unary_unary", (pb.CancelRequestRequest(request_id="fuzz-1"),)),
        Method("gateway", gw + "GetRequest", "unary_unary", (pb.GetRequestRequest(request_id="fuzz-1"),)),
        Method("gateway", gw + "CreateSession", "unary_unary", (pb.CreateSessionRequest(prefix="import os\n"),)),
        Method("gateway", gw + "DeleteSession", "unary_unary", (pb.DeleteSessionRequest(session_id="fuzz-session"),)),
        Method("gateway", gw + "Info", "unary_unary", (pb.InfoRequest(),)),
        Method("verifier", vf + "Generate", "unary_stream", (pb.VerifierGenerateRequest(
            request_id="fuzz-3", prompt_ids=[5, 6, 7], max_new_tokens=4, sampling=_sampling(), speculate=True,
            shape=_shape(), stop_token_ids=[3], ssm_names=["ssm"]),)),
        Method("verifier", vf + "ReleaseSession", "unary_unary",
               (pb.ReleaseSessionRequest(session_id="fuzz-session"),)),
        Method("verifier", vf + "Info", "unary_unary", (pb.InfoRequest(),)),
        Method("verifier", vf + "Load", "unary_unary", (pb.InfoRequest(),)),
        Method("speculator", sp + "Speculate", "stream_stream", (_start(), _feedback(), _feedback())),
        Method("speculator", sp + "Info", "unary_unary", (pb.InfoRequest(),)),
    ]
    reflect = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    for service in ("gateway", "verifier", "speculator"):
        check = health_pb2.HealthCheckRequest(service=f"specinfer.v1.{service.title()}")
        methods.append(Method(service, "/grpc.health.v1.Health/Check", "unary_unary", (check,)))
        methods.append(Method(service, "/grpc.health.v1.Health/Watch", "unary_stream", (check,), max_replies=1))
        methods.append(Method(service, reflect, "stream_stream", (
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=f"specinfer.v1.{service.title()}"))))
    return methods


# ---- mutations -------------------------------------------------------------------------------
def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _random_varint(rng: random.Random) -> bytes:
    return _varint(rng.choice([0, 1, 127, 128, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 63, 2 ** 64 - 1,
                               rng.getrandbits(rng.choice([7, 14, 32, 64]))]))


_EXTREMES = {
    FieldDescriptor.CPPTYPE_INT32: [-2 ** 31, -1, 0, 1, 2 ** 31 - 1],
    FieldDescriptor.CPPTYPE_INT64: [-2 ** 63, -1, 0, 2 ** 63 - 1],
    FieldDescriptor.CPPTYPE_UINT32: [0, 1, 2 ** 16, 2 ** 31, 2 ** 32 - 1],
    FieldDescriptor.CPPTYPE_UINT64: [0, 2 ** 32, 2 ** 64 - 1],
    FieldDescriptor.CPPTYPE_FLOAT: [math.nan, math.inf, -math.inf, -1.0, 0.0, 1e-38, 3e38],
    FieldDescriptor.CPPTYPE_DOUBLE: [math.nan, math.inf, -1.0, 0.0, 1e308],
    FieldDescriptor.CPPTYPE_BOOL: [True, False],
    FieldDescriptor.CPPTYPE_ENUM: [-1, 0, 1, 2, 99],
    FieldDescriptor.CPPTYPE_STRING: ["", " ", "\x00", "x" * 3000, "é🙂\u202e", "../../etc", "a:b/c", "\n" * 50],
}


def _set_extreme(msg, rng: random.Random) -> None:
    """Sets one field of `msg`, or of a message inside it, to an extreme or odd value."""
    fields = msg.DESCRIPTOR.fields
    if not fields:
        return
    field = rng.choice(fields)
    repeated = (field.is_repeated if hasattr(field, "is_repeated")  # protobuf >= 6: `label` is deprecated
                else field.label == FieldDescriptor.LABEL_REPEATED)
    if field.message_type is not None and field.message_type.GetOptions().map_entry:  # a map: one odd entry
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        entries = getattr(msg, field.name)
        k = rng.choice(_EXTREMES[key.cpp_type])
        if value.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            _set_extreme(entries[k], rng)
        else:
            entries[k] = rng.choice(_EXTREMES[value.cpp_type])
        return
    if field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
        _set_extreme(getattr(msg, field.name).add() if repeated else getattr(msg, field.name), rng)
        return
    values = _EXTREMES[field.cpp_type]
    if field.cpp_type == FieldDescriptor.CPPTYPE_STRING and field.type == FieldDescriptor.TYPE_BYTES:
        values = [v.encode() for v in values]
    if repeated:
        getattr(msg, field.name).extend(rng.choice(values) for _ in range(rng.choice([1, 2, 50, 2000])))
    else:
        setattr(msg, field.name, rng.choice(values))


def mutate(data: bytes, rng: random.Random, message_type=None) -> bytes:
    """One random mutation of a serialized message (or random bytes outright)."""
    buf = bytearray(data)
    how = rng.randrange(10)
    if how >= 8 and message_type is not None:  # parseable, with a field at an extreme value
        msg = message_type.FromString(data)
        for _ in range(rng.randint(1, 3)):
            _set_extreme(msg, rng)
        return msg.SerializeToString()
    if how == 0 or not buf:  # random bytes
        return rng.randbytes(rng.randrange(0, 64))
    if how == 1:  # bit flips
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        return bytes(buf)
    if how == 2:  # truncation
        return bytes(buf[:rng.randrange(len(buf))])
    if how == 3:  # a random varint spliced in
        i = rng.randrange(len(buf) + 1)
        return bytes(buf[:i]) + _random_varint(rng) + bytes(buf[i:])
    if how == 4:  # a random field appended: any field number and wire type
        tag = _varint((rng.randrange(1, 40) << 3) | rng.choice([0, 1, 2, 5]))
        return bytes(buf) + tag + _random_varint(rng) + rng.randbytes(rng.randrange(0, 9))
    if how == 5:  # a byte overwritten
        buf[rng.randrange(len(buf))] = rng.randrange(256)
        return bytes(buf)
    if how == 6:  # a varint field overwritten with an extreme value (field 1..10, wire type 0)
        return bytes(buf) + _varint((rng.randrange(1, 11) << 3)) + _random_varint(rng)
    return bytes(buf) + bytes(buf)  # duplicated: repeated fields grow, scalars are overwritten


# ---- calls -----------------------------------------------------------------------------------
def call(channel: grpc.Channel, method: Method, messages: list[bytes]) -> grpc.StatusCode:
    """Sends raw bytes to one method; the status it ends with (OK also when we stop listening)."""
    try:
        if method.kind == "unary_unary":
            channel.unary_unary(method.path)(messages[0], timeout=CALL_TIMEOUT_S)
            return grpc.StatusCode.OK
        if method.kind == "unary_stream":
            responses = channel.unary_stream(method.path)(messages[0], timeout=CALL_TIMEOUT_S)
        else:
            responses = channel.stream_stream(method.path)(iter(messages), timeout=CALL_TIMEOUT_S)
        for i, _ in enumerate(responses):
            if i + 1 >= method.max_replies:
                responses.cancel()
                break
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.CANCELLED and method.kind != "unary_unary":
            return grpc.StatusCode.OK  # we cancelled it
        if exc.code() in BAD_CODES:
            print(f"{method.path}: {exc.code().name}: {exc.details()} <- {messages!r}")
        return exc.code()


def fuzz_cases(methods: list[Method], num_messages: int, rng: random.Random) -> list[tuple[Method, list[bytes]]]:
    """`num_messages` calls, round robin over the methods; a stream's messages are its seeds with
    one of them mutated, or a valid start followed by garbage."""
    cases = []
    for i in range(num_messages):
        method = methods[i % len(methods)]
        messages = [seed.SerializeToString() for seed in method.seeds]
        j = rng.randrange(len(messages))
        messages[j] = mutate(messages[j], rng, type(method.seeds[j]))
        cases.append((method, messages))
    return cases


@pytest.fixture(scope="module")
def stack(text_pair):
    llm, ssm = text_pair
    bound = {"max_message_bytes": MAX_MESSAGE_BYTES}
    gateway = {"limits": RequestLimits(max_new_tokens=8, max_prompt_tokens=64), **bound}
    with start_stack(llm, [ssm], tree_width=(1, 2, 1), speculator_step_timeout_s=2, is_load_aware=False,
                     speculator=bound, gateway=gateway, **bound) as running:
        yield running


def _channels(stack) -> dict[str, grpc.Channel]:
    return {"gateway": stack.channel(stack.gateway.port), "verifier": stack.channel(stack.verifier.port),
            "speculator": stack.channel(stack.speculators[0][0].port)}


def test_fuzz_every_method_never_internal(stack):
    channels = _channels(stack)
    methods = _methods()
    cases = fuzz_cases(methods, NUM_MESSAGES, random.Random(SEED))
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=8) as pool:
        codes = list(pool.map(lambda case: call(channels[case[0].service], case[0], case[1]), cases))
    tally = Counter(code.name for code in codes)
    per_method = Counter((method.service, method.path, code.name) for (method, _), code in zip(cases, codes))
    print(f"\nfuzz: {len(cases)} calls in {time.monotonic() - started:.1f}s: {dict(tally)}")
    bad = {key: n for key, n in per_method.items() if key[2] in ("INTERNAL", "UNKNOWN")}
    assert not bad, bad
    assert tally["INVALID_ARGUMENT"] > 0 and tally["OK"] > 0  # both paths were exercised
    for name, channel in channels.items():  # every service still answers
        reply = channel.unary_unary("/grpc.health.v1.Health/Check")(
            health_pb2.HealthCheckRequest().SerializeToString(), timeout=5)
        assert health_pb2.HealthCheckResponse.FromString(reply).status == health_pb2.HealthCheckResponse.SERVING, name


@pytest.mark.parametrize("method", _methods(), ids=lambda m: f"{m.service}{m.path}")
def test_undecodable_request_is_invalid_argument_on_every_method(stack, method):
    garbage = b"\x0a\xff\xff\xff\xff\x0f"  # field 1, length-delimited, longer than the message
    channel = _channels(stack)[method.service]
    with pytest.raises(grpc.RpcError) as err:
        if method.kind == "unary_unary":
            channel.unary_unary(method.path)(garbage, timeout=5)
        elif method.kind == "unary_stream":
            list(channel.unary_stream(method.path)(garbage, timeout=5))
        else:
            list(channel.stream_stream(method.path)(iter([garbage]), timeout=5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("malformed request: Error parsing message")


def test_undecodable_message_mid_stream_is_invalid_argument(stack):
    """Speculate is a bidirectional stream: a valid start gets its tree, then garbage ends the
    stream with INVALID_ARGUMENT."""
    channel = _channels(stack)["speculator"]
    replies = []
    with pytest.raises(grpc.RpcError) as err:
        for reply in channel.stream_stream("/specinfer.v1.Speculator/Speculate")(
                iter([_start().SerializeToString(), b"\x12\xff\xff\xff\xff\x0f"]), timeout=10):
            replies.append(pb.SpeculateResponse.FromString(reply))
    assert len(replies) == 1 and len(replies[0].tree.tokens) >= 1
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("malformed request: ")


@pytest.mark.parametrize("service", ["gateway", "verifier", "speculator"])
def test_oversize_request_is_resource_exhausted_and_the_service_stays_healthy(stack, service):
    """Each service applies its configured bound: one byte over it is RESOURCE_EXHAUSTED at once,
    just under it the request is the servicer's (here: a bad request, INVALID_ARGUMENT)."""
    channel = _channels(stack)[service]
    path = {"gateway": "/specinfer.v1.Gateway/Generate", "verifier": "/specinfer.v1.Verifier/Generate",
            "speculator": "/specinfer.v1.Speculator/Speculate"}[service]
    header = len(pb.GenerateRequest(prompt="x" * MAX_MESSAGE_BYTES).SerializeToString()) - MAX_MESSAGE_BYTES
    fits = pb.GenerateRequest(prompt="x" * (MAX_MESSAGE_BYTES - header)).SerializeToString()
    oversize = pb.GenerateRequest(prompt="x" * (MAX_MESSAGE_BYTES - header + 1)).SerializeToString()
    assert len(fits) == MAX_MESSAGE_BYTES and len(oversize) == MAX_MESSAGE_BYTES + 1

    def send(data: bytes):
        if service == "speculator":
            return list(channel.stream_stream(path)(iter([data]), timeout=10))
        if service == "verifier":
            return list(channel.unary_stream(path)(data, timeout=10))
        return channel.unary_unary(path)(data, timeout=10)

    with pytest.raises(grpc.RpcError) as err:
        send(oversize)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # refused at once, not at its deadline
    with pytest.raises(grpc.RpcError) as err:
        send(fits)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    reply = channel.unary_unary("/grpc.health.v1.Health/Check")(
        health_pb2.HealthCheckRequest().SerializeToString(), timeout=5)
    assert health_pb2.HealthCheckResponse.FromString(reply).status == health_pb2.HealthCheckResponse.SERVING
