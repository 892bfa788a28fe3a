"""The verifier's continuous-batching scheduler: chunked prefill, admission control, no KV leaks."""

from __future__ import annotations

import random
import threading

import pytest

from specinfer.engine.llm_engine import Engine, mode_params
from specinfer.engine.loop import GenerationResult
from specinfer.engine.verification.verifier import Verifier
from specinfer.errors import CapacityError
from specinfer.engine.runtime.runner import ModelRunner
from specinfer.params import SamplingParams
from specinfer.engine.scheduling.scheduler import SchedulerConfig, Scheduler
from specinfer.engine.drafting.tree import TokenTree
from specinfer.v1 import specinfer_pb2 as pb
from util import start_stack, wait_until


def decode_greedy(worker: Scheduler, prompt: list[int], max_new: int, log: list | None = None,
                  label: str = "") -> list[int]:
    """Incremental decoding through the worker (one root-only tree per step); each step done
    appends `label` to `log` (steps of requests sharing a log come in the order they happened)."""
    session = worker.open(prompt, None, len(prompt) + max_new + 1)
    out = GenerationResult(prompt, [], 0)
    try:
        while not out.is_finished(max_new):
            tree = TokenTree.with_root(session.state.pending[-1])
            accepted, bonus = worker.verify(session, tree, SamplingParams(), None).result(timeout=30)
            out.record_step(accepted, bonus, 1, max_new, frozenset())
            if log is not None:
                log.append(label)
    finally:
        worker.close(session)
    return out.output_ids


@pytest.fixture
def worker_factory(tiny_pair):
    made = []

    def make(**kwargs):
        runner = ModelRunner.from_dir(tiny_pair.llm, max_kv_tokens=kwargs.pop("max_kv_tokens", 4096), block_size=8)
        w = Scheduler(Verifier(runner), SchedulerConfig(**kwargs))
        made.append(w)
        return w

    yield make
    for w in made:
        w.worker.stop()


def test_chunked_prefill_is_exact_and_does_not_stall_decoding(worker_factory, tiny_pair, executor):
    engine = Engine.from_runners(ModelRunner.from_dir(tiny_pair.llm))
    long_prompt = [random.Random(3).randrange(2, 128) for _ in range(300)]
    short_prompt = [5, 6, 7]
    worker = worker_factory(token_budget=16, min_prefill_chunk=8)
    log: list[str] = []  # the steps of both requests, in order
    short = executor.submit(decode_greedy, worker, short_prompt, 200, log, "short")
    assert wait_until(lambda: log.count("short") >= 3 or short.done(), timeout=30)
    assert log.count("short") >= 3, short.result(timeout=0)  # re-raises what stopped it early
    log.append("long arrives")
    long_output = decode_greedy(worker, long_prompt, 10, log, "long")
    short_output = short.result(timeout=60)
    assert long_output == engine.generate(long_prompt, mode_params("incremental", 10, is_ignore_eos=True)).output_ids
    assert short_output == engine.generate(short_prompt, mode_params("incremental", 200, is_ignore_eos=True)).output_ids
    # 300 prompt tokens at <= 16 per pass take many passes; the short request kept decoding meanwhile.
    during_prefill = log[log.index("long arrives"):log.index("long")].count("short")
    assert during_prefill >= 5, during_prefill
    assert worker.runner.allocator.num_used == 0


def test_admission_waits_for_memory_then_runs(worker_factory, executor):
    worker = worker_factory(max_kv_tokens=64, max_waiting=4, admission_timeout_s=10)  # 8 blocks of 8
    first = worker.open([1, 2, 3], None, 60)  # takes 8 blocks: everything
    is_deferred, try_admit = threading.Event(), worker._try_admit

    def watched(*args):
        is_admitted = try_admit(*args)
        if not is_admitted:
            is_deferred.set()
        return is_admitted

    worker._try_admit = watched
    pending = executor.submit(worker.open, [4, 5], None, 40)
    assert is_deferred.wait(10) and not pending.done()  # waiting for memory, not failed
    worker.close(first)
    second = pending.result(timeout=5)
    assert second.state.seq.capacity >= 40
    worker.close(second)
    assert worker.runner.allocator.num_used == 0


