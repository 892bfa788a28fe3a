"""The add-only request and response fields through a real stack (gateway, verifier, speculator
over gRPC): logprobs, the FinishReason enum, stop token ids, cached prompt tokens; and a message
without any of them behaves as before."""

from __future__ import annotations

import pytest

from specinfer.client import GatewayClient
from specinfer.engine.llm_engine import Engine, mode_params
from specinfer.engine.runtime.runner import ModelRunner
from specinfer.params import TreeShape
from specinfer.tokenizer import TextTokenizer
from specinfer.v1 import specinfer_pb2 as pb
from util import start_stack, wait_until

WIDTHS = (1, 1, 3, 1)
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def stack(text_pair):
    llm, ssm = text_pair
    with start_stack(llm, [ssm], tree_width=WIDTHS, is_load_aware=False, gateway={}) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack):
    with GatewayClient(f"127.0.0.1:{stack.gateway.port}", timeout_s=60) as c:
        yield c


def test_old_style_request_gets_what_it_always_did(stack):
    """A message built as an older client builds it: no logprobs, one sample, EOS-only stops."""
    stub = stack.gateway_stub
    resp = stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=12, ignore_eos=True), timeout=60)
    assert len(resp.token_ids) == 12 and resp.finish_reason == "length" and resp.text
    assert not resp.logprobs and not resp.samples and resp.logprob_space == pb.LOGPROB_SPACE_UNSPECIFIED
    assert resp.finish == pb.FINISH_REASON_LENGTH  # the new enum agrees with the kept string
    stream = list(stub.GenerateStream(pb.GenerateRequest(prompt=PROMPT, max_tokens=12, ignore_eos=True), timeout=60))
    assert [t for m in stream for t in m.token_ids] == list(resp.token_ids)
    assert all(m.index == 0 and not m.logprobs for m in stream)
    assert stream[-1].finish_reason == "length" and stream[-1].finish == pb.FINISH_REASON_LENGTH
    assert all(m.finish == pb.FINISH_REASON_UNSPECIFIED for m in stream[:-1])


def test_logprobs_through_the_gateway_are_the_engines(stack, client, text_pair):
    llm, ssm = text_pair
    tokenizer = TextTokenizer.from_dir(llm)
    engine = Engine.from_runners(ModelRunner.from_dir(llm), [ModelRunner.from_dir(ssm)])
    expected = engine.generate(tokenizer.encode(PROMPT),
                               mode_params("tree", 16, TreeShape(WIDTHS), num_logprobs=3, is_ignore_eos=True))
    done = client.generate(PROMPT, max_tokens=16, ignore_eos=True, logprobs=3, tree_width=WIDTHS)
    assert list(done.token_ids) == expected.output_ids and done.logprob_space == "raw"
    assert len(done.logprobs) == 16
    for ours, theirs in zip(done.logprobs, expected.output_logprobs):
        assert ours.token_id == theirs.token_id and abs(ours.logprob - theirs.logprob) < 1e-4
        assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]
    streamed = [lp for d in client.generate_stream(PROMPT, max_tokens=16, ignore_eos=True, logprobs=3,
                                                   tree_width=WIDTHS) for lp in d.logprobs]
    assert [lp.token_id for lp in streamed] == list(done.token_ids)
    sampled = client.generate(PROMPT, max_tokens=8, ignore_eos=True, logprobs=2, temperature=0.7, seed=3)
    assert sampled.logprob_space == "processed" and len(sampled.logprobs) == 8


def test_stop_token_ids_end_at_the_first_one_and_leave_its_text_out(client):
    free = client.generate(PROMPT, max_tokens=24, ignore_eos=True)
    k = 6
    stop = free.token_ids[k]
    first = free.token_ids.index(stop)
    stopped = client.generate(PROMPT, max_tokens=24, ignore_eos=True, stop_token_ids=[stop])
    assert list(stopped.token_ids) == list(free.token_ids[:first + 1])  # token-exact, the stop token included
    assert stopped.finish_reason == "stop" and stopped.finish == "stop"
    before = client.generate(PROMPT, max_tokens=first, ignore_eos=True) if first else None
    assert stopped.text == (before.text if before else "")  # its text is not part of the output
    streamed = list(client.generate_stream(PROMPT, max_tokens=24, ignore_eos=True, stop_token_ids=[stop]))
    assert "".join(d.text_delta for d in streamed) == stopped.text
    assert [t for d in streamed for t in d.token_ids] == list(stopped.token_ids)


