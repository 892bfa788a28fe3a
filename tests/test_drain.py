"""Draining on SIGTERM: requests in flight finish, and what cannot finish within the grace is
handed over (a verifier's stream ends UNAVAILABLE; the gateway continues it on another verifier,
with the uninterrupted output). The plan is tested with a clock of its own."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2
from opentelemetry import trace

from fake_verifier import FakeVerifier, cycle_successor, start_fake_verifier
from services.gateway.admission import AdmissionConfig
from services.gateway.config import GatewayConfig
from services.gateway.server import serve
from services.gateway.verifier_pool import PoolConfig
from services.verifier.config import VerifierConfig
from services.verifier.server import build as build_verifier
from specinfer.limits import RequestLimits
from specinfer.serving.drain import drain, handover_margin, plan_drain
from specinfer.serving.metrics import new_registry
from specinfer.tokenizer import TextTokenizer
from specinfer.v1 import specinfer_pb2 as pb
from specinfer.v1 import specinfer_pb2_grpc as pb_grpc
from util import add_tokenizer, wait_until


def test_the_plan_gives_requests_their_time_and_hands_over_the_hopeless_at_once():
    # 10 ms a token, a 30 s grace: 28 s to hand over by (2 s margin)
    plan = plan_drain([("a", 100), ("b", 1000), ("c", 10_000)], 0.01, 30.0)
    assert plan.hand_over_by_s == 28.0
    assert plan.hand_over_now == ("c",)  # 100 s needed: more than twice the 28 s there are
    assert plan.finish_by_s == pytest.approx(1000 * 0.01 * 1.5 + 1.0)  # the slowest of the others, with margins
    assert plan_drain([("a", 100)], None, 30.0).hand_over_now == ()  # no measurement: everyone gets the time
    assert plan_drain([], 0.01, 30.0).finish_by_s == 0.0
    assert handover_margin(0.5) == pytest.approx(0.1)  # a short grace keeps a share of itself


class FakeWork:
    def __init__(self, left: dict[str, int], token_s: float | None):
        self.left, self._token_s = dict(left), token_s
        self.is_taking = True
        self.handed: list[str] = []
        self.lock = threading.Lock()

    def stop_taking(self):
        self.is_taking = False

    def in_flight(self):
        with self.lock:
            return list(self.left.items())

    def token_s(self):
        return self._token_s

    def hand_over(self, keys):
        with self.lock:
            self.handed += keys
            for k in keys:
                self.left.pop(k, None)


class FakeTime:
    """A clock that moves only when the drain sleeps; `on_sleep` plays the requests' progress."""

    def __init__(self, on_sleep=lambda now: None):
        self.now, self.on_sleep = 0.0, on_sleep
        self.done = threading.Event()

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 1e-3)
        self.on_sleep(self.now)


def test_requests_that_finish_are_not_handed_over_and_the_rest_go_at_the_end_of_the_grace():
    work = FakeWork({"quick": 10, "slow": 100, "hopeless": 100_000}, 0.01)

    def progress(now: float) -> None:  # "quick" finishes at 1 s; "slow" never does
        with work.lock:
            if now >= 1.0:
                work.left.pop("quick", None)

    t = FakeTime(progress)
    plan = drain(work, 10.0, t.clock, t.sleep)
    assert not work.is_taking and plan.hand_over_by_s == 8.0
    assert work.handed == ["hopeless", "slow"] and t.now == pytest.approx(8.0, abs=0.01)


def test_a_drain_ends_as_soon_as_the_requests_are_done():
    work = FakeWork({"a": 10}, 0.01)

    def progress(now: float) -> None:
        with work.lock:
            work.left.clear()

    t = FakeTime(progress)
    drain(work, 30.0, t.clock, t.sleep)
    assert work.handed == [] and t.now < 1.0  # on the fake clock: the drain did not wait for the grace