def test_admission_rejects_when_queue_full_or_timeout(worker_factory, executor):
    worker = worker_factory(max_kv_tokens=64, max_waiting=1, admission_timeout_s=1.0)
    hog = worker.open([1, 2, 3], None, 64)
    # Two requests arrive together while the cache is full and the queue holds one: whichever
    # the worker takes first waits (and times out), the other is turned away at once.
    arrive = threading.Barrier(2)

    def open_after_barrier():
        arrive.wait(5)
        return worker.open([4], None, 16)

    calls = [executor.submit(open_after_barrier) for _ in range(2)]
    errors = []
    for call in calls:
        with pytest.raises(CapacityError) as err:
            call.result(timeout=10)
        errors.append(str(err.value))
    assert sorted("queue is full" in e for e in errors) == [False, True], errors
    assert sorted("timed out" in e for e in errors) == [False, True], errors
    with pytest.raises(CapacityError, match="cache holds"):
        worker.open([1], None, 10_000)  # can never fit
    worker.close(hog)
    assert worker.runner.allocator.num_used == 0


def test_thousand_cancel_loops_leak_no_kv(tiny_pair):
    """Start and cancel 1,000 requests at random points; every KV block comes back."""
    with start_stack(tiny_pair.llm, [tiny_pair.ssms[0]], tree_width=(1, 2, 1)) as stack:
        stub, servicer = stack.verifier_stub, stack.verifier_servicer
        rng = random.Random(0)
        for i in range(1000):
            call = stub.Generate(pb.VerifierGenerateRequest(
                prompt_ids=[rng.randrange(2, 128) for _ in range(rng.randrange(1, 20))], max_new_tokens=200,
                speculate=i % 3 != 0, ignore_eos=True), timeout=30)
            for _ in range(rng.randrange(0, 3)):
                next(call, None)
            call.cancel()
        llm = servicer.engine.verifier.runner.allocator
        ssm = stack.speculators[0][1].worker.speculator.runners[0].allocator
        wait_until(lambda: not (llm.num_used or ssm.num_used or servicer.engine.scheduler.num_open), timeout=10)
        assert llm.num_used == 0 and ssm.num_used == 0 and servicer.engine.scheduler.num_open == 0
        assert llm.num_free == llm.num_blocks


def test_kv_budget_parses_tokens_and_bytes():
    from specinfer.engine.runtime.memory import plan_kv
    from specinfer.engine.models.config import ModelConfig
    from specinfer.errors import UserError
    from specinfer.limits import parse_kv_budget

    assert parse_kv_budget("65536") == (65536, 0)
    assert parse_kv_budget("4096 tokens") == (4096, 0)
    assert parse_kv_budget("2GiB") == (0, 2 * 2**30)
    assert parse_kv_budget("512MB") == (0, 512 * 10**6)
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=64, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64,
                      rms_norm_eps=1e-5)
    # one token: K and V, 2 layers, 2 KV heads of 16 floats = 2*2*2*16*4 bytes = 512 bytes
    assert plan_kv([(cfg, "float32")], budget=(0, 1 << 20)).num_tokens == 2048
    assert plan_kv([(cfg, "float32")], budget=(300, 0)).num_tokens == 300
    assert parse_kv_budget("auto") == (0, 0)
    for bad in ("lots", "-5", "0GiB", "inf"):
        with pytest.raises(UserError):
            parse_kv_budget(bad)


def test_requests_joining_and_leaving_mid_flight_keep_greedy_outputs(tiny_pair, executor):
    """Mixed prompt lengths, staggered arrivals, different lengths: every output equals the
    request run alone."""
    with start_stack(tiny_pair.llm, [tiny_pair.ssms[0]], tree_width=(2, 1, 1), token_budget=48,
                     is_load_aware=False) as stack:
        stub, servicer = stack.verifier_stub, stack.verifier_servicer
        rng = random.Random(11)
        jobs = [([rng.randrange(2, 128) for _ in range(rng.choice([1, 5, 40, 120]))], rng.randrange(5, 50),
                 i % 2 == 0) for i in range(10)]
        batch_sizes = []  # requests open whenever one of them receives tokens

        def run(prompt, max_new, speculate, on_tokens=lambda: None):
            req = pb.VerifierGenerateRequest(prompt_ids=prompt, max_new_tokens=max_new, speculate=speculate,
                                             ignore_eos=True)
            tokens = []
            for r in stub.Generate(req, timeout=60):
                tokens += r.token_ids
                on_tokens()
            return tokens

        alone = [run(*job) for job in jobs]
        decoding = [threading.Event() for _ in jobs]  # set once the request has received tokens

        def client(i):
            def on_tokens():
                batch_sizes.append(servicer.engine.scheduler.num_open)
                decoding[i].set()

            try:  # staggered arrivals: each request joins while the one before it decodes
                assert i == 0 or decoding[i - 1].wait(60), f"request {i - 1} never decoded"
                return run(*jobs[i], on_tokens=on_tokens)
            finally:
                decoding[i].set()  # a failed request must not hold the next one back

        together = [executor.submit(client, i) for i in range(len(jobs))]
        assert [f.result(timeout=120) for f in together] == alone
        assert max(batch_sizes) >= 3, batch_sizes  # they really overlapped


