"""The verifier's continuous-batching scheduler: chunked prefill, admission control, no KV leaks."""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest

from services.speculator.config import SpeculatorConfig
from services.speculator.server import build as build_speculator
from services.verifier.config import VerifierConfig
from services.verifier.server import build as build_verifier
from specinfer.engine.llm_engine import Engine, GenerationResult, SpecConfig, Verifier
from specinfer.errors import CapacityError
from specinfer.engine.runner import ModelRunner
from specinfer.params import SamplingParams
from specinfer.engine.scheduler import SchedulerConfig, VerifierWorker
from specinfer.engine.tree import TokenTree
from specinfer.v1 import specinfer_pb2 as pb
from specinfer.v1 import specinfer_pb2_grpc as pb_grpc


def decode_greedy(worker: VerifierWorker, prompt: list[int], max_new: int, record: list | None = None) -> list[int]:
    """Incremental decoding through the worker (one root-only tree per step)."""
    session = worker.open(prompt, None, len(prompt) + max_new + 1)
    out = GenerationResult(prompt, [], 0)
    try:
        while not out.is_finished(max_new):
            tree = TokenTree.with_root(session.state.pending[-1])
            accepted, bonus = worker.verify(session, tree, SamplingParams(), None).result(timeout=30)
            out.record_step(accepted, bonus, 1, max_new, frozenset())
            if record is not None:
                record.append(time.monotonic())
    finally:
        worker.close(session, None)
    return out.output_ids


@pytest.fixture
def worker_factory(tiny_pair):
    made = []

    def make(**kwargs):
        runner = ModelRunner.from_dir(tiny_pair.llm, max_kv_tokens=kwargs.pop("max_kv_tokens", 4096), block_size=8)
        w = VerifierWorker(Verifier(runner), SchedulerConfig(**kwargs))
        made.append(w)
        return w

    yield make
    for w in made:
        w.worker.stop()


def test_chunked_prefill_is_exact_and_does_not_stall_decoding(worker_factory, tiny_pair):
    engine = Engine(ModelRunner.from_dir(tiny_pair.llm))
    long_prompt = [random.Random(3).randrange(2, 128) for _ in range(300)]
    short_prompt = [5, 6, 7]
    worker = worker_factory(token_budget=16, min_prefill_chunk=8)
    short_steps: list[float] = []
    long_steps: list[float] = []
    results = {}
    t = threading.Thread(target=lambda: results.__setitem__("short", decode_greedy(worker, short_prompt, 200, short_steps)))
    t.start()
    while len(short_steps) < 3:
        time.sleep(0.001)
    long_start = time.monotonic()
    results["long"] = decode_greedy(worker, long_prompt, 10, long_steps)
    t.join(30)
    plain = SpecConfig(mode="incremental")
    assert results["long"] == engine.generate(long_prompt, 10, spec=plain, stop_token_ids=()).output_ids
    assert results["short"] == engine.generate(short_prompt, 200, spec=plain, stop_token_ids=()).output_ids
    # 300 prompt tokens at <= 16 per pass take many passes; the short request kept decoding meanwhile.
    during_prefill = [x for x in short_steps if long_start < x < long_steps[0]]
    assert len(during_prefill) >= 5, len(during_prefill)
    assert worker.runner.allocator.num_used == 0


def test_admission_waits_for_memory_then_runs(worker_factory):
    worker = worker_factory(max_kv_tokens=64, max_waiting=4, admission_timeout_s=10)  # 8 blocks of 8
    first = worker.open([1, 2, 3], None, 60)  # takes 8 blocks: everything
    outcome = {}
    t = threading.Thread(target=lambda: outcome.__setitem__("second", worker.open([4, 5], None, 40)))
    t.start()
    time.sleep(0.2)
    assert "second" not in outcome  # waiting for memory, not failed
    worker.close(first, None)
    t.join(5)
    assert outcome["second"].state.seq.capacity >= 40
    worker.close(outcome["second"], None)
    assert worker.runner.allocator.num_used == 0


def test_admission_rejects_when_queue_full_or_timeout(worker_factory):
    worker = worker_factory(max_kv_tokens=64, max_waiting=1, admission_timeout_s=0.3)
    hog = worker.open([1, 2, 3], None, 64)
    waiter = threading.Thread(target=lambda: pytest.raises(CapacityError, worker.open, [4], None, 16))
    waiter.start()
    time.sleep(0.05)
    with pytest.raises(CapacityError, match="queue is full"):
        worker.open([4], None, 16)
    waiter.join(5)  # the waiting one timed out with CapacityError
    with pytest.raises(CapacityError, match="cache holds"):
        worker.open([1], None, 10_000)  # can never fit
    worker.close(hog, None)
    assert worker.runner.allocator.num_used == 0


