"""Verifier + speculator services over real gRPC on localhost: exactness, failures, cancellation."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specinfer.engine.llm_engine import Engine, mode_params
from specinfer.engine.runtime.runner import ModelRunner
from specinfer.params import TreeShape
from specinfer.v1 import specinfer_pb2 as pb
from util import LocalStack, start_stack, wait_for_every_tree, wait_until

WIDTHS = (1, 1, 3, 1, 1, 1)


@pytest.fixture(scope="module")
def engine(tiny_pair):
    return Engine.from_runners(ModelRunner.from_dir(tiny_pair.llm), [ModelRunner.from_dir(tiny_pair.ssms[0])])


def start_services(tiny_pair, num_speculators=1, **verifier_kwargs) -> LocalStack:
    verifier_kwargs.setdefault("is_load_aware", False)  # fixed trees: step counts comparable in-process
    return start_stack(tiny_pair.llm, [tiny_pair.ssms[0]] * num_speculators, tree_width=WIDTHS, **verifier_kwargs)


@pytest.fixture
def stack(tiny_pair):
    with start_services(tiny_pair) as running:
        yield running


def generate(stub, prompt, max_new, timeout=30, **kwargs):
    tokens, last = [], None
    for r in stub.Generate(pb.VerifierGenerateRequest(prompt_ids=prompt, max_new_tokens=max_new, speculate=True,
                                                      **kwargs), timeout=timeout):
        tokens += list(r.token_ids)
        last = r
    return tokens, last


def test_greedy_through_services_equals_in_process(stack, engine, greedy_prompts, monkeypatch):
    wait_for_every_tree(monkeypatch)  # the step counts too
    for prompt in greedy_prompts[:6]:
        tokens, last = generate(stack.verifier_stub, prompt, 48)
        expected = engine.generate(prompt, mode_params("tree", 48, TreeShape(WIDTHS)))
        assert tokens == expected.output_ids
        assert last.finish_reason == expected.finish_reason and last.stats.llm_steps == expected.num_llm_steps
        assert not last.stats.fell_back


def test_two_speculators_merge_and_stay_exact(tiny_pair, engine, greedy_prompts):
    with start_services(tiny_pair, num_speculators=2) as stack:
        tokens, _ = generate(stack.verifier_stub, greedy_prompts[0], 40)
        assert tokens == engine.generate(greedy_prompts[0], mode_params("tree", 40, TreeShape(WIDTHS))).output_ids


def test_sampled_generation_is_seed_reproducible(stack):
    stub = stack.verifier_stub
    kwargs = dict(sampling=pb.SamplingParams(temperature=0.9, top_p=0.95, seed=5), ignore_eos=True)
    a, _ = generate(stub, [3, 4, 5], 30, **kwargs)
    b, _ = generate(stub, [3, 4, 5], 30, **kwargs)
    assert a == b and len(a) == 30


def test_speculator_killed_mid_request_falls_back_exactly(stack, engine, greedy_prompts):
    prompt = greedy_prompts[1]
    tokens, last = [], None
    request = pb.VerifierGenerateRequest(prompt_ids=prompt, max_new_tokens=60, speculate=True)
    stream = stack.verifier_stub.Generate(request, timeout=30)
    for i, r in enumerate(stream):
        tokens += list(r.token_ids)
        last = r
        if i == 2:
            stack.speculators[0][0].stop(0)  # the speculator dies mid-request
    assert tokens == engine.generate(prompt, mode_params("incremental", 60)).output_ids
    assert last.stats.fell_back


def test_no_speculator_at_all_decodes_incrementally(tiny_pair, engine):
    """An unreachable speculator fails at once and is dropped: no step waits for it. With a step
    timeout of an hour, any wait would outlast the call's deadline (which only guards the hang)."""
    with start_stack(tiny_pair.llm, speculator_addrs=("127.0.0.1:1",), speculator_step_timeout_s=3600) as stack:
        tokens, last = generate(stack.verifier_stub, [7, 8, 9], 20, timeout=60)
        assert tokens == engine.generate([7, 8, 9], mode_params("incremental", 20)).output_ids
        assert last.stats.fell_back