def test_stopping_an_unthreaded_worker_ends_its_run_loop():
    """A service runs its worker loop on the main thread; SIGTERM stops it from another thread."""
    from specinfer.engine.scheduling.workers import BatchWorker

    worker = BatchWorker("test", lambda jobs: None, is_threaded=False)
    loop = threading.Thread(target=worker.run, daemon=True)
    loop.start()
    worker.stop()
    loop.join(timeout=5)
    assert not loop.is_alive()


def test_model_passes_run_only_on_the_thread_that_runs_the_worker(tiny_pair, executor):
    """A service runs the worker loop on its main thread (the one that loaded the model) while
    request threads submit: no request thread may run a model pass itself."""
    runner = ModelRunner.from_dir(tiny_pair.llm, max_kv_tokens=4096, block_size=8)
    pass_threads = set()
    run = runner.run

    def recording_run(works):
        pass_threads.add(threading.current_thread().name)
        return run(works)

    runner.run = recording_run
    scheduler = Scheduler(Verifier(runner), SchedulerConfig(), is_threaded=False)
    loop = threading.Thread(target=scheduler.run, name="model-loop", daemon=True)
    loop.start()
    try:
        outputs = [f.result(timeout=60) for f in [executor.submit(decode_greedy, scheduler, [5, 6, 7 + i], 12)
                                                   for i in range(3)]]
        assert all(len(o) == 12 for o in outputs)
        assert pass_threads == {"model-loop"}
    finally:
        scheduler.stop()
        loop.join(timeout=5)


def test_an_invalid_tree_fails_its_own_request_and_not_its_neighbours(tiny_pair):
    """One pass verifies three requests' trees; the middle one's verification is poisoned (sampling
    noise of the wrong vocabulary size). It fails alone; the others decode on, exactly."""
    from specinfer.engine.verification.sampling import SamplingNoise

    engine = Engine.from_runners(ModelRunner.from_dir(tiny_pair.llm))
    runner = ModelRunner.from_dir(tiny_pair.llm, max_kv_tokens=1024, block_size=8)
    scheduler = Scheduler(Verifier(runner), SchedulerConfig(), is_threaded=False, is_inline=True)  # one pass each
    prompts = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    sessions = [scheduler.open(p, None, len(p) + 20) for p in prompts]
    sampled = SamplingParams(temperature=1.0, seed=1)
    try:
        outputs = [[] for _ in prompts]
        for step in range(8):
            futures = []
            for i, session in enumerate(sessions):
                if session is None:
                    futures.append(None)
                    continue
                root = session.state.pending[-1]
                tree = TokenTree.with_root(root)
                if i == 1 and step == 3:  # poison: noise that does not fit the LLM's logits
                    tree.add_draft(0, 4)
                    futures.append(scheduler.verify(session, tree, sampled, SamplingNoise(1, 3)))
                else:
                    futures.append(scheduler.verify(session, tree, SamplingParams(), None))
            scheduler.pump([f for f in futures if f is not None])  # all of them in one forward pass
            for i, future in enumerate(futures):
                if future is None:
                    continue
                if i == 1 and step == 3:
                    with pytest.raises(RuntimeError):
                        future.result(timeout=30)
                    scheduler.close(sessions[1])
                    sessions[1] = None
                    continue
                accepted, bonus = future.result(timeout=30)
                outputs[i] += accepted + [bonus]
        plain = mode_params("incremental", 8, is_ignore_eos=True)
        for i in (0, 2):
            assert outputs[i] == engine.generate(prompts[i], plain).output_ids
        assert len(outputs[1]) == 3
    finally:
        for session in sessions:
            if session is not None:
                scheduler.close(session)


def test_tiny_temperatures_decode_greedily_instead_of_overflowing(tiny_pair):
    """temperature=1e-40 is positive, so it used to be sampled: its probabilities overflowed to
    NaN and failed every request in the same pass. It is greedy now, and its neighbours are fine."""
    from specinfer.params import GenerationParams

    assert SamplingParams(temperature=1e-40).is_greedy and not SamplingParams(temperature=1e-4).is_greedy
    engine = Engine.from_runners(ModelRunner.from_dir(tiny_pair.llm))
    tiny = GenerationParams(12, SamplingParams(temperature=1e-40, seed=3), is_speculative=False, is_ignore_eos=True)
    plain = GenerationParams(12, is_speculative=False, is_ignore_eos=True)
    batch = [engine.start([5, 6, 7], tiny), engine.start([8, 9, 10], plain), engine.start([5, 6, 7], plain)]
    results = engine.generate_batch(batch)
    assert results[0].output_ids == results[2].output_ids and len(results[1].output_ids) == 12
