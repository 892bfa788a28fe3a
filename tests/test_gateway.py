"""The public gateway, end to end over real gRPC on localhost, against a fake Verifier.

Covers generation (unary and streamed), the validation matrix, NOT_FOUND and RESOURCE_EXHAUSTED,
stop sequences, sessions, cancellation (client-side and CancelRequest) freeing the verifier call
within 1 s, resuming with no duplicate or missing tokens, a verifier outage, a Redis outage and
a real Redis round trip, deadlines, health, reflection, tracing, metrics, and the client library.
"""

from __future__ import annotations

import argparse
import json
import re
import math
import shutil
import socket
import subprocess
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fake_verifier import FakeVerifier, cycle_successor, expected_tokens, start_fake_verifier
from services.gateway.admission import AdmissionConfig
from services.gateway.config import GatewayConfig, config_from_args
from specinfer.errors import UserError
from services.gateway.server import serve
from services.gateway.stops import TextState, held_back_len
from services.gateway.store import MemoryStore, RedisStore
from specinfer.cli.client import GatewayClient, GatewayError, add_client_parser, run_client
from specinfer.limits import RequestLimits
from specinfer.serving.metrics import new_registry
from specinfer.serving.tracing import outgoing_metadata, setup_tracing
from specinfer.tokenizer import TextTokenizer
from specinfer.v1 import specinfer_pb2 as pb
from specinfer.v1 import specinfer_pb2_grpc as pb_grpc
from util import add_tokenizer, free_port, wait_until

VOCAB = 400
CORPUS = ["the quick brown fox jumps over the lazy dog. ", "hello world, hello gateway. ",
          "stop here and go on. ", "caf\u00e9 na\u00efve r\u00e9sum\u00e9. "] * 30
SCRIPT_TEXT = " quick brown fox jumps over lazy dog."
LIMITS = RequestLimits(max_prompt_tokens=64, max_new_tokens=256, default_max_new_tokens=16, max_concurrent_requests=8,
                       max_stop_sequences=4, max_tree_depth=8)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gateway_tok")
    add_tokenizer(d, VOCAB, CORPUS)
    return d


@pytest.fixture(scope="module")
def tokenizer(tok_dir) -> TextTokenizer:
    return TextTokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def script(tokenizer) -> list[int]:
    """Distinct token ids cycling through a readable text, plus 'é' split into two byte tokens."""
    ids = list(dict.fromkeys(tokenizer.encode(SCRIPT_TEXT)))
    byte_ids = [tokenizer.tok.token_to_id("\u00c3"), tokenizer.tok.token_to_id("\u00a9")]  # UTF-8 of 'é'
    assert None not in byte_ids and not set(byte_ids) & set(ids)
    return ids + byte_ids


@pytest.fixture(scope="module")
def fake_server(script):
    fake = FakeVerifier(cycle_successor(script), max_context=240)
    server = start_fake_verifier(fake)
    yield fake, server
    server.stop(0)


@pytest.fixture
def fake(fake_server) -> FakeVerifier:
    fake_server[0].reset()
    return fake_server[0]


def gateway_config(verifier_port: int, **overrides) -> GatewayConfig:
    return GatewayConfig(**{"port": 0, "verifier_addr": f"127.0.0.1:{verifier_port}", "limits": LIMITS,
                            "grace_s": 0.5, **overrides})


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def gateway(fake_server, tok_dir, tokenizer, exporter):
    registry = new_registry()
    tracer = setup_tracing("specinfer-gateway", None, exporter=exporter)
    # A fixed limit: these tests run requests side by side (admission's own tests build their gateways).
    gw = serve(gateway_config(fake_server[1].port, model_dir=tok_dir, admission=AdmissionConfig(latency_factor=0)),
               tracer, registry, tokenizer=tokenizer)
    gw.registry = registry
    yield gw
    gw.stop(0)


@pytest.fixture(scope="module")
def channel(gateway):
    ch = grpc.insecure_channel(f"127.0.0.1:{gateway.port}")
    yield ch
    ch.close()


@pytest.fixture
def stub(channel) -> pb_grpc.GatewayStub:
    return pb_grpc.GatewayStub(channel)


def gen_request(prompt: str = "hello", **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, **kw)


def status_of(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


def collect(stream) -> tuple[list[int], str, list[pb.GenerateStreamResponse]]:
    msgs = list(stream)
    ids = [t for m in msgs for t in m.token_ids]
    return ids, "".join(m.text_delta for m in msgs), msgs


def wait_status(stub, request_id: str, status: str, timeout_s: float = 2.0) -> pb.RequestState:
    deadline = time.monotonic() + timeout_s
    while True:
        state = stub.GetRequest(pb.GetRequestRequest(request_id=request_id), timeout=5)
        if state.status == status or time.monotonic() > deadline:
            return state
        time.sleep(0.01)


# -- generation ------------------------------------------------------------------------------
def test_generate_unary(stub, fake, tokenizer, script):
    resp = stub.Generate(gen_request("hello", max_tokens=10), timeout=10)
    prompt_ids = tokenizer.encode("hello")
    want = expected_tokens(cycle_successor(script), prompt_ids[-1], 10)
    assert list(resp.token_ids) == want
    assert resp.text == tokenizer.decode(want)
    assert resp.finish_reason == "length" and resp.request_id
    assert resp.stats.output_tokens == 10 and resp.stats.prompt_tokens == len(prompt_ids)
    assert resp.stats.tokens_per_step == pytest.approx(2.0) and resp.stats.llm_steps == 5
    assert resp.stats.latency_s > 0
    (call,) = fake.calls
    assert list(call.request.prompt_ids) == prompt_ids and call.request.max_new_tokens == 10
    assert call.request.speculate and call.request.request_id == resp.request_id
    assert call.request.sampling.HasField("seed")


def test_default_max_tokens_and_params_pass_through(stub, fake):
    resp = stub.Generate(gen_request(
        "hi", sampling=pb.SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=42), speculate=False,
        shape=pb.TreeShape(widths=[1, 2], max_nodes=8), ignore_eos=True), timeout=10)
    assert len(resp.token_ids) == LIMITS.default_max_new_tokens
    req = fake.calls[0].request
    assert not req.speculate and req.ignore_eos and list(req.shape.widths) == [1, 2] and req.shape.max_nodes == 8
    assert req.sampling.temperature == pytest.approx(0.7) and req.sampling.top_p == pytest.approx(0.9)
    assert req.sampling.top_k == 5 and req.sampling.seed == 42


def test_generate_stream(stub, fake, tokenizer, script):
    ids, text, msgs = collect(stub.GenerateStream(gen_request("hello", max_tokens=25), timeout=10))
    want = expected_tokens(cycle_successor(script), tokenizer.encode("hello")[-1], 25)
    assert ids == want and text == tokenizer.decode(want)
    assert msgs[0].request_id and not msgs[0].token_ids  # the id comes first
    assert all(m.request_id == msgs[0].request_id for m in msgs)
    offset = 0
    for m in msgs:
        assert m.token_offset == offset
        offset += len(m.token_ids)
        assert "\ufffd" not in m.text_delta  # never a split UTF-8 character
    assert msgs[-1].finish_reason == "length" and msgs[-1].stats.output_tokens == 25
    assert "\u00e9" in text


