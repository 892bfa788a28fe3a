"""The whole stack over real gRPC on localhost with a real Redis: gateway -> verifier -> speculator.

Checks greedy exactness against the in-process engine, streaming, trace propagation across all
three services in one trace, cancellation freeing every KV cache, a speculator dying mid-request,
and resuming a stream after the client went away.
"""

from __future__ import annotations

import socket
import uuid

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specinfer.engine.llm_engine import Engine, mode_params
from specinfer.engine.runtime.runner import ModelRunner
from specinfer.params import TreeShape
from specinfer.tokenizer import TextTokenizer
from specinfer.v1 import specinfer_pb2 as pb
from util import start_stack, wait_for_every_tree, wait_until

WIDTHS = (1, 2, 1, 1)


def redis_url() -> str:
    with socket.socket() as s:
        s.settimeout(0.5)
        if s.connect_ex(("127.0.0.1", 6379)) != 0:
            pytest.skip("no Redis on 127.0.0.1:6379 (.ci/run starts one)")
    return "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def stack(text_pair, exporter):
    llm, ssm = text_pair
    gateway = {"redis_url": redis_url(), "key_prefix": f"specinfer-test-{uuid.uuid4().hex[:8]}:"}
    with start_stack(llm, [ssm], exporter=exporter, tree_width=WIDTHS, speculator_step_timeout_s=2,
                     is_load_aware=False, gateway=gateway) as running:
        yield running


@pytest.fixture(scope="module")
def reference(text_pair):
    llm, ssm = text_pair
    return Engine.from_runners(ModelRunner.from_dir(llm), [ModelRunner.from_dir(ssm)]), TextTokenizer.from_dir(llm)


@pytest.mark.parametrize("prompt", ["def add(a, b", "import os\n", "for x in range(3):\n    "])
def test_greedy_through_stack_equals_in_process(stack, reference, prompt, monkeypatch):
    wait_for_every_tree(monkeypatch)  # the step counts too
    engine, tokenizer = reference
    resp = stack.gateway_stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=40), timeout=60)
    expected = engine.generate(tokenizer.encode(prompt), mode_params("tree", 40, TreeShape(WIDTHS)))
    assert list(resp.token_ids) == expected.output_ids
    assert resp.text == tokenizer.decode(expected.output_ids)
    assert resp.stats.llm_steps == expected.num_llm_steps and resp.stats.tokens_per_step > 1.0


def test_speculation_off_gives_same_greedy_text(stack):
    stub = stack.gateway_stub
    on = stub.Generate(pb.GenerateRequest(prompt="import sys", max_tokens=30), timeout=60)
    off = stub.Generate(pb.GenerateRequest(prompt="import sys", max_tokens=30, speculate=False), timeout=60)
    assert on.text == off.text and off.stats.tokens_per_step == pytest.approx(1.0)


def test_streaming_deltas_add_up(stack):
    chunks = list(stack.gateway_stub.GenerateStream(pb.GenerateRequest(prompt="def add(", max_tokens=32), timeout=60))
    offsets = [c.token_offset for c in chunks if c.token_ids]
    tokens = [t for c in chunks for t in c.token_ids]
    assert offsets == sorted(offsets) and len(tokens) == 32 and len(chunks) > 2
    whole = stack.gateway_stub.Generate(pb.GenerateRequest(prompt="def add(", max_tokens=32), timeout=60)
    assert "".join(c.text_delta for c in chunks) == whole.text
    assert chunks[-1].finish_reason == "length"


