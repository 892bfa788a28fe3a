"""A gateway over several verifiers: a verifier that dies mid-stream costs no request and changes
no output; one that restarts is used again, and no request fails on its way back.

Against fake verifiers (deterministic tokens, `fake_verifier.py`) for the mechanics, and against
two real verifiers for the outputs: greedy and sampled with a seed, a request that moved to
another verifier mid-stream outputs exactly what it does uninterrupted.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from opentelemetry import trace

from fake_verifier import FakeVerifier, cycle_successor, expected_tokens, start_fake_verifier
from services.gateway.admission import AdmissionConfig
from services.gateway.config import GatewayConfig
from services.gateway.routing import Candidate
from services.gateway.server import serve
from services.gateway.verifier_pool import PoolConfig
from specinfer.limits import RequestLimits
from specinfer.serving.metrics import new_registry
from specinfer.tokenizer import TextTokenizer
from specinfer.v1 import specinfer_pb2 as pb
from specinfer.v1 import specinfer_pb2_grpc as pb_grpc
from util import add_tokenizer, wait_until

CORPUS = ["the quick brown fox jumps over the lazy dog. ", "hello world, hello gateway. "] * 30
LIMITS = RequestLimits(max_prompt_tokens=64, max_new_tokens=256, default_max_new_tokens=16,
                       max_concurrent_requests=16, max_stop_sequences=4, max_tree_depth=8)
POOL = PoolConfig(health_poll_s=0.05)
FIXED = AdmissionConfig(latency_factor=0)  # every request runs at once: these tests are about failover


def _metric(registry, name: str, labels: dict | None = None) -> float:
    return registry.get_sample_value(name, labels or {}) or 0.0


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("failover_tok")
    add_tokenizer(d, 300, CORPUS)
    return d


@pytest.fixture(scope="module")
def tokenizer(tok_dir) -> TextTokenizer:
    return TextTokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def script(tokenizer) -> list[int]:
    return list(dict.fromkeys(tokenizer.encode(" quick brown fox jumps over lazy dog.")))


class _Fleet:
    """Fake verifiers on fixed ports (stop one, start it again on its port) and a gateway over them."""

    def __init__(self, script, tok_dir, tokenizer, num: int, delay_s: float):
        self.successor = cycle_successor(script)
        self.fakes = [FakeVerifier(self.successor, tokens_per_step=1, delay_s=delay_s) for _ in range(num)]
        self.servers = [start_fake_verifier(f) for f in self.fakes]
        self.ports = [s.port for s in self.servers]
        self.registry = new_registry()
        cfg = GatewayConfig(port=0, verifier_addr=",".join(f"127.0.0.1:{p}" for p in self.ports), limits=LIMITS,
                            grace_s=0, model_dir=tok_dir, pool=POOL, admission=FIXED)
        self.gateway = serve(cfg, trace.NoOpTracer(), self.registry, tokenizer=tokenizer)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.gateway.port}")
        self.stub = pb_grpc.GatewayStub(self.channel)
        assert wait_until(lambda: self.gateway.core.verifier.num_serving() == num, 5)

    def kill(self, i: int) -> None:
        self.servers[i].stop(0)
        self.servers[i] = None

    def restart(self, i: int) -> None:
        self.servers[i] = start_fake_verifier(self.fakes[i], self.ports[i])

    def close(self) -> None:
        self.channel.close()
        self.gateway.stop(0)
        for s in self.servers:
            if s is not None:
                s.stop(0)


@pytest.fixture
def fleet(script, tok_dir, tokenizer):
    f = _Fleet(script, tok_dir, tokenizer, 2, delay_s=0.01)
    yield f
    f.close()


def _stream_ids(stub, prompt: str, max_tokens: int, timeout_s: float = 30) -> list[int]:
    ids = []
    for msg in stub.GenerateStream(pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens), timeout=timeout_s):
        assert msg.token_offset == len(ids)  # no token twice, none missing
        ids.extend(msg.token_ids)
    return ids


PROMPTS = ["hello world", "the quick brown", "hello gateway", "the lazy dog", "jumps over", "brown fox"]


def test_a_verifier_that_dies_mid_stream_costs_no_request_and_changes_no_output(fleet, tokenizer):
    max_tokens = 80
    expected = {p: expected_tokens(fleet.successor, tokenizer.encode(p)[-1], max_tokens) for p in PROMPTS}
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = {p: pool.submit(_stream_ids, fleet.stub, p, max_tokens) for p in PROMPTS}
        # every request is streaming, some of them on verifier 0: kill it
        assert wait_until(lambda: sum(c.num_sent > 5 for f in fleet.fakes for c in f.calls) == len(PROMPTS), 10)
        on_0 = [c for c in fleet.fakes[0].calls if not c.is_finished]
        assert on_0, "no request was on verifier 0"
        fleet.kill(0)
        outputs = {p: f.result(timeout=30) for p, f in futures.items()}
    assert outputs == expected
    # the requests that were on verifier 0 went on on verifier 1 from where they were
    resumed = [c for c in fleet.fakes[1].calls if c.request.num_resumed_tokens > 0]
    assert len(resumed) == len(on_0)
    assert _metric(fleet.registry, "specinfer_gateway_verifier_failovers_total") == len(on_0)
    assert _metric(fleet.registry, "specinfer_gateway_requests_total",
                   {"method": "GenerateStream", "code": "OK"}) == len(PROMPTS)
    router = fleet.gateway.core.verifier.router  # every call, failed or not, gave its load back
    assert wait_until(lambda: all(router.load(f"127.0.0.1:{p}") == 0 for p in fleet.ports), 5)


def test_a_verifier_that_ends_its_calls_as_it_stops_costs_no_request(fleet, tokenizer):
    """A verifier that stops ends the streams it still serves with CANCELLED (its server's stop
    after the drain's grace): the gateway did not cancel them, so they go on on another verifier,
    as after any other loss of a verifier, instead of failing."""
    max_tokens = 60
    expected = {p: expected_tokens(fleet.successor, tokenizer.encode(p)[-1], max_tokens) for p in PROMPTS}
    stopping = fleet.fakes[0]
    samples = stopping._samples

    def ended_by_the_server(call, request, context):
        for i, msg in enumerate(samples(call, request, context)):
            if i == 5:
                context.abort(grpc.StatusCode.CANCELLED, "the server is stopping")
            yield msg

    stopping._samples = ended_by_the_server
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        outputs = {p: f.result(timeout=30) for p, f in
                   {p: pool.submit(_stream_ids, fleet.stub, p, max_tokens) for p in PROMPTS}.items()}
    assert outputs == expected
    assert stopping.calls, "no request was on the stopping verifier"
    assert _metric(fleet.registry, "specinfer_gateway_verifier_failovers_total") >= 1


def test_a_restarted_verifier_is_used_again_and_no_request_fails_meanwhile(fleet):
    a0 = f"127.0.0.1:{fleet.ports[0]}"
    failures, done = [], threading.Event()

    def keep_asking():
        while not done.is_set():
            try:
                fleet.stub.Generate(pb.GenerateRequest(prompt=f"hello {uuid.uuid4().hex[:6]}", max_tokens=4),
                                    timeout=10)
            except grpc.RpcError as exc:
                failures.append(exc.code())

    threads = [threading.Thread(target=keep_asking) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.3)
        fleet.kill(0)
        time.sleep(1.0)
        calls_before = len(fleet.fakes[0].calls)
        fleet.restart(0)
        assert wait_until(lambda: len(fleet.fakes[0].calls) > calls_before + 3, 5), "verifier 0 is not used again"
    finally:
        done.set()
        for t in threads:
            t.join(15)
    assert failures == []
    assert _metric(fleet.registry, "specinfer_gateway_routed_requests_total", {"verifier": a0, "reason": "balance"}) > 0


def test_the_first_request_after_the_only_verifier_restarts_succeeds(script, tok_dir, tokenizer):
    """Before, the gateway's first call after a restart failed (UNAVAILABLE, connection refused)
    while its channel was still backing off; now the request waits for the verifier's health."""
    fleet = _Fleet(script, tok_dir, tokenizer, 1, delay_s=0.001)
    try:
        for _ in range(3):
            fleet.stub.Generate(pb.GenerateRequest(prompt="hello", max_tokens=2), timeout=10)
            fleet.kill(0)
            with pytest.raises(grpc.RpcError) as err:  # down: the request fails, resumable
                fleet.stub.Generate(pb.GenerateRequest(prompt="hello", max_tokens=2), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            time.sleep(1.5)  # long enough for the channel to be in its reconnect backoff
            fleet.restart(0)  # serving from here on
            resp = fleet.stub.Generate(pb.GenerateRequest(prompt="hello", max_tokens=2), timeout=10)
            assert len(resp.token_ids) == 2
    finally:
        fleet.close()


def test_sessions_stay_on_their_verifier_and_move_when_it_dies(fleet):
    session = fleet.stub.CreateSession(pb.CreateSessionRequest(prefix="hello world"), timeout=5).session_id
    fleet.stub.Generate(pb.GenerateRequest(prompt=" the", max_tokens=2, session_id=session), timeout=10)
    home = next(i for i, f in enumerate(fleet.fakes) if any(c.request.session_id == session for c in f.calls))
    router = fleet.gateway.core.verifier.router
    busy = [router.route([1], [Candidate(f"127.0.0.1:{fleet.ports[home]}", 16)]) for _ in range(20)]
    for _ in range(2):  # its verifier is far busier now: any other request would go to the other one
        fleet.stub.Generate(pb.GenerateRequest(prompt=" the", max_tokens=2, session_id=session), timeout=10)
    for route in busy:
        route.release()
    counts = [sum(c.request.session_id == session for c in f.calls) for f in fleet.fakes]
    assert counts[home] == 3 and counts[1 - home] == 0  # every turn on one verifier
    fleet.kill(home)
    assert wait_until(lambda: fleet.gateway.core.verifier.num_serving() == 1, 5)
    fleet.stub.Generate(pb.GenerateRequest(prompt=" the", max_tokens=2, session_id=session), timeout=10)
    assert sum(c.request.session_id == session for c in fleet.fakes[1 - home].calls) == 1


# -- real verifiers: the output does not change -------------------------------------------------------
SAMPLED = pb.SamplingParams(temperature=0.9, top_p=0.95, seed=1234)


def test_a_request_that_moves_to_another_real_verifier_mid_stream_outputs_what_it_would_have(text_pair):
    """Greedy, and sampled with a seed: the continuation on the other verifier recomputes the KV of
    the prompt and the tokens so far, and its tokens are those of the uninterrupted request."""
    from services.verifier.config import VerifierConfig
    from services.verifier.server import build as build_verifier

    llm, _ = text_pair
    verifiers = [build_verifier(VerifierConfig(llm, (), port=0, device="cpu", grace_s=0))[0] for _ in range(2)]
    registry = new_registry()
    limits = RequestLimits(max_prompt_tokens=64, max_new_tokens=400, default_max_new_tokens=16,
                           max_concurrent_requests=16, max_stop_sequences=4, max_tree_depth=8)
    cfg = GatewayConfig(port=0, verifier_addr=",".join(f"127.0.0.1:{v.port}" for v in verifiers), limits=limits,
                        grace_s=0, model_dir=llm, pool=POOL, admission=FIXED)
    gateway = serve(cfg, trace.NoOpTracer(), registry)
    channel = grpc.insecure_channel(f"127.0.0.1:{gateway.port}")
    stub = pb_grpc.GatewayStub(channel)
    prompts = ["def add(a, b):", "import os", "for x in range(3):", "import sys", "def f(", "print(x)"]
    requests = [pb.GenerateRequest(prompt=p, max_tokens=300, **({"sampling": SAMPLED} if i % 2 else {}))
                for i, p in enumerate(prompts)]
    streaming = threading.Semaphore(0)  # released by each request of the second round at its first tokens

    def run(request, is_watched: bool = False) -> list[int]:
        ids = []
        for msg in stub.GenerateStream(request, timeout=120):
            assert msg.token_offset == len(ids)
            if msg.token_ids and not ids and is_watched:
                streaming.release()
            ids.extend(msg.token_ids)
        return ids

    try:
        assert wait_until(lambda: gateway.core.verifier.num_serving() == 2, 10)
        with ThreadPoolExecutor(len(requests)) as pool:
            reference = list(pool.map(run, requests))
            assert all(len(ids) == 300 for ids in reference)
            futures = [pool.submit(run, r, True) for r in requests]
            for _ in requests:  # every request streams: kill verifier 0 under them
                assert streaming.acquire(timeout=60)
            verifiers[0].stop(0)
            outputs = [f.result(timeout=120) for f in futures]
        assert _metric(registry, "specinfer_gateway_verifier_failovers_total") >= 1
        assert outputs == reference
    finally:
        channel.close()
        gateway.stop(0)
        for v in verifiers:
            v.stop(0)


def _stream_samples(stub, request: pb.GenerateRequest, timeout_s: float = 30) -> dict[int, list[int]]:
    ids: dict[int, list[int]] = {}
    for msg in stub.GenerateStream(request, timeout=timeout_s):
        mine = ids.setdefault(msg.index, [])
        assert msg.token_offset == len(mine)  # no token twice, none missing, per sample
        mine.extend(msg.token_ids)
    return ids


def test_an_n_request_is_one_call_and_moves_as_one_with_each_sample_where_it_was(fleet, tokenizer):
    """n = 4: one verifier call for the four samples; when its verifier dies mid-stream, one call
    on the other verifier continues each sample from its own tokens, and every sample ends as
    it would have uninterrupted, equal to the single request with its seed (`sample_seed`)."""
    from specinfer.params import sample_seed

    def seeded(token: int, seed: int) -> int:  # a different successor per seed, still one per token
        for _ in range(1 + seed % 3):
            token = fleet.successor(token)
        return token

    for fake in fleet.fakes:
        fake.seeded_successor = seeded
    seed, max_tokens, prompt = 7, 60, "hello world"
    seeds = [sample_seed(seed, i) for i in range(4)]
    assert len({s % 3 for s in seeds}) > 1  # the samples differ
    last = tokenizer.encode(prompt)[-1]
    expected = {i: expected_tokens(lambda t, s=s: seeded(t, s), last, max_tokens) for i, s in enumerate(seeds)}
    request = pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, n=4, sampling=pb.SamplingParams(
        temperature=1.0, seed=seed))
    assert _stream_samples(fleet.stub, request) == expected
    calls = [c for f in fleet.fakes for c in f.calls]
    assert len(calls) == 1 and calls[0].request.num_samples == 4 and not calls[0].request.samples
    for f in fleet.fakes:
        f.reset(delay_s=0.01, tokens_per_step=1)
        f.seeded_successor = seeded
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(_stream_samples, fleet.stub, request)
        assert wait_until(lambda: any(c.num_sent > 40 for f in fleet.fakes for c in f.calls), 10)
        dying = next(i for i, f in enumerate(fleet.fakes) if f.calls)
        fleet.kill(dying)
        assert future.result(timeout=30) == expected
    first, = fleet.fakes[dying].calls
    resumed, = fleet.fakes[1 - dying].calls  # one call goes on with every sample
    assert resumed.request.num_samples == 4 and resumed.request.sampling.seed == seed
    assert sorted(s.index for s in resumed.request.samples) == [0, 1, 2, 3]
    assert all(list(s.token_ids) == expected[s.index][:len(s.token_ids)] for s in resumed.request.samples)
    assert sum(len(s.token_ids) for s in resumed.request.samples) > 0
    assert _metric(fleet.registry, "specinfer_gateway_verifier_failovers_total") == 1
    for i, s in enumerate(seeds):  # each sample is the single request with its seed
        single = pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, sampling=pb.SamplingParams(
            temperature=1.0, seed=s))
        assert _stream_samples(fleet.stub, single) == {0: expected[i]}