def test_retry_with_same_request_id_is_idempotent(stub, fake):
    rid = f"idem-{uuid.uuid4().hex[:8]}"
    first = stub.Generate(gen_request("hello", max_tokens=6, request_id=rid), timeout=10)
    again = stub.Generate(gen_request("hello", max_tokens=6, request_id=rid), timeout=10)
    assert list(again.token_ids) == list(first.token_ids) and again.text == first.text
    assert len(fake.calls) == 1
    err = status_of(lambda: stub.Generate(gen_request("other", request_id=rid), timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.details()


def test_request_id_reused_with_different_parameters_is_refused(stub, fake):
    rid = f"params-{uuid.uuid4().hex[:8]}"
    fake.reset(delay_s=0.05)
    running = stub.GenerateStream(gen_request("hello", max_tokens=100, request_id=rid,
                                              sampling=pb.SamplingParams(temperature=0.5, seed=7)), timeout=10)
    next(running)
    changed = [dict(max_tokens=101, sampling=pb.SamplingParams(temperature=0.5, seed=7)),
               dict(max_tokens=100, sampling=pb.SamplingParams(temperature=0.6, seed=7)),
               dict(max_tokens=100, sampling=pb.SamplingParams(temperature=0.5, seed=8)),
               dict(max_tokens=100, sampling=pb.SamplingParams(temperature=0.5, seed=7), stop=["x"])]
    for fields in changed:  # while it runs, and once it has finished
        err = status_of(lambda: stub.Generate(gen_request("hello", request_id=rid, **fields), timeout=10))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
        assert err.details().startswith("request_id:") and "different parameters" in err.details()
    same = stub.Generate(gen_request("hello", max_tokens=100, request_id=rid,
                                     sampling=pb.SamplingParams(temperature=0.5, seed=7)), timeout=10)
    ids, _, _ = collect(running)
    assert list(same.token_ids) == ids and len(ids) == 100 and len(fake.calls) == 1
    err = status_of(lambda: stub.Generate(gen_request("hello", max_tokens=99, request_id=rid,
                                                      sampling=pb.SamplingParams(temperature=0.5, seed=7)),
                                          timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "different parameters" in err.details()
    unseeded = f"params-{uuid.uuid4().hex[:8]}"  # a retry naming no seed matches the seed the gateway drew
    first = stub.Generate(gen_request("hello", max_tokens=4, request_id=unseeded), timeout=10)
    assert list(stub.Generate(gen_request("hello", max_tokens=4, request_id=unseeded),
                              timeout=10).token_ids) == list(first.token_ids)


# -- validation ------------------------------------------------------------------------------
INVALID = [
    ("empty prompt", dict(prompt=""), "prompt"),
    ("prompt too long", dict(prompt="hello world " * 200), "prompt"),
    ("negative max_tokens", dict(max_tokens=-1), "max_tokens"),
    ("zero max_tokens", dict(max_tokens=0), "max_tokens"),
    ("over the model's context", dict(max_tokens=LIMITS.max_new_tokens), "max_tokens"),
    ("max_tokens over limit", dict(max_tokens=LIMITS.max_new_tokens + 1), "max_tokens"),
    ("negative temperature", dict(sampling=pb.SamplingParams(temperature=-0.5)), "temperature"),
    ("NaN temperature", dict(sampling=pb.SamplingParams(temperature=math.nan)), "temperature"),
    ("top_p above 1", dict(sampling=pb.SamplingParams(top_p=1.5)), "top_p"),
    ("negative top_p", dict(sampling=pb.SamplingParams(top_p=-0.1)), "top_p"),
    ("negative top_k", dict(sampling=pb.SamplingParams(top_k=-1)), "top_k"),
    ("too many stops", dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    ("empty stop", dict(stop=["ok", ""]), "stop"),
    ("zero tree width", dict(shape=pb.TreeShape(widths=[1, 0, 2])), "shape.widths"),
    ("tree too deep", dict(shape=pb.TreeShape(widths=[1] * 9)), "shape.widths"),
    ("bad request id", dict(request_id="no spaces!"), "request_id"),
    ("presence penalty out of range", dict(sampling=pb.SamplingParams(presence_penalty=2.5)), "presence_penalty"),
    ("repetition penalty out of range", dict(sampling=pb.SamplingParams(repetition_penalty=-1)),
     "repetition_penalty"),
    ("min_p above 1", dict(sampling=pb.SamplingParams(min_p=1.5)), "min_p"),
    ("logit bias out of range", dict(sampling=pb.SamplingParams(logit_bias={5: 200.0})), "logit_bias"),
    ("constraint with no kind", dict(constraint=pb.Constraint()), "constraint"),
    ("empty regex", dict(constraint=pb.Constraint(regex="")), "regex"),
    ("no choices", dict(constraint=pb.Constraint(choice=pb.ChoiceConstraint())), "choice"),
]


@pytest.mark.parametrize("fields,name", [(f, n) for _, f, n in INVALID], ids=[c for c, _, _ in INVALID])
def test_invalid_argument(stub, fake, fields, name):
    request = pb.GenerateRequest(**{"prompt": "hello", **fields})
    for call in (lambda: stub.Generate(request, timeout=5), lambda: list(stub.GenerateStream(request, timeout=5))):
        err = status_of(call)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
        assert name in err.details()
    assert fake.calls == []  # nothing went downstream


def test_not_found(stub, fake):
    err = status_of(lambda: stub.Generate(gen_request(session_id="nope"), timeout=5))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "session_id" in err.details()
    for call in (lambda: stub.GetRequest(pb.GetRequestRequest(request_id="nope"), timeout=5),
                 lambda: stub.CancelRequest(pb.CancelRequestRequest(request_id="nope"), timeout=5),
                 lambda: list(stub.ResumeStream(pb.ResumeStreamRequest(request_id="nope"), timeout=5))):
        err = status_of(call)
        assert err.code() == grpc.StatusCode.NOT_FOUND and "request_id" in err.details()
    assert fake.calls == []


def test_admission_queues_what_starts_soon_and_refuses_the_rest_at_once(fake_server, tok_dir, tokenizer):
    """Past the limit a request waits in a FIFO queue while it is predicted to start within its
    bound (the running request's tokens left at the measured pace); it runs when the slot frees.
    A full queue, or a predicted wait past the request's deadline, is refused at once with
    RESOURCE_EXHAUSTED and a retry hint in the trailers."""
    fake, server = fake_server
    fake.reset(delay_s=0.05)
    admission = AdmissionConfig(latency_factor=0, max_queued=1, queue_timeout_s=60, queue_factor=1000)
    gw = serve(gateway_config(server.port, model_dir=tok_dir, limits=replace(LIMITS, max_concurrent_requests=1),
                              admission=admission), trace.NoOpTracer(), new_registry(), tokenizer=tokenizer)
    pool = ThreadPoolExecutor(2)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
            s = pb_grpc.GatewayStub(ch)
            first = s.GenerateStream(gen_request(max_tokens=200), timeout=60)
            assert wait_until(lambda: gw.core.admission.token_s() is not None, 5.0)  # the pace is measured

            def generate(max_tokens: int, timeout_s: float = 30):
                try:
                    return s.Generate(gen_request(max_tokens=max_tokens), timeout=timeout_s)
                except grpc.RpcError as exc:
                    return exc

            queued = pool.submit(generate, 5)
            assert wait_until(lambda: gw.core.admission.num_queued == 1, 10)
            err = status_of(lambda: s.Generate(gen_request(max_tokens=5), timeout=30))  # the queue is full
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in err.details()
            hints = dict(err.trailing_metadata())
            assert int(hints["retry-after"]) >= 1 and int(hints["grpc-retry-pushback-ms"]) > 0
            first.cancel()  # frees the slot: the queued request runs
            resp = queued.result(10)
            assert not isinstance(resp, grpc.RpcError), resp
            assert len(resp.token_ids) == 5

            second = s.GenerateStream(gen_request(max_tokens=200), timeout=60)
            assert next(second).request_id and gw.core.admission.num_running == 1
            err = generate(5, timeout_s=1.0)  # its deadline ends long before the slot frees
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "predicted" in err.details(), err
            assert int(dict(err.trailing_metadata())["retry-after"]) >= 2
            second.cancel()
            assert wait_until(lambda: gw.core.admission.num_running == 0 and gw.core.admission.num_queued == 0, 5)
    finally:
        pool.shutdown(wait=False)
        gw.stop(0)


class SteppingClock:
    """A clock that moves `step_s` on every reading: each verified step is read once."""

    def __init__(self, step_s: float):
        self.now, self.step_s = 1000.0, step_s

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


def test_admission_measures_time_per_output_token(fake_server, tok_dir, tokenizer):
    """A speculative step brings several tokens in one longer step: admission sees its time per
    token, so a speculating request does not look like a slower, more loaded verifier."""
    fake, server = fake_server
    fake.reset(tokens_per_step=4)
    gw = serve(gateway_config(server.port, model_dir=tok_dir), trace.NoOpTracer(), new_registry(), tokenizer=tokenizer)
    gw.core.deps = replace(gw.core.deps, clock=SteppingClock(0.2))  # 0.2 s per step, 0.05 s per token
    try:
        with grpc.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
            pb_grpc.GatewayStub(ch).Generate(gen_request(max_tokens=24), timeout=10)
        samples = [seconds for _, seconds in gw.core.admission.model.samples]
        assert len(samples) == 5  # 6 steps of 4 tokens: the first has no step before it
        assert samples == pytest.approx([0.05] * 5)  # per token, not the 0.2 s step
    finally:
        gw.stop(0)


class GatedStore(MemoryStore):
    """A store whose running-progress writes wait for `gate` (a slow or stalled Redis)."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    def put_progress(self, request_id, progress, drop_steps=()):
        if progress.status == "running":
            self.gate.wait(10)
        return super().put_progress(request_id, progress, drop_steps)

    def put_step(self, request_id, offset, ids, text_delta):
        self.gate.wait(10)
        return super().put_step(request_id, offset, ids, text_delta)


def test_clients_see_only_tokens_already_stored(fake_server, tok_dir, tokenizer):
    """A token reaches a client only after the store holds it: a gateway killed at any moment
    cannot have shown a token that a resume by offset would not find."""
    fake, server = fake_server
    fake.reset(delay_s=0.01)
    store = GatedStore()
    gw = serve(gateway_config(server.port, model_dir=tok_dir), trace.NoOpTracer(), new_registry(), store=store,
               tokenizer=tokenizer)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
            stream = pb_grpc.GatewayStub(ch).GenerateStream(gen_request(max_tokens=20), timeout=10)
            rid = next(stream).request_id
            got: list[int] = []
            reader = threading.Thread(target=lambda: got.extend(t for m in stream for t in m.token_ids))
            reader.start()
            assert wait_until(lambda: fake.calls and fake.calls[0].num_sent >= 5, 5.0)
            time.sleep(0.3)
            assert got == [] and store.get_request(rid).generated_ids == ()
            store.gate.set()
            reader.join(10)
            assert len(got) == 20 and list(store.get_request(rid).generated_ids) == got
    finally:
        gw.stop(0)


# -- stop sequences --------------------------------------------------------------------------
def test_stop_sequence_truncates_and_cancels_verifier(stub, fake, tokenizer, script):
    want = expected_tokens(cycle_successor(script), tokenizer.encode("hello")[-1], 200)
    full = tokenizer.decode(want)
    stop = " over"
    assert stop in full
    resp = stub.Generate(gen_request("hello", max_tokens=200, stop=[stop, "zzz"]), timeout=10)
    assert resp.finish_reason == "stop" and resp.text == full[: full.find(stop)]
    assert stop in tokenizer.decode(list(resp.token_ids))  # tokens run up to the one completing the stop
    call = fake.calls[0]
    assert call.wait_ended(10) and call.is_cancelled and call.num_sent < 200

    ids, text, msgs = collect(stub.GenerateStream(gen_request("hello", max_tokens=200, stop=[stop]), timeout=10))
    assert text == resp.text and ids == list(resp.token_ids) and msgs[-1].finish_reason == "stop"
    assert not any(stop.strip() in m.text_delta for m in msgs)


def test_text_state_holds_back_stop_prefixes(tokenizer):
    assert held_back_len("abc ov", (" over",)) == 3 and held_back_len("abc", (" over",)) == 0
    ids = tokenizer.encode(" the lazy dog. hello")
    state = TextState(tokenizer, (" dog",))
    texts = []
    for t in ids:
        is_stop = state.push(t)
        texts.append(state.visible)
        if is_stop:
            break
    assert state.is_stopped and state.final_text() == " the lazy"
    assert all(" dog" not in t for t in texts)
    assert TextState.replay(tokenizer, (" dog",), ids).final_text() == " the lazy"


SPECULATION_FIGURES = ("mean_accepted", "mean_tree_nodes", "acceptance_rate")


def test_stats_report_only_measured_values(stub, fake, tokenizer):
    """The verifier measures acceptance; a request the gateway ends early (a stop string, a cancel)
    never gets that measurement, so it reports its own counts and leaves the figures unset."""
    done = stub.Generate(gen_request("hello", max_tokens=10), timeout=10)
    assert all(done.stats.HasField(name) for name in SPECULATION_FIGURES)
    assert done.stats.mean_tree_nodes == pytest.approx(4.0) and done.stats.acceptance_rate == pytest.approx(1 / 3)

    stopped = stub.Generate(gen_request("hello", max_tokens=200, stop=[" over"]), timeout=10)
    assert stopped.finish_reason == "stop"
    stored = stub.GetRequest(pb.GetRequestRequest(request_id=stopped.request_id), timeout=5)
    for stats in (stopped.stats, stored.stats):
        assert stats.llm_steps > 0 and stats.output_tokens == len(stopped.token_ids) > 0
        assert stats.prompt_tokens == len(tokenizer.encode("hello")) and stats.latency_s > 0
        assert stats.tokens_per_step == pytest.approx(stats.output_tokens / stats.llm_steps)
        assert not any(stats.HasField(name) for name in SPECULATION_FIGURES)

    fake.reset(delay_s=0.03)
    stream = stub.GenerateStream(gen_request(max_tokens=200), timeout=10)
    rid = next(stream).request_id
    next(stream)
    assert stub.CancelRequest(pb.CancelRequestRequest(request_id=rid), timeout=5).cancelled
    last = list(stream)[-1]
    assert last.finish_reason == "cancelled" and last.stats.llm_steps > 0
    assert not any(last.stats.HasField(name) for name in SPECULATION_FIGURES)


# -- sessions --------------------------------------------------------------------------------
def test_sessions_reuse_history(stub, fake, tokenizer):
    sid = stub.CreateSession(pb.CreateSessionRequest(prefix="System: be brief."), timeout=5).session_id
    r1 = stub.Generate(gen_request("hello", max_tokens=4, session_id=sid), timeout=10)
    r2 = stub.Generate(gen_request(" go on", max_tokens=3, session_id=sid), timeout=10)
    c1, c2 = fake.calls
    prefix_ids = tokenizer.encode("System: be brief.")
    assert list(c1.request.prompt_ids) == prefix_ids + tokenizer.encode("hello")
    assert list(c2.request.prompt_ids) == list(c1.request.prompt_ids) + list(r1.token_ids) + tokenizer.encode(" go on")
    assert c1.request.session_id == sid and c2.request.session_id == sid
    assert r2.stats.prompt_tokens == len(c2.request.prompt_ids)

    assert stub.DeleteSession(pb.DeleteSessionRequest(session_id=sid), timeout=5).deleted
    assert fake.released == [sid]
    err = status_of(lambda: stub.Generate(gen_request(session_id=sid), timeout=5))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert not stub.DeleteSession(pb.DeleteSessionRequest(session_id=sid), timeout=5).deleted


# -- cancellation and resume -----------------------------------------------------------------
def test_cancel_request_stops_the_verifier_call(stub, fake):
    fake.reset(delay_s=0.05)
    stream = stub.GenerateStream(gen_request(max_tokens=200), timeout=10)
    rid = next(stream).request_id
    next(stream)
    assert stub.CancelRequest(pb.CancelRequestRequest(request_id=rid), timeout=5).cancelled
    call = fake.calls[0]
    assert call.wait_ended(10) and call.is_cancelled  # ended, and not by finishing its 200 tokens
    rest = list(stream)
    assert rest[-1].finish_reason == "cancelled"
    assert stub.GetRequest(pb.GetRequestRequest(request_id=rid), timeout=5).status == "cancelled"
    assert not stub.CancelRequest(pb.CancelRequestRequest(request_id=rid), timeout=5).cancelled
    resumed = list(stub.ResumeStream(pb.ResumeStreamRequest(request_id=rid), timeout=5))
    assert resumed[-1].finish_reason == "cancelled" and len(fake.calls) == 1  # not resumable


def test_client_disconnect_interrupts_and_resume_continues(stub, fake, tokenizer, script):
    fake.reset(delay_s=0.03)
    rid = f"resume-{uuid.uuid4().hex[:8]}"
    stream = stub.GenerateStream(gen_request("hello", max_tokens=40, request_id=rid), timeout=10)
    got_ids, got_text = [], ""
    for msg in stream:
        got_ids += list(msg.token_ids)
        got_text += msg.text_delta
        if len(got_ids) >= 6:
            break
    stream.cancel()
    call = fake.calls[0]
    assert call.wait_ended(10) and call.is_cancelled  # ended, and not by finishing its 40 tokens
    state = wait_status(stub, rid, "interrupted")
    assert state.status == "interrupted" and len(state.token_ids) >= len(got_ids)

    ids, text, msgs = collect(stub.ResumeStream(pb.ResumeStreamRequest(request_id=rid, token_offset=len(got_ids)),
                                                timeout=10))
    want = expected_tokens(cycle_successor(script), tokenizer.encode("hello")[-1], 40)
    assert got_ids + ids == want  # no duplicates, none missing
    assert got_text + text == tokenizer.decode(want)
    assert msgs[0].token_offset == len(got_ids) and msgs[-1].finish_reason == "length"
    cont = fake.calls[1].request
    assert list(cont.prompt_ids) == tokenizer.encode("hello") + list(state.token_ids)
    assert cont.max_new_tokens == 40 - len(state.token_ids)
    final = stub.GetRequest(pb.GetRequestRequest(request_id=rid), timeout=5)
    assert final.status == "finished" and list(final.token_ids) == want and final.stats.output_tokens == 40
    replay_ids, replay_text, _ = collect(stub.ResumeStream(pb.ResumeStreamRequest(request_id=rid), timeout=5))
    assert replay_ids == want and replay_text == final.text and len(fake.calls) == 2


PENALIZED = pb.SamplingParams(temperature=0.5, top_p=1.0, seed=9, frequency_penalty=0.5, presence_penalty=0.25,
                              repetition_penalty=1.5, min_p=0.125, logit_bias={7: -100.0, 3: 2.0})
CHOICE = pb.Constraint(choice=pb.ChoiceConstraint(choices=["yes", "no"]))


def test_penalties_and_constraint_reach_the_verifier(stub, fake):
    stub.Generate(gen_request("hello", max_tokens=4, sampling=PENALIZED, constraint=CHOICE), timeout=10)
    req = fake.calls[0].request
    assert req.sampling == PENALIZED and req.constraint == CHOICE and req.num_resumed_tokens == 0
    stub.Generate(gen_request("hello", max_tokens=4), timeout=10)
    plain = fake.calls[1].request
    assert not plain.HasField("constraint") and plain.sampling.repetition_penalty == 0  # unset: none
    assert not plain.sampling.logit_bias and plain.sampling.presence_penalty == 0


def test_a_continued_request_counts_its_output_as_resumed(stub, fake, tokenizer):
    """The continuation's prompt ends with the tokens generated so far: it says how many, so the
    verifier's penalties count them as output and a constraint resumes past them; everything
    else the request asked for is read back from the store unchanged."""
    fake.reset(delay_s=0.03)
    rid = f"resumed-{uuid.uuid4().hex[:8]}"
    stream = stub.GenerateStream(gen_request("hello", max_tokens=30, request_id=rid, sampling=PENALIZED,
                                             constraint=CHOICE), timeout=10)
    num_got = 0
    for msg in stream:
        num_got += len(msg.token_ids)
        if num_got >= 6:
            break
    stream.cancel()
    state = wait_status(stub, rid, "interrupted")
    collect(stub.ResumeStream(pb.ResumeStreamRequest(request_id=rid), timeout=10))
    first, cont = fake.calls[0].request, fake.calls[1].request
    assert first.num_resumed_tokens == 0 and 0 < len(state.token_ids) == cont.num_resumed_tokens
    assert list(cont.prompt_ids[-cont.num_resumed_tokens:]) == list(state.token_ids)
    assert len(cont.prompt_ids) - cont.num_resumed_tokens == len(tokenizer.encode("hello"))
    assert cont.constraint == CHOICE
    cont.sampling.ClearField("seed")  # a continuation's seed is derived from the request's
    assert cont.sampling == pb.SamplingParams(**{**{f.name: v for f, v in PENALIZED.ListFields()}, "seed": None})


def test_the_verifiers_refusal_is_invalid_argument(stub, fake):
    """What only the verifier can check (a schema that compiles, tokens inside its vocabulary)
    comes back to the client as INVALID_ARGUMENT with the verifier's message."""
    fake.refuse = lambda req: "json_schema: does not compile" if req.HasField("constraint") else None
    bad = gen_request("hello", max_tokens=4, constraint=pb.Constraint(json_schema='{"type": "nope"}'))
    for call in (lambda: stub.Generate(bad, timeout=5), lambda: list(stub.GenerateStream(bad, timeout=5))):
        err = status_of(call)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "json_schema: does not compile" in err.details()


def test_resume_attaches_to_a_live_request(stub, fake):
    fake.reset(delay_s=0.03)
    stream = stub.GenerateStream(gen_request(max_tokens=30), timeout=10)
    rid = next(stream).request_id
    ids, _, _ = collect(stub.ResumeStream(pb.ResumeStreamRequest(request_id=rid, token_offset=0), timeout=10))
    first_ids, _, _ = collect(stream)
    assert ids == first_ids and len(ids) == 30 and len(fake.calls) == 1


def test_disconnect_right_after_the_request_id_stops_the_verifier(stub, fake):
    fake.reset(delay_s=0.05)
    stream = stub.GenerateStream(gen_request(max_tokens=200), timeout=10)
    rid = next(stream).request_id
    (call,) = fake.wait_for_calls(1)
    stream.cancel()
    assert call.wait_ended(10) and call.is_cancelled
    assert wait_status(stub, rid, "interrupted").status == "interrupted"


def test_gateways_sharing_a_store_follow_and_take_over(fake, fake_server, tok_dir, tokenizer, script):
    """A second gateway follows a request running on the first, then continues it once the first
    shuts down (a restart), and takes over an orphan whose gateway died without a word."""
    fake.reset(delay_s=0.04)
    store = MemoryStore()
    cfg = gateway_config(fake_server[1].port, model_dir=tok_dir)
    gw_a = serve(cfg, trace.NoOpTracer(), new_registry(), store=store, tokenizer=tokenizer)
    gw_b = serve(replace(cfg, gateway_id="b"), trace.NoOpTracer(), new_registry(), store=store, tokenizer=tokenizer)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{gw_a.port}") as ch_a, \
                grpc.insecure_channel(f"127.0.0.1:{gw_b.port}") as ch_b:
            a, b = pb_grpc.GatewayStub(ch_a), pb_grpc.GatewayStub(ch_b)
            want = expected_tokens(cycle_successor(script), tokenizer.encode("hello")[-1], 30)
            stream = a.GenerateStream(gen_request("hello", max_tokens=30), timeout=10)
            rid = next(stream).request_id
            followed, _, _ = collect(b.ResumeStream(pb.ResumeStreamRequest(request_id=rid), timeout=10))
            assert followed == want == collect(stream)[0] and len(fake.calls) == 1

            fake.reset(delay_s=0.04)
            stream = a.GenerateStream(gen_request("hello", max_tokens=30), timeout=10)
            rid = next(stream).request_id
            next(stream)
            gw_a.stop(0.0)  # a restart: in-flight requests become interrupted
            assert store.get_request(rid).status == "interrupted"
            ids, _, _ = collect(b.ResumeStream(pb.ResumeStreamRequest(request_id=rid), timeout=10))
            assert ids == want and len(fake.calls) == 2

            rec = store.get_request(rid)
            orphan = replace(rec, request_id="orphan", status="running", owner="dead", generated_ids=tuple(want[:7]),
                             updated_at=time.time() - 3600, text="")
            assert store.create_request(orphan)
            ids, _, _ = collect(b.ResumeStream(pb.ResumeStreamRequest(request_id="orphan", token_offset=7),
                                               timeout=10))
            assert ids == want[7:]

            # A gateway that keeps a lease and died: its fresh "running" record is taken over at
            # once, not after stale_after_s; one whose owner's lease is live is followed instead.
            fake.reset(delay_s=0.04)
            gone = replace(orphan, request_id="gone", owner="gone", updated_at=time.time(), is_leased=True)
            assert store.create_request(gone)
            assert not gw_b.core._is_running_elsewhere(store.get_request("gone"))  # its owner holds no lease
            # Waiting for it to go stale would outlast the call's deadline (half of stale_after_s).
            ids, _, _ = collect(b.ResumeStream(pb.ResumeStreamRequest(request_id="gone", token_offset=7),
                                               timeout=cfg.stale_after_s / 2))
            assert ids == want[7:]
            store.renew_lease("alive", 60)
            held = replace(orphan, request_id="held", owner="alive", updated_at=time.time(), is_leased=True)
            assert store.create_request(held)
            assert gw_b.core._is_running_elsewhere(store.get_request("held"))
            store.drop_lease("alive")
            assert not gw_b.core._is_running_elsewhere(store.get_request("held"))
            assert store.has_lease("b") and not store.has_lease(cfg.gateway_id)  # a stopped gateway gave it up
            gw_b.stop(0)
            assert not store.has_lease("b")
    finally:
        gw_a.stop(0)
        gw_b.stop(0)


# -- deadlines -------------------------------------------------------------------------------
def test_deadline_exceeded_and_propagated(stub, fake):
    fake.reset(delay_s=0.1)
    err = status_of(lambda: stub.Generate(gen_request(max_tokens=100), timeout=0.4))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    call = fake.calls[0]
    assert call.time_remaining is not None and call.time_remaining <= 0.4  # the client's deadline, passed on
    assert call.wait_ended(10) and call.is_cancelled  # ended there, not after its 100 tokens


def test_default_deadline_when_client_sets_none(stub, fake):
    stub.Generate(gen_request(max_tokens=2))
    assert 250 < fake.calls[0].time_remaining <= 300


# -- failures --------------------------------------------------------------------------------
def test_verifier_down_then_resumable(tok_dir, tokenizer, script):
    port = free_port()
    gw = serve(gateway_config(port, model_dir=tok_dir), trace.NoOpTracer(), new_registry(), tokenizer=tokenizer)
    fake = FakeVerifier(cycle_successor(script))
    verifier = None
    try:
        with grpc.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
            s = pb_grpc.GatewayStub(ch)
            rid = f"down-{uuid.uuid4().hex[:8]}"
            # UNAVAILABLE once the route wait is over (test_routing.py), not at the call's deadline
            err = status_of(lambda: list(s.GenerateStream(gen_request("hello", max_tokens=12, request_id=rid),
                                                          timeout=30)))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert s.GetRequest(pb.GetRequestRequest(request_id=rid), timeout=5).status == "interrupted"

            verifier = start_fake_verifier(fake, port)
            resumed = []

            def resume() -> bool:
                try:
                    resumed.append(collect(s.ResumeStream(pb.ResumeStreamRequest(request_id=rid), timeout=10))[0])
                    return True
                except grpc.RpcError as exc:  # the channel may still be in its (<= 1 s) reconnect backoff
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE
                    return False

            assert wait_until(resume, 30, interval=0.2)
            ids = resumed[0]
            assert ids == expected_tokens(cycle_successor(script), tokenizer.encode("hello")[-1], 12)
            assert s.GetRequest(pb.GetRequestRequest(request_id=rid), timeout=5).status == "finished"
    finally:
        gw.stop(0)
        if verifier:
            verifier.stop(0)


def _start_redis(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def test_redis_down_fails_fast_then_recovers(fake, tok_dir, tokenizer, fake_server):
    port = free_port()
    store = RedisStore(f"redis://127.0.0.1:{port}/0", key_prefix=f"t-{uuid.uuid4().hex[:6]}:")
    gw = serve(gateway_config(fake_server[1].port, model_dir=tok_dir), trace.NoOpTracer(), new_registry(),
               store=store, tokenizer=tokenizer)
    proc = None
    try:
        with grpc.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
            s = pb_grpc.GatewayStub(ch)
            for call in (lambda: s.Generate(gen_request(max_tokens=3), timeout=10),
                         lambda: s.CreateSession(pb.CreateSessionRequest(), timeout=10)):
                err = status_of(call)
                assert err.code() == grpc.StatusCode.UNAVAILABLE  # at once, not at the call's deadline
            assert fake.calls == []
            if shutil.which("redis-server") is None:
                pytest.skip("no redis-server binary to test recovery")
            proc = _start_redis(port)
            resp = s.Generate(gen_request(max_tokens=3), timeout=10)  # same gateway, no restart
            assert s.GetRequest(pb.GetRequestRequest(request_id=resp.request_id), timeout=5).status == "finished"
    finally:
        gw.stop(0)
        if proc:
            proc.kill()
            proc.wait()


def _redis_reachable() -> bool:
    try:
        socket.create_connection(("127.0.0.1", 6379), timeout=0.3).close()
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _redis_reachable(), reason="no Redis on 127.0.0.1:6379")
def test_real_redis_round_trip(fake, tok_dir, tokenizer, fake_server):
    prefix = f"specinfer-test-{uuid.uuid4().hex[:8]}:"
    store = RedisStore("redis://127.0.0.1:6379/0", request_ttl_s=120, session_ttl_s=120, key_prefix=prefix)
    gw = serve(gateway_config(fake_server[1].port, model_dir=tok_dir), trace.NoOpTracer(), new_registry(),
               store=store, tokenizer=tokenizer)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
            s = pb_grpc.GatewayStub(ch)
            sid = s.CreateSession(pb.CreateSessionRequest(prefix="hi"), timeout=5).session_id
            resp = s.Generate(gen_request("hello", max_tokens=7, stop=["\u00e9"], session_id=sid), timeout=10)
            state = s.GetRequest(pb.GetRequestRequest(request_id=resp.request_id), timeout=5)
            assert state.status == "finished" and state.text == resp.text and state.session_id == sid
            assert list(state.token_ids) == list(resp.token_ids) and state.finish_reason == resp.finish_reason
            assert state.stats.output_tokens == len(resp.token_ids)
            assert 0 < store.r.ttl(f"{prefix}req:{resp.request_id}") <= 120
            assert 0 < store.r.ttl(f"{prefix}session:{sid}") <= 120
            assert len(store.get_session(sid).history_ids) > len(fake.calls[0].request.prompt_ids)
    finally:
        gw.stop(0)
        for key in store.r.scan_iter(f"{prefix}*"):
            store.r.delete(key)


def _measured_store(kind: str, sizes: list[int]):
    """A store whose writes append their payload size in bytes to `sizes` (for Redis: every
    argument of every command of each round trip, as sent)."""
    if kind == "memory":
        store = MemoryStore()
        write = store._write

        def measured_write(key, fields, *args, **kwargs):
            sizes.append(len(key.encode()) + sum(len(k.encode()) + len(v.encode()) for k, v in fields.items()))
            return write(key, fields, *args, **kwargs)

        store._write = measured_write
        return store
    if not _redis_reachable():
        pytest.skip("no Redis on 127.0.0.1:6379")
    store = RedisStore("redis://127.0.0.1:6379/0", request_ttl_s=120, session_ttl_s=120,
                       key_prefix=f"specinfer-test-{uuid.uuid4().hex[:8]}:")
    pipeline = store.r.pipeline

    def measured_pipeline(*args, **kwargs):
        p = pipeline(*args, **kwargs)
        execute = p.execute

        def measured_execute(*a, **kw):
            sizes.append(sum(len(str(arg).encode()) for command, _ in p.command_stack for arg in command))
            return execute(*a, **kw)

        p.execute = measured_execute
        return p

    store.r.pipeline = measured_pipeline
    return store


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_store_writes_per_step_do_not_grow(kind, fake, fake_server, tok_dir, tokenizer, script):
    """Each verified step writes only that step (one round trip), not the whole output so far;
    readers still see the whole output, while it runs and once it has ended."""
    sizes: list[int] = []
    store = _measured_store(kind, sizes)
    gw = serve(gateway_config(fake_server[1].port, model_dir=tok_dir), trace.NoOpTracer(), new_registry(),
               store=store, tokenizer=tokenizer)
    want = expected_tokens(cycle_successor(script), tokenizer.encode("hello")[-1], 200)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
            s = pb_grpc.GatewayStub(ch)
            fake.reset(delay_s=0.002)
            stream = s.GenerateStream(gen_request("hello", max_tokens=200), timeout=20)
            rid, got = next(stream).request_id, []
            for msg in stream:
                got += list(msg.token_ids)
                if len(got) >= 100:
                    break
            running = s.GetRequest(pb.GetRequestRequest(request_id=rid), timeout=5)
            assert list(running.token_ids) == want[:len(running.token_ids)] and len(running.token_ids) >= 100
            assert tokenizer.decode(want).startswith(running.text) and running.text
            list(stream)
            final = s.GetRequest(pb.GetRequestRequest(request_id=rid), timeout=5)
            assert final.status == "finished" and list(final.token_ids) == want
            assert final.text == tokenizer.decode(want)
    finally:
        gw.stop(0)
    steps = sizes[2:-1]  # less the request's creation and first write, and its final write
    assert len(steps) >= 90  # 100 steps of 2 tokens, one round trip each
    assert max(steps[-10:]) <= max(steps[:10]) + 8  # a longer output does not cost more per step
    if kind == "redis":
        key = f"{store.prefix}req:{rid}"
        assert not [f for f in store.r.hkeys(key) if f.startswith("step:")]  # folded into the final state
        for k in store.r.scan_iter(f"{store.prefix}*"):
            store.r.delete(k)


def test_memory_store_expires():
    store = MemoryStore(request_ttl_s=1, session_ttl_s=1)
    from services.gateway.store import SessionRecord

    store.put_session(SessionRecord("s", (1, 2), "x"))
    assert store.get_session("s").history_ids == (1, 2)
    store._data["specinfer:session:s"] = (store._data["specinfer:session:s"][0], time.monotonic() - 1)
    assert store.get_session("s") is None


# -- health, reflection, info, tracing, metrics ----------------------------------------------
def test_health_and_reflection(channel):
    health = health_pb2_grpc.HealthStub(channel)
    resp = health.Check(health_pb2.HealthCheckRequest(service="specinfer.v1.Gateway"), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    (answer,) = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                               timeout=5))
    assert "specinfer.v1.Gateway" in [s.name for s in answer.list_services_response.service]


def test_info(stub, fake):
    info = stub.Info(pb.InfoRequest(), timeout=5)
    assert info.model == "fake-llm" and list(info.default_shape.widths) == [1, 1, 3, 1]
    assert info.max_tokens == LIMITS.max_new_tokens and info.max_prompt_tokens == LIMITS.max_prompt_tokens
    assert info.max_concurrent_requests == LIMITS.max_concurrent_requests
    assert info.max_stop_sequences == LIMITS.max_stop_sequences


def test_trace_context_reaches_the_verifier(stub, fake, exporter):
    exporter.clear()
    client_tracer = TracerProvider().get_tracer("test-client")
    with client_tracer.start_as_current_span("client") as span:
        trace_id = format(span.get_span_context().trace_id, "032x")
        resp = stub.Generate(gen_request(max_tokens=4), timeout=10, metadata=outgoing_metadata())
    (gw_span,) = [s for s in exporter.get_finished_spans() if s.name == "gateway.generate"]
    assert format(gw_span.context.trace_id, "032x") == trace_id and gw_span.kind == trace.SpanKind.SERVER
    assert gw_span.attributes["request_id"] == resp.request_id and gw_span.attributes["output_tokens"] == 4
    assert gw_span.attributes["finish_reason"] == "length" and gw_span.attributes["prompt_tokens"] > 0
    assert trace_id in fake.calls[0].metadata["traceparent"]


def test_metrics(stub, fake, gateway):
    stub.Generate(gen_request(max_tokens=3), timeout=10)
    reg = gateway.registry
    assert reg.get_sample_value("specinfer_gateway_requests_total", {"method": "Generate", "code": "OK"}) >= 1
    assert reg.get_sample_value("specinfer_gateway_output_tokens_total") >= 3
    assert reg.get_sample_value("specinfer_gateway_active_requests") == 0
    assert reg.get_sample_value("specinfer_gateway_time_to_first_token_seconds_count") >= 1
    assert reg.get_sample_value("specinfer_gateway_request_latency_seconds_count", {"method": "Generate"}) >= 1


# -- config and the client library -----------------------------------------------------------
def test_config_flags_and_env(tmp_path):
    env = {"SPECINFER_GATEWAY_PORT": "6000", "SPECINFER_MODEL_DIR": str(tmp_path),
           "SPECINFER_VERIFIER_ADDR": "dns:///verifier:50052", "SPECINFER_MAX_TOKENS": "64"}
    cfg = config_from_args(["--port", "7000", "--max-concurrent-requests", "3"], env)
    assert cfg.port == 7000 and cfg.verifier_addr == "dns:///verifier:50052" and cfg.redis_url is None
    assert cfg.limits.max_new_tokens == 64 and cfg.limits.max_concurrent_requests == 3 and cfg.model_dir == tmp_path


def test_config_rejects_bad_values_by_name(tmp_path):
    env = {"SPECINFER_MODEL_DIR": str(tmp_path)}
    with pytest.raises(UserError, match=r"SPECINFER_MAX_TOKENS='abc' is not a valid int"):
        config_from_args([], {**env, "SPECINFER_MAX_TOKENS": "abc"})
    with pytest.raises(UserError, match=r"--max-tokens .* must be > 0"):
        config_from_args(["--max-tokens", "0"], env)
    with pytest.raises(UserError, match="max_tree_depth must be <= 16"):
        config_from_args(["--max-tree-depth", "17"], env)
    with pytest.raises(UserError, match="--model-dir or SPECINFER_MODEL_DIR"):
        config_from_args([], {})


def test_client_library(gateway, fake):
    with GatewayClient(f"127.0.0.1:{gateway.port}", timeout_s=10) as client:
        done = client.generate("hello", max_tokens=5, stop=["zzz"])
        assert len(done.token_ids) == 5 and done.finish_reason == "length" and done.stats.output_tokens == 5
        deltas = list(client.generate_stream("hello", max_tokens=5, tree_width=(1, 2)))
        assert "".join(d.text_delta for d in deltas) == done.text and deltas[-1].finish_reason == "length"
        assert list(fake.calls[1].request.shape.widths) == [1, 2]
        assert client.get_request(done.request_id).status == "finished"
        assert [t for d in client.resume(done.request_id, 2) for t in d.token_ids] == list(done.token_ids[2:])
        assert client.info()["model"] == "fake-llm"
        sid = client.create_session("hi")
        assert client.delete_session(sid)
        assert not client.cancel(done.request_id)
        with pytest.raises(GatewayError) as info:
            client.generate("hello", temperature=-1)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in info.value.details
        fake.reset()
        client.generate("hello", max_tokens=2, frequency_penalty=0.5, presence_penalty=-0.5, repetition_penalty=1.5,
                        min_p=0.25, logit_bias={9: -100.0}, json_schema={"type": "object"})
        client.generate("hello", max_tokens=2, regex="[a-z]+")
        client.generate("hello", max_tokens=2, json_object=True)
        first, second, third = (c.request for c in fake.calls)
        assert (first.sampling.frequency_penalty, first.sampling.presence_penalty, first.sampling.repetition_penalty,
                first.sampling.min_p, dict(first.sampling.logit_bias)) == (0.5, -0.5, 1.5, 0.25, {9: -100.0})
        assert json.loads(first.constraint.json_schema) == {"type": "object"}
        assert second.constraint.regex == "[a-z]+" and second.sampling.repetition_penalty == 0  # unset: none
        assert third.constraint.WhichOneof("kind") == "json_object"
        with pytest.raises(ValueError, match="one of"):
            client.generate("hello", regex="a", choice=["a"])
        with pytest.raises(GatewayError) as info:
            client.generate("hello", presence_penalty=3)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "presence_penalty" in info.value.details


def test_client_cli(gateway, fake, capsys):
    parser = argparse.ArgumentParser()
    add_client_parser(parser.add_subparsers(dest="command"))
    target = f"127.0.0.1:{gateway.port}"
    code = run_client(parser.parse_args(["client", "generate", "--target", target, "--prompt", "hello",
                                         "--max-tokens", "4", "--no-speculate", "--tree-width", "1,1,3"]))
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and len(out["token_ids"]) == 4 and not fake.calls[0].request.speculate
    code = run_client(parser.parse_args(["client", "generate", "--target", target, "--prompt", "hello",
                                         "--max-tokens", "3", "--stream", "--json"]))
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0 and lines[-1]["finish_reason"] == "length"
    code = run_client(parser.parse_args(["client", "info", "--target", target]))
    assert code == 0 and json.loads(capsys.readouterr().out)["model"] == "fake-llm"
    code = run_client(parser.parse_args(["client", "generate", "--target", target, "--prompt", "x",
                                         "--top-p", "2"]))
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("specinfer: error: INVALID_ARGUMENT: ") and "top_p" in err
    assert len(err.splitlines()) == 1


def test_client_generate_stream_prints_text_for_people_and_json_for_scripts(gateway, fake, capsys):
    parser = argparse.ArgumentParser()
    add_client_parser(parser.add_subparsers(dest="command"))
    base = ["client", "generate", "--target", f"127.0.0.1:{gateway.port}", "--prompt", "hello", "--max-tokens", "6",
            "--stream"]
    assert run_client(parser.parse_args(base + ["--json"])) == 0
    pieces = [json.loads(line) for line in capsys.readouterr().out.splitlines()]  # one JSON object per piece
    text = "".join(p["text_delta"] for p in pieces)
    assert len(pieces) > 2 and pieces[-1]["stats"]["output_tokens"] == 6 and text

    assert run_client(parser.parse_args(base)) == 0
    out = capsys.readouterr().out
    assert out.startswith(text + "\n"), out  # the same text, plain
    (stats,) = out[len(text) + 1:].splitlines()  # then one short line of statistics
    assert re.fullmatch(r"\[6 tokens in \d+ LLM steps: [0-9.]+ tokens/step, [0-9.]+ ms/token, length\]", stats), stats


def test_up_prompt_prints_text_then_statistics_or_json(gateway, fake, capsys):
    from specinfer.cli.launcher import _answer

    target = f"127.0.0.1:{gateway.port}"
    _answer(target, "hello", 5, is_json=True)
    reply = json.loads(capsys.readouterr().out)
    assert len(reply["token_ids"]) == 5
    _answer(target, "hello", 5, is_json=False)
    text, stats = capsys.readouterr().out.splitlines()
    assert text == reply["text"] and stats.startswith("[5 tokens in ") and stats.endswith(", length]")


def test_client_cli_structured_output_and_penalties(gateway, fake, capsys, tmp_path):
    parser = argparse.ArgumentParser()
    add_client_parser(parser.add_subparsers(dest="command"))
    base = ["client", "generate", "--target", f"127.0.0.1:{gateway.port}", "--prompt", "hello", "--max-tokens", "2"]
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "array", "items": {"type": "string"}}')
    grammar = tmp_path / "g.ebnf"
    grammar.write_text('root ::= "a" | "b"')
    runs = [(["--presence-penalty", "0.5", "--frequency-penalty", "0.25", "--repetition-penalty", "1.1",
              "--min-p", "0.5", "--choice", "yes", "--choice", "no"], "choice"),
            (["--json-schema", str(schema)], "json_schema"), (["--regex", "[0-9]+"], "regex"),
            (["--grammar", str(grammar)], "grammar")]
    for extra, kind in runs:
        assert run_client(parser.parse_args(base + extra)) == 0, capsys.readouterr().err
    capsys.readouterr()
    reqs = [c.request for c in fake.calls]
    assert [r.constraint.WhichOneof("kind") for r in reqs] == [kind for _, kind in runs]
    assert list(reqs[0].constraint.choice.choices) == ["yes", "no"] and reqs[0].sampling.presence_penalty == 0.5
    assert reqs[0].sampling.min_p == 0.5 and reqs[0].sampling.repetition_penalty == pytest.approx(1.1)
    assert reqs[1].constraint.json_schema == schema.read_text() and reqs[2].constraint.regex == "[0-9]+"
    assert reqs[3].constraint.grammar == grammar.read_text() and reqs[1].sampling.repetition_penalty == 0
    for extra, fragment in ((["--presence-penalty", "3"], "INVALID_ARGUMENT: sampling.presence_penalty"),
                            (["--json-schema", str(tmp_path / "nope.json")], "--json-schema"),
                            (["--json-schema", str(grammar)], "--json-schema"),
                            (["--grammar", str(tmp_path)], "--grammar")):
        assert run_client(parser.parse_args(base + extra)) == 2
        err = capsys.readouterr().err
        assert fragment in err and len(err.strip().splitlines()) == 1, err
    assert len(fake.calls) == len(runs)  # refused before or at the gateway: nothing more reached the verifier


def test_concurrent_streams_are_independent(stub, fake, tokenizer, script):
    results = {}

    def one(prompt: str):
        results[prompt] = collect(stub.GenerateStream(gen_request(prompt, max_tokens=12), timeout=10))[0]

    threads = [threading.Thread(target=one, args=(p,)) for p in ("hello", "the dog", "caf\u00e9")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == len(threads)  # every stream ended (a thread that failed leaves no result)
    for prompt, ids in results.items():
        assert ids == expected_tokens(cycle_successor(script), tokenizer.encode(prompt)[-1], 12)


# -- n > 1 -----------------------------------------------------------------------------------
def test_n_samples_are_one_call_and_each_is_its_own_record(stub, fake, tokenizer, script):
    want = expected_tokens(cycle_successor(script), tokenizer.encode("hello")[-1], 12)
    resp = stub.Generate(gen_request(max_tokens=12, n=3, request_id="three"), timeout=10)
    assert len(fake.calls) == 1 and fake.calls[0].request.num_samples == 3 and not fake.calls[0].request.prefix_group
    assert resp.request_id == "three" and [s.request_id for s in resp.samples] == ["three.0", "three.1", "three.2"]
    assert all(list(s.token_ids) == want and s.finish_reason == "length" for s in resp.samples)
    assert all(s.stats.output_tokens == 12 for s in resp.samples)
    state = stub.GetRequest(pb.GetRequestRequest(request_id="three.1"), timeout=5)
    assert state.status == "finished" and list(state.token_ids) == want
    assert status_of(lambda: stub.GetRequest(pb.GetRequestRequest(request_id="three"), timeout=5)).code() == \
        grpc.StatusCode.NOT_FOUND
    again = stub.Generate(gen_request(max_tokens=12, n=3, request_id="three"), timeout=10)  # a retry
    assert len(fake.calls) == 1 and [s.token_ids for s in again.samples] == [s.token_ids for s in resp.samples]
    assert status_of(lambda: stub.Generate(gen_request("other", max_tokens=12, n=3, request_id="three"),
                                           timeout=10)).code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_live_samples_own_id_resumes_and_cancels_that_sample_alone(stub, fake, tokenizer, script):
    fake.reset(delay_s=0.02, tokens_per_step=1)
    want = expected_tokens(cycle_successor(script), tokenizer.encode("hello")[-1], 120)
    stream = stub.GenerateStream(gen_request(max_tokens=120, n=3, request_id="live-three"), timeout=30)
    first = [next(stream) for _ in range(3)]
    assert [(m.request_id, m.index) for m in first] == [(f"live-three.{i}", i) for i in range(3)]
    assert wait_until(lambda: fake.calls and fake.calls[0].num_sent >= 9, 5)
    assert stub.CancelRequest(pb.CancelRequestRequest(request_id="live-three.1"), timeout=5).cancelled
    resumed = list(stub.ResumeStream(pb.ResumeStreamRequest(request_id="live-three.2"), timeout=30))
    assert [t for m in resumed for t in m.token_ids] == want  # the sample alone, as a request of its own
    assert all(m.index == 0 and m.request_id == "live-three.2" for m in resumed)
    rest = list(stream)
    by_index = {i: [t for m in first + rest if m.index == i for t in m.token_ids] for i in range(3)}
    ends = {m.index: m.finish_reason for m in rest if m.finish_reason}
    assert ends == {0: "length", 1: "cancelled", 2: "length"}
    assert by_index[0] == by_index[2] == want and len(by_index[1]) < 120 and by_index[1] == want[:len(by_index[1])]
    assert len(fake.calls) == 1


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_limits_is_invalid_argument_before_any_verifier_call(stub, fake, n):
    err = status_of(lambda: stub.Generate(gen_request(max_tokens=4, n=n), timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "n: must be in [1, 16]" in err.details()
    assert fake.calls == []