def test_bad_stop_token_ids_are_invalid_argument(client):
    from specinfer.cli.client import GatewayError

    with pytest.raises(GatewayError, match="stop_token_ids"):
        client.generate(PROMPT, max_tokens=4, stop_token_ids=[10_000_000])
    with pytest.raises(GatewayError, match="stop_token_ids"):
        client.generate(PROMPT, max_tokens=4, stop_token_ids=list(range(17)))
    with pytest.raises(GatewayError, match="logprobs"):
        client.generate(PROMPT, max_tokens=4, logprobs=21)


def test_a_sessions_second_turn_reports_its_cached_prompt_tokens(stack, client):
    session = client.create_session("import os\nimport sys\n" * 4)
    first = client.generate("def add(a, b):", max_tokens=6, ignore_eos=True, session_id=session)
    # the turn's blocks stay cached once its call has ended, just after the last message
    assert wait_until(lambda: session in stack.verifier_servicer.engine.scheduler.sessions, 5.0)
    second = client.generate("\nfor x in range(3):", max_tokens=6, ignore_eos=True, session_id=session)
    assert first.stats.cached_prompt_tokens == 0
    assert 0 < second.stats.cached_prompt_tokens < second.stats.prompt_tokens
    assert second.stats.cached_prompt_tokens >= first.stats.prompt_tokens
    alone = client.generate("def add(a, b):", max_tokens=6, ignore_eos=True)
    assert alone.stats.cached_prompt_tokens == 0


LONG_PROMPT = "import os\nimport sys\n" * 6 + "def add(a, b):"


def test_n_samples_are_independent_seeded_requests_sharing_the_prompt(client):
    from specinfer.params import sample_seed

    done = client.generate(LONG_PROMPT, max_tokens=10, ignore_eos=True, temperature=0.9, seed=21, n=3,
                           request_id="three-samples")
    assert done.request_id == "three-samples" and [s.index for s in done.samples] == [0, 1, 2]
    assert [s.request_id for s in done.samples] == ["three-samples.0", "three-samples.1", "three-samples.2"]
    assert done.token_ids == done.samples[0].token_ids and done.text == done.samples[0].text
    for i, sample in enumerate(done.samples):  # each is the request it would be alone, with its seed
        alone = client.generate(LONG_PROMPT, max_tokens=10, ignore_eos=True, temperature=0.9,
                                seed=sample_seed(21, i))
        assert sample.token_ids == alone.token_ids and sample.finish == "length"
    assert len({s.token_ids for s in done.samples}) > 1
    cached = [s.stats.cached_prompt_tokens for s in done.samples]
    assert cached.count(0) <= 1 and max(cached) > 0  # the prompt was read once at most, then reused
    assert client.get_request("three-samples.2").token_ids == done.samples[2].token_ids


def test_n_samples_stream_interleaved_by_index(client):
    deltas = list(client.generate_stream(LONG_PROMPT, max_tokens=8, ignore_eos=True, temperature=0.8, seed=4,
                                         n=2, logprobs=1))
    done = client.generate(LONG_PROMPT, max_tokens=8, ignore_eos=True, temperature=0.8, seed=4, n=2)
    for i in range(2):
        mine = [d for d in deltas if d.index == i]
        assert [t for d in mine for t in d.token_ids] == list(done.samples[i].token_ids)
        assert "".join(d.text_delta for d in mine) == done.samples[i].text
        assert len([lp for d in mine for lp in d.logprobs]) == 8
        assert mine[-1].finish == "length" and mine[0].request_id.endswith(f".{i}")


def test_n_with_a_session_is_invalid_argument(client):
    from specinfer.cli.client import GatewayError

    session = client.create_session("import os\n")
    with pytest.raises(GatewayError, match="n: samples cannot continue a session"):
        client.generate(PROMPT, max_tokens=4, n=2, session_id=session)


