"""Verifier + speculator services over real gRPC on localhost: exactness, failures, cancellation."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.speculator.config import SpeculatorConfig
from services.speculator.server import build as build_speculator
from services.verifier.config import VerifierConfig
from services.verifier.server import build as build_verifier
from specinfer.engine.llm_engine import Engine, SpecConfig
from specinfer.engine.runner import ModelRunner
from specinfer.v1 import specinfer_pb2 as pb
from specinfer.v1 import specinfer_pb2_grpc as pb_grpc

WIDTHS = (1, 1, 3, 1, 1, 1)


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return Engine(ModelRunner.from_dir(tiny_pair.llm), [ModelRunner.from_dir(tiny_pair.ssms[0])])


def start_stack(tiny_pair, num_speculators=1, **verifier_kwargs):
    specs = [build_speculator(SpeculatorConfig((tiny_pair.ssms[0],), port=0, device="cpu", grace_s=0))
             for _ in range(num_speculators)]
    targets = tuple(f"127.0.0.1:{s.port}" for s, _ in specs)
    verifier_kwargs.setdefault("is_load_aware", False)  # fixed trees: step counts comparable in-process
    cfg = VerifierConfig(tiny_pair.llm, targets, port=0, device="cpu", tree_width=WIDTHS, grace_s=1,
                         **verifier_kwargs)
    verifier, servicer = build_verifier(cfg)
    stub = pb_grpc.VerifierStub(grpc.insecure_channel(f"127.0.0.1:{verifier.port}"))
    return specs, (verifier, servicer), stub


@pytest.fixture
def stack(tiny_pair):
    specs, verifier, stub = start_stack(tiny_pair)
    yield specs, verifier, stub
    verifier[0].stop(0)
    for s, _ in specs:
        s.stop(0)


def generate(stub, prompt, max_new, timeout=30, **kwargs):
    tokens, last = [], None
    for r in stub.Generate(pb.VerifierGenerateRequest(prompt_ids=prompt, max_new_tokens=max_new, speculate=True,
                                                      **kwargs), timeout=timeout):
        tokens += list(r.token_ids)
        last = r
    return tokens, last


def wait_until(predicate, timeout=2.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_greedy_through_services_equals_in_process(stack, engine, greedy_prompts):
    _, _, stub = stack
    for prompt in greedy_prompts[:6]:
        tokens, last = generate(stub, prompt, 48)
        expected = engine.generate(prompt, 48, spec=SpecConfig(widths=WIDTHS))
        assert tokens == expected.output_ids
        assert last.finish_reason == expected.finish_reason and last.stats.llm_steps == expected.num_llm_steps
        assert not last.stats.fell_back


def test_two_speculators_merge_and_stay_exact(tiny_pair, engine, greedy_prompts):
    specs, verifier, stub = start_stack(tiny_pair, num_speculators=2)
    try:
        tokens, _ = generate(stub, greedy_prompts[0], 40)
        assert tokens == engine.generate(greedy_prompts[0], 40, spec=SpecConfig(widths=WIDTHS)).output_ids
    finally:
        verifier[0].stop(0)
        for s, _ in specs:
            s.stop(0)


def test_sampled_generation_is_seed_reproducible(stack):
    _, _, stub = stack
    kwargs = dict(sampling=pb.SamplingParams(temperature=0.9, top_p=0.95, seed=5), ignore_eos=True)
    a, _ = generate(stub, [3, 4, 5], 30, **kwargs)
    b, _ = generate(stub, [3, 4, 5], 30, **kwargs)
    assert a == b and len(a) == 30


def test_speculator_killed_mid_request_falls_back_exactly(stack, engine, greedy_prompts):
    specs, (verifier, servicer), stub = stack
    prompt = greedy_prompts[1]
    tokens, last = [], None
    stream = stub.Generate(pb.VerifierGenerateRequest(prompt_ids=prompt, max_new_tokens=60, speculate=True), timeout=30)
    for i, r in enumerate(stream):
        tokens += list(r.token_ids)
        last = r
        if i == 2:
            specs[0][0].stop(0)  # the speculator dies mid-request
    assert tokens == engine.generate(prompt, 60, spec=SpecConfig(mode="incremental")).output_ids
    assert last.stats.fell_back


def test_no_speculator_at_all_decodes_incrementally(tiny_pair, engine):
    cfg = VerifierConfig(tiny_pair.llm, ("127.0.0.1:1",), port=0, device="cpu", speculator_step_timeout_s=1)
    verifier, _ = build_verifier(cfg)
    try:
        stub = pb_grpc.VerifierStub(grpc.insecure_channel(f"127.0.0.1:{verifier.port}"))
        start = time.monotonic()
        tokens, last = generate(stub, [7, 8, 9], 20)
        assert time.monotonic() - start < 10
        assert tokens == engine.generate([7, 8, 9], 20, spec=SpecConfig(mode="incremental")).output_ids
        assert last.stats.fell_back
    finally:
        verifier.stop(0)


def test_client_cancel_frees_kv_within_1s(stack):
    specs, (verifier, servicer), stub = stack
    llm_alloc = servicer.worker.runner.allocator
    ssm_alloc = specs[0][1].worker.speculator.runners[0].allocator
    call = stub.Generate(pb.VerifierGenerateRequest(prompt_ids=list(range(2, 60)), max_new_tokens=400, speculate=True,
                                                    ignore_eos=True), timeout=60)
    next(call)
    assert llm_alloc.num_used > 0
    call.cancel()
    assert wait_until(lambda: llm_alloc.num_used == 0 and ssm_alloc.num_used == 0, timeout=1.0)


def test_deadline_exceeded_and_propagated(stack):
    _, _, stub = stack
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, list(range(2, 40)), 450, timeout=0.05, ignore_eos=True)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize("request_kwargs,field", [
    (dict(prompt_ids=[1, 2, 999], max_new_tokens=4), "vocabulary"),
    (dict(prompt_ids=[], max_new_tokens=4), "empty"),
    (dict(prompt_ids=[1, 2], max_new_tokens=0), "max new tokens"),
    (dict(prompt_ids=[1, 2], max_new_tokens=4, shape=pb.TreeShape(widths=[1, 0])), "widths"),
    (dict(prompt_ids=[1, 2], max_new_tokens=4, sampling=pb.SamplingParams(temperature=-1)), "temperature"),
])
def test_invalid_requests(stack, request_kwargs, field):
    _, _, stub = stack
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.VerifierGenerateRequest(**request_kwargs), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()


def test_session_reuses_kv_prefix_and_output_unchanged(stack, engine):
    _, (verifier, servicer), stub = stack
    turn1 = [5, 9, 13, 17, 21]
    out1, _ = generate(stub, turn1, 16, session_id="s1")
    turn2 = turn1 + out1 + [30, 31, 32]
    before = servicer.worker.sessions["s1"].token_ids
    assert before == (turn1 + out1)[: len(before)] and len(before) >= len(turn1)
    out2, _ = generate(stub, turn2, 16, session_id="s1")
    assert out2 == engine.generate(turn2, 16, spec=SpecConfig(widths=WIDTHS)).output_ids
    released = stub.ReleaseSession(pb.ReleaseSessionRequest(session_id="s1"))
    assert released.released
    assert servicer.worker.runner.allocator.num_used == 0


def test_speculator_rejects_bad_streams(stack):
    specs, _, _ = stack
    stub = pb_grpc.SpeculatorStub(grpc.insecure_channel(f"127.0.0.1:{specs[0][0].port}"))
    bad = pb.SpeculateRequest(start=pb.SpeculateStart(context_ids=[1, 5000], max_depth=2))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Speculate(iter([bad]), timeout=5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ok = pb.SpeculateRequest(start=pb.SpeculateStart(context_ids=[1, 5, 6], max_depth=2, ssm_names=["nope"]))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Speculate(iter([ok]), timeout=5))
    assert "is hosted here" in err.value.details()


def test_health_and_graceful_drain(tiny_pair):
    specs, (verifier, servicer), stub = start_stack(tiny_pair)
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{verifier.port}"))
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING
    results = {}

    def run():
        results["tokens"], results["last"] = generate(stub, [4, 5, 6], 200, ignore_eos=True)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.2)
    stopper = threading.Thread(target=lambda: verifier.stop(grace_s=20))
    stopper.start()
    assert wait_until(lambda: verifier.health._server_status.get("") == health_pb2.HealthCheckResponse.NOT_SERVING)
    t.join(30)
    stopper.join(30)
    assert len(results["tokens"]) == 200  # the in-flight request drained to completion
    for s, _ in specs:
        s.stop(0)


def test_request_picks_its_ssm_pool_by_name(tiny_pair, engine, greedy_prompts):
    spec_a = build_speculator(SpeculatorConfig((tiny_pair.ssms[0],), port=0, device="cpu", grace_s=0))
    spec_b = build_speculator(SpeculatorConfig((tiny_pair.ssms[1],), port=0, device="cpu", grace_s=0))
    targets = tuple(f"127.0.0.1:{s.port}" for s, _ in (spec_a, spec_b))
    verifier, servicer = build_verifier(VerifierConfig(tiny_pair.llm, targets, port=0, device="cpu",
                                                       tree_width=WIDTHS, is_load_aware=False, grace_s=0))
    try:
        stub = pb_grpc.VerifierStub(grpc.insecure_channel(f"127.0.0.1:{verifier.port}"))
        prompt = greedy_prompts[2]
        tokens, _ = generate(stub, prompt, 30, ssm_names=[tiny_pair.ssms[1].name])
        assert tokens == engine.generate(prompt, 30, spec=SpecConfig(mode="incremental")).output_ids
        assert spec_b[1].worker.speculator.runners[0].allocator.num_used == 0
        info = stub.Info(pb.InfoRequest(), timeout=5)
        assert sorted(info.ssm_names) == sorted(p.name for p in tiny_pair.ssms[:2])
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, prompt, 4, ssm_names=["no-such-ssm"])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no-such-ssm" in err.value.details()
        assert servicer.worker.runner.allocator.num_used == 0  # the rejected request left nothing behind
    finally:
        verifier.stop(0)
        spec_a[0].stop(0)
        spec_b[0].stop(0)