def test_one_trace_spans_gateway_verifier_speculator(stack, exporter):
    rid = f"trace-{uuid.uuid4().hex[:8]}"
    stack.gateway_stub.Generate(pb.GenerateRequest(prompt="import os", max_tokens=12, request_id=rid), timeout=60)
    wanted = {"gateway.generate", "verifier.generate", "verifier.speculate", "verifier.verify_tree",
              "speculator.speculate", "speculator.build_tree"}

    def request_spans():
        spans = exporter.get_finished_spans()
        roots = [s for s in spans if s.name == "gateway.generate" and s.attributes.get("request_id") == rid]
        return [s for s in spans if roots and s.context.trace_id == roots[0].context.trace_id]

    assert wait_until(lambda: wanted <= {s.name for s in request_spans()}, 3.0), request_spans()
    # Every service's span for this request id sits in the one trace the gateway started.
    tagged = [s for s in exporter.get_finished_spans() if s.attributes.get("request_id") == rid]
    assert {s.name for s in tagged} >= {"gateway.generate", "verifier.generate", "speculator.speculate"}
    assert len({s.context.trace_id for s in tagged}) == 1
    verify = [s for s in request_spans() if s.name == "verifier.verify_tree"]
    assert all("accepted_length" in s.attributes and "tree_nodes" in s.attributes for s in verify)


def test_cancel_request_stops_it_and_frees_all_kv(stack, monkeypatch):
    stub = stack.gateway_stub
    runner = stack.verifier_servicer.engine.verifier.runner
    llm_alloc = runner.allocator
    ssm_alloc = stack.speculators[0][1].worker.speculator.runners[0].allocator
    passes, run = [], runner.run
    monkeypatch.setattr(runner, "run", lambda works: passes.append(len(works)) or run(works))
    stream = stub.GenerateStream(pb.GenerateRequest(prompt="for x in", max_tokens=500, ignore_eos=True), timeout=60)
    first = next(stream)
    rid = first.request_id
    while llm_alloc.num_used == 0:
        next(stream)
    assert stub.CancelRequest(pb.CancelRequestRequest(request_id=rid), timeout=5).cancelled
    num_before = len(passes)
    assert wait_until(lambda: llm_alloc.num_used == 0 and ssm_alloc.num_used == 0, timeout=30)
    assert len(passes) - num_before < 10  # a step or two more, not the rest of its 500 tokens
    assert stub.GetRequest(pb.GetRequestRequest(request_id=rid), timeout=5).status == "cancelled"


def test_resume_after_disconnect_no_duplicates_or_gaps(stack):
    stub = stack.gateway_stub
    full = stub.Generate(pb.GenerateRequest(prompt="import os\nimport", max_tokens=60), timeout=60)
    rid = f"resume-{uuid.uuid4().hex[:8]}"
    stream = stub.GenerateStream(pb.GenerateRequest(prompt="import os\nimport", max_tokens=60, request_id=rid),
                                 timeout=60)
    got = []
    for chunk in stream:
        got += list(chunk.token_ids)
        if len(got) >= 10:
            stream.cancel()  # the client goes away mid-stream
            break
    assert wait_until(lambda: stub.GetRequest(pb.GetRequestRequest(request_id=rid), timeout=5).status != "running", 3)
    rest = []
    for chunk in stub.ResumeStream(pb.ResumeStreamRequest(request_id=rid, token_offset=len(got)), timeout=60):
        assert chunk.token_offset == len(got) + len(rest) or not chunk.token_ids
        rest += list(chunk.token_ids)
    assert got + rest == list(full.token_ids)


def test_speculator_death_mid_request_completes_exactly(text_pair, reference):
    llm, ssm = text_pair
    engine, tokenizer = reference
    with start_stack(llm, [ssm], tree_width=WIDTHS, speculator_step_timeout_s=2, gateway={}) as stack:
        tokens = []
        for i, chunk in enumerate(stack.gateway_stub.GenerateStream(
                pb.GenerateRequest(prompt="def add(", max_tokens=50), timeout=60)):
            tokens += list(chunk.token_ids)
            if i == 3:
                stack.speculators[0][0].stop(0)
        expected = engine.generate(tokenizer.encode("def add("), mode_params("incremental", 50))
        assert tokens == expected.output_ids