def test_a_client_leaving_an_n_stream_leaves_every_sample_resumable(client):
    stream = client.generate_stream(LONG_PROMPT, max_tokens=12, ignore_eos=True, temperature=0.8, seed=9, n=2,
                                    request_id="left-early")
    next(stream)
    stream.close()  # the client goes away after the first message
    expected = client.generate(LONG_PROMPT, max_tokens=12, ignore_eos=True, temperature=0.8, seed=9, n=2)
    for i in range(2):
        resumed = [t for d in client.resume(f"left-early.{i}") for t in d.token_ids]
        assert resumed == list(expected.samples[i].token_ids)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 77}], ids=["greedy", "sampled"])
def test_n_4_is_one_verifier_call_whose_samples_are_four_single_requests(stack, client, monkeypatch, sampling):
    from specinfer.params import sample_seed

    servicer, calls = stack.verifier_servicer, []
    enter = servicer._enter
    monkeypatch.setattr(servicer, "_enter", lambda: calls.append(1) or enter())
    done = client.generate(LONG_PROMPT, max_tokens=10, ignore_eos=True, n=4, **sampling)
    assert len(calls) == 1 and len(done.samples) == 4  # one Verifier.Generate for the four samples
    seed = sampling.get("seed")
    singles = [client.generate(LONG_PROMPT, max_tokens=10, ignore_eos=True,
                               **{**sampling, "seed": sample_seed(seed, i) if seed is not None else None})
               for i in range(4)]
    assert len(calls) == 5
    assert [s.token_ids for s in done.samples] == [s.token_ids for s in singles]
    assert [s.text for s in done.samples] == [s.text for s in singles]
    if seed is not None:
        assert len({s.token_ids for s in done.samples}) > 1


def test_the_verifier_refuses_bad_samples_as_invalid_argument(stack):
    import grpc

    stub = stack.verifier_stub
    base = dict(prompt_ids=[3, 4, 5], max_new_tokens=4)
    for request, message in [
        (pb.VerifierGenerateRequest(num_samples=17, **base), "n: must be in"),
        (pb.VerifierGenerateRequest(num_samples=2, session_id="s", **base), "num_samples: samples cannot continue"),
        (pb.VerifierGenerateRequest(samples=[pb.SampleProgress(index=0)], **base), "samples: only with"),
        (pb.VerifierGenerateRequest(num_samples=2, samples=[pb.SampleProgress(index=2)], **base), "samples: each"),
        (pb.VerifierGenerateRequest(num_samples=2, samples=[pb.SampleProgress(index=1, token_ids=[6] * 4)], **base),
         "not fewer than max_new_tokens"),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()


def test_a_verifier_call_continuing_two_samples_streams_only_theirs(stack):
    stub = stack.verifier_stub
    base = dict(prompt_ids=[3, 4, 5, 6], max_new_tokens=6, ignore_eos=True,
                sampling=pb.SamplingParams(temperature=0.9, seed=5))
    whole = list(stub.Generate(pb.VerifierGenerateRequest(num_samples=3, **base), timeout=60))
    by_sample = {i: [t for m in whole if m.sample_index == i for t in m.token_ids] for i in range(3)}
    assert all(len(ids) == 6 for ids in by_sample.values())
    assert sorted(m.sample_index for m in whole if m.finish_reason) == [0, 1, 2]  # each ends by itself
    rest = list(stub.Generate(pb.VerifierGenerateRequest(num_samples=3, samples=[
        pb.SampleProgress(index=2, token_ids=by_sample[2][:4]), pb.SampleProgress(index=0, token_ids=by_sample[0][:1])],
        **base), timeout=60))
    assert {m.sample_index for m in rest} == {0, 2}
    assert by_sample[2][:4] + [t for m in rest if m.sample_index == 2 for t in m.token_ids] == by_sample[2]
    assert by_sample[0][:1] + [t for m in rest if m.sample_index == 0 for t in m.token_ids] == by_sample[0]