def test_a_draining_verifier_hands_its_streams_over_and_the_outputs_do_not_change(text_pair):
    """Two real verifiers behind a gateway. One is stopped with a grace too short for its streams:
    it turns NOT_SERVING at once, refuses new calls, and hands its streams over before the grace
    ends; the gateway continues each on the other verifier, and every output (greedy, and sampled
    with a seed) is the uninterrupted one."""
    llm, _ = text_pair
    built = [build_verifier(VerifierConfig(llm, (), port=0, device="cpu", grace_s=0)) for _ in range(2)]
    limits = RequestLimits(max_prompt_tokens=64, max_new_tokens=400, default_max_new_tokens=16,
                           max_concurrent_requests=16, max_stop_sequences=4, max_tree_depth=8)
    registry = new_registry()
    gateway = serve(GatewayConfig(port=0, verifier_addr=",".join(f"127.0.0.1:{s.port}" for s, _ in built),
                                  limits=limits, grace_s=0, model_dir=llm, pool=PoolConfig(health_poll_s=0.05),
                                  admission=AdmissionConfig(latency_factor=0)), trace.NoOpTracer(), registry)
    channel = grpc.insecure_channel(f"127.0.0.1:{gateway.port}")
    stub = pb_grpc.GatewayStub(channel)
    sampled = pb.SamplingParams(temperature=0.9, top_p=0.95, seed=77)
    requests = [pb.GenerateRequest(prompt=p, max_tokens=300, **({"sampling": sampled} if i % 2 else {}))
                for i, p in enumerate(["def add(a, b):", "import os", "for x in range(3):", "import sys"])]
    streaming = threading.Semaphore(0)

    def run(request, is_watched: bool = False) -> list[int]:
        ids = []
        for msg in stub.GenerateStream(request, timeout=120):
            if msg.token_ids and not ids and is_watched:
                streaming.release()
            ids.extend(msg.token_ids)
        return ids

    try:
        assert wait_until(lambda: gateway.core.verifier.num_serving() == 2, 10)
        with ThreadPoolExecutor(len(requests) + 1) as pool:
            reference = list(pool.map(run, requests))
            futures = [pool.submit(run, r, True) for r in requests]
            for _ in requests:
                assert streaming.acquire(timeout=60)
            (server, servicer) = max(built, key=lambda b: len(b[1].in_flight()))
            assert servicer.in_flight()
            stopping = pool.submit(server.stop, 0.5)  # a grace far too short for 300 tokens
            assert wait_until(lambda: gateway.core.verifier.num_serving() == 1, 10)
            outputs = [f.result(timeout=120) for f in futures]
            stopping.result(timeout=30)
        assert outputs == reference
        assert registry.get_sample_value("specinfer_gateway_verifier_failovers_total") >= 1
        assert servicer.in_flight() == []
    finally:
        channel.close()
        gateway.stop(0)
        for s, _ in built:
            s.stop(0)


def test_a_draining_gateway_lets_its_streams_finish_and_takes_no_new_request(tmp_path):
    """SIGTERM's path (`RunningServer.stop`): NOT_SERVING, a new request refused, the stream in
    flight finishes in full, and the server is done as soon as it is (not at the end of the grace)."""
    add_tokenizer(tmp_path, 300, ["hello world, hello gateway. "] * 30)
    tokenizer = TextTokenizer.from_dir(tmp_path)
    fake = FakeVerifier(cycle_successor(list(dict.fromkeys(tokenizer.encode(" hello world")))), delay_s=0.01)
    verifier = start_fake_verifier(fake)
    gateway = serve(GatewayConfig(port=0, verifier_addr=f"127.0.0.1:{verifier.port}", model_dir=tmp_path,
                                  grace_s=60), trace.NoOpTracer(), new_registry(), tokenizer=tokenizer)
    channel = grpc.insecure_channel(f"127.0.0.1:{gateway.port}")
    stub = pb_grpc.GatewayStub(channel)
    try:
        stream = stub.GenerateStream(pb.GenerateRequest(prompt="hello", max_tokens=150), timeout=60)
        ids = list(next(stream).token_ids)
        assert wait_until(lambda: gateway.core.admission.num_running == 1, 5)
        stopping = threading.Thread(target=gateway.stop)
        stopping.start()
        assert wait_until(lambda: gateway.running.health._server_status.get("")
                          == health_pb2.HealthCheckResponse.NOT_SERVING, 5)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Generate(pb.GenerateRequest(prompt="hello", max_tokens=2), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        for msg in stream:
            ids.extend(msg.token_ids)
        assert len(ids) == 150
        stopping.join(30)
        assert not stopping.is_alive()  # done with its stream, long before the 60 s grace
    finally:
        channel.close()
        gateway.stop(0)
        verifier.stop(0)