def test_thousand_cancel_loops_leak_no_kv(tiny_pair):
    """Start and cancel 1,000 requests at random points; every KV block comes back."""
    spec, spec_servicer = build_speculator(SpeculatorConfig((tiny_pair.ssms[0],), port=0, device="cpu", grace_s=0))
    verifier, servicer = build_verifier(VerifierConfig(tiny_pair.llm, (f"127.0.0.1:{spec.port}",), port=0,
                                                       device="cpu", tree_width=(1, 2, 1), grace_s=0))
    try:
        stub = pb_grpc.VerifierStub(grpc.insecure_channel(f"127.0.0.1:{verifier.port}"))
        rng = random.Random(0)
        for i in range(1000):
            call = stub.Generate(pb.VerifierGenerateRequest(
                prompt_ids=[rng.randrange(2, 128) for _ in range(rng.randrange(1, 20))], max_new_tokens=200,
                speculate=i % 3 != 0, ignore_eos=True), timeout=30)
            for _ in range(rng.randrange(0, 3)):
                next(call, None)
            call.cancel()
        llm = servicer.worker.runner.allocator
        ssm = spec_servicer.worker.speculator.runners[0].allocator
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (llm.num_used or ssm.num_used or servicer.worker.num_open):
            time.sleep(0.05)
        assert llm.num_used == 0 and ssm.num_used == 0 and servicer.worker.num_open == 0
        assert llm.num_free == llm.num_blocks
    finally:
        verifier.stop(0)
        spec.stop(0)


def test_kv_budget_parses_tokens_and_bytes():
    from specinfer.engine.load import kv_budget_tokens, parse_kv_budget
    from specinfer.engine.config import ModelConfig
    from specinfer.errors import UserError

    assert parse_kv_budget("65536") == (65536, 0)
    assert parse_kv_budget("4096 tokens") == (4096, 0)
    assert parse_kv_budget("2GiB") == (0, 2 * 2**30)
    assert parse_kv_budget("512MB") == (0, 512 * 10**6)
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=64, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64,
                      rms_norm_eps=1e-5)
    # one token: K and V, 2 layers, 2 KV heads of 16 floats = 2*2*2*16*4 bytes = 512 bytes
    assert kv_budget_tokens(0, 1 << 20, cfg, "float32") == 2048
    for bad in ("lots", "-5", "0GiB"):
        with pytest.raises(UserError):
            parse_kv_budget(bad)


def test_requests_joining_and_leaving_mid_flight_keep_greedy_outputs(tiny_pair):
    """Mixed prompt lengths, staggered arrivals, different lengths: every output equals the
    request run alone."""
    spec, _ = build_speculator(SpeculatorConfig((tiny_pair.ssms[0],), port=0, device="cpu", grace_s=0))
    verifier, servicer = build_verifier(VerifierConfig(tiny_pair.llm, (f"127.0.0.1:{spec.port}",), port=0,
                                                       device="cpu", tree_width=(2, 1, 1), grace_s=0,
                                                       token_budget=48, is_load_aware=False))
    try:
        stub = pb_grpc.VerifierStub(grpc.insecure_channel(f"127.0.0.1:{verifier.port}"))
        rng = random.Random(11)
        jobs = [([rng.randrange(2, 128) for _ in range(rng.choice([1, 5, 40, 120]))], rng.randrange(5, 50),
                 i % 2 == 0) for i in range(10)]

        def run(prompt, max_new, speculate):
            req = pb.VerifierGenerateRequest(prompt_ids=prompt, max_new_tokens=max_new, speculate=speculate,
                                             ignore_eos=True)
            return [t for r in stub.Generate(req, timeout=60) for t in r.token_ids]

        alone = [run(*job) for job in jobs]
        together: dict[int, list[int]] = {}
        batch_sizes = []

        def client(i):
            time.sleep(0.02 * i)  # staggered arrivals: requests join while others decode
            together[i] = run(*jobs[i])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            batch_sizes.append(servicer.worker.num_open)
            time.sleep(0.005)
        assert [together[i] for i in range(len(jobs))] == alone
        assert max(batch_sizes) >= 3  # they really overlapped
    finally:
        verifier.stop(0)
        spec.stop(0)