def test_client_cancel_stops_the_request_and_frees_its_kv(stack, monkeypatch):
    servicer = stack.verifier_servicer
    runner = servicer.engine.verifier.runner
    llm_alloc = runner.allocator
    ssm_alloc = stack.speculators[0][1].worker.speculator.runners[0].allocator
    passes, run = [], runner.run
    monkeypatch.setattr(runner, "run", lambda works: passes.append(len(works)) or run(works))
    call = stack.verifier_stub.Generate(pb.VerifierGenerateRequest(
        prompt_ids=list(range(2, 60)), max_new_tokens=400, speculate=True, ignore_eos=True), timeout=60)
    next(call)
    assert llm_alloc.num_used > 0
    call.cancel()
    num_before = len(passes)
    assert wait_until(lambda: llm_alloc.num_used == 0 and ssm_alloc.num_used == 0, timeout=30)
    assert len(passes) - num_before < 10  # a step or two more, not the rest of its 400 tokens


def test_deadline_exceeded_and_propagated(stack):
    with pytest.raises(grpc.RpcError) as err:
        generate(stack.verifier_stub, list(range(2, 40)), 450, timeout=0.05, ignore_eos=True)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize("request_kwargs,field", [
    (dict(prompt_ids=[1, 2, 999], max_new_tokens=4), "vocabulary"),
    (dict(prompt_ids=[], max_new_tokens=4), "empty"),
    (dict(prompt_ids=[1, 2], max_new_tokens=0), "max_new_tokens"),
    (dict(prompt_ids=[1, 2], max_new_tokens=4, shape=pb.TreeShape(widths=[1, 0])), "widths"),
    (dict(prompt_ids=[1, 2], max_new_tokens=4, sampling=pb.SamplingParams(temperature=-1)), "temperature"),
])
def test_invalid_requests(stack, request_kwargs, field):
    with pytest.raises(grpc.RpcError) as err:
        list(stack.verifier_stub.Generate(pb.VerifierGenerateRequest(**request_kwargs), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()


def test_session_reuses_kv_prefix_and_output_unchanged(stack, engine):
    stub, servicer = stack.verifier_stub, stack.verifier_servicer
    allocator = servicer.engine.verifier.runner.allocator
    turn1 = [5, 9, 13, 17, 21] * 4
    out1, _ = generate(stub, turn1, 16, session_id="s1")
    turn2 = turn1 + out1 + [30, 31, 32]
    kept = servicer.engine.scheduler.sessions["s1"]  # the hashes of the turn's full committed blocks
    assert len(kept) == len(turn1 + out1) // allocator.block_size
    out2, last = generate(stub, turn2, 16, session_id="s1")
    assert last.cached_prompt_tokens == len(kept) * allocator.block_size
    assert out2 == engine.generate(turn2, mode_params("tree", 16, TreeShape(WIDTHS))).output_ids
    num_cached = allocator.num_cached
    released = stub.ReleaseSession(pb.ReleaseSessionRequest(session_id="s1"))
    assert released.released and allocator.num_cached < num_cached  # its blocks were evicted by name
    assert allocator.num_used == 0


def test_speculator_rejects_bad_streams(stack):
    stub = stack.speculator_stub(0)
    bad = pb.SpeculateRequest(start=pb.SpeculateStart(context_ids=[1, 5000], max_depth=2))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Speculate(iter([bad]), timeout=5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ok = pb.SpeculateRequest(start=pb.SpeculateStart(context_ids=[1, 5, 6], max_depth=2, ssm_names=["nope"]))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Speculate(iter([ok]), timeout=5))
    assert "is hosted here" in err.value.details()


def test_speculator_keeps_trees_inside_its_context(stack):
    """The speculator enforces its own context whoever calls it: an over-long context is refused,
    and near the end of the context the trees it builds shrink instead of overflowing it."""
    stub = stack.speculator_stub(0)
    max_context = stub.Info(pb.InfoRequest(), timeout=5).max_context
    too_long = pb.SpeculateRequest(start=pb.SpeculateStart(context_ids=[5] * max_context, max_depth=2))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Speculate(iter([too_long]), timeout=5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "start.context_ids" in err.value.details()
    near_end = pb.SpeculateStart(context_ids=[5] * (max_context - 3), max_depth=6,
                                 shape=pb.TreeShape(widths=[1] * 6, max_nodes=16))
    (reply,) = list(stub.Speculate(iter([pb.SpeculateRequest(start=near_end)]), timeout=10))
    depths, parents = [], list(reply.tree.parents)
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    assert max(depths) == 2  # room for a 2-deep tree and its bonus token, no more


def test_health_and_graceful_drain(tiny_pair, executor):
    with start_services(tiny_pair) as stack:
        verifier = stack.verifier
        health = health_pb2_grpc.HealthStub(stack.channel(verifier.port))
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING
        is_decoding = threading.Event()

        def run():
            tokens = []
            for r in stack.verifier_stub.Generate(pb.VerifierGenerateRequest(
                    prompt_ids=[4, 5, 6], max_new_tokens=200, speculate=True, ignore_eos=True), timeout=30):
                tokens += r.token_ids
                is_decoding.set()
            return tokens

        in_flight = executor.submit(run)
        assert is_decoding.wait(30), in_flight.exception(timeout=0)  # the request is mid-stream
        stopping = executor.submit(verifier.stop, grace_s=20)
        assert wait_until(lambda: verifier.health._server_status.get("") == health_pb2.HealthCheckResponse.NOT_SERVING)
        assert len(in_flight.result(timeout=30)) == 200  # the in-flight request drained to completion
        stopping.result(timeout=30)


def test_request_picks_its_ssm_pool_by_name(tiny_pair, engine, greedy_prompts):
    with start_stack(tiny_pair.llm, tiny_pair.ssms[:2], tree_width=WIDTHS, is_load_aware=False) as stack:
        stub, servicer = stack.verifier_stub, stack.verifier_servicer
        prompt = greedy_prompts[2]
        tokens, _ = generate(stub, prompt, 30, ssm_names=[tiny_pair.ssms[1].name])
        assert tokens == engine.generate(prompt, mode_params("incremental", 30)).output_ids
        assert stack.speculators[1][1].worker.speculator.runners[0].allocator.num_used == 0
        info = stub.Info(pb.InfoRequest(), timeout=5)
        assert sorted(info.ssm_names) == sorted(p.name for p in tiny_pair.ssms[:2])
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, prompt, 4, ssm_names=["no-such-ssm"])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no-such-ssm" in err.value.details()
        assert servicer.engine.verifier.runner.allocator.num_used == 0  # the rejected request left nothing behind


def test_the_verifier_reports_what_it_serves(stack, executor):
    """Load (and Info's `load`): its batch capacity, requests running, free KV, and its measured
    time per output token by load, which the gateways admit by."""
    stub, servicer = stack.verifier_stub, stack.verifier_servicer
    idle = stub.Load(pb.InfoRequest(), timeout=5)
    assert idle.max_batch == servicer.engine.scheduler.cfg.max_batch and idle.num_running == 0
    allocator = servicer.engine.verifier.runner.allocator
    assert idle.kv_free_tokens == allocator.num_free * allocator.block_size > 0
    assert not idle.draining
    generate(stub, [4, 5, 6], 60, ignore_eos=True)
    list(executor.map(lambda p: generate(stub, p, 60, ignore_eos=True), [[4, 5], [6, 7], [8, 9]]))
    load = stub.Load(pb.InfoRequest(), timeout=5)
    loads = [p.num_running for p in load.token_times]
    assert loads == sorted(set(loads)) and loads[0] >= 1 and all(p.token_s > 0 and p.num_samples for p in
                                                                  load.token_times)
    assert sum(p.num_samples for p in load.token_times) >= 20  # one per step after the first, per request
    assert stub.Info(pb.InfoRequest(), timeout=5).load.max_batch == load.max_batch
    servicer.stop_taking()  # the drain's first move: reported, and new calls go elsewhere
    assert stub.Load(pb.InfoRequest(), timeout=5).draining
    with pytest.raises(grpc.RpcError) as refused:
        generate(stub, [4, 5, 6], 4)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
