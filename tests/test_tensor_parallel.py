"""Tensor parallelism on CPU with gloo: two ranks must decode exactly what one process decodes.

Tiny random models (MHA with biases, GQA), incremental and tree decoding, several requests in
one pass, seeded sampling, the sharded KV commit read back from both ranks, a rank dying, and the
verifier service sharded over two ranks.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from specinfer.engine.llm_engine import Engine, EngineConfig, mode_params
from specinfer.engine.models.transformer import KVCache
from specinfer.engine.runtime.parallel import GroupBroken, ParallelConfig, ShardSpec, build_shard, serve_worker
from specinfer.engine.runtime.assemble import load_runner
from specinfer.engine.runtime.runner import ModelRunner, Work
from specinfer.engine.scheduling.scheduler import SchedulerConfig
from specinfer.errors import UnavailableError, UserError
from specinfer.params import SamplingParams, TreeShape
from specinfer.v1 import specinfer_pb2 as pb
from services.gateway.verifier_client import RESUMABLE_CODES
from util import perturbed_copy, save_tiny_llama, start_stack, wait_until

WIDTHS = (2, 2, 1)
PROMPTS = [[5, 6, 7], [9] * 20, list(range(2, 40)), [3, 100, 4, 90, 17]]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (LLM, SSM): MHA with attention biases (row-parallel o_bias), and GQA."""
    root = tmp_path_factory.mktemp("tp")
    mha = save_tiny_llama(root / "mha", vocab=128, hidden=64, layers=2, heads=4, kv_heads=4, intermediate=96,
                          max_pos=512, seed=3, attention_bias=True)
    gqa = save_tiny_llama(root / "gqa", vocab=128, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128,
                          max_pos=512, seed=1)
    return {name: (llm, perturbed_copy(llm, root / f"{name}-ssm", noise=0.04, seed=7))
            for name, llm in (("mha", mha), ("gqa", gqa))}


class Groups:
    """One tensor-parallel group per process at a time: the open one is closed before another
    starts (a test that starts its own closes this one first)."""

    def __init__(self, models):
        self.models = models
        self.single: dict[str, tuple[ModelRunner, ModelRunner]] = {}
        self.open: tuple[str, ModelRunner] | None = None

    def __call__(self, name: str) -> tuple[ModelRunner, ModelRunner, ModelRunner]:
        """(one-process LLM, the LLM sharded over two ranks, the SSM)."""
        llm, ssm = self.models[name]
        if name not in self.single:
            self.single[name] = (ModelRunner.from_dir(llm, max_kv_tokens=4096),
                                 ModelRunner.from_dir(ssm, max_kv_tokens=4096))
        if self.open is None or self.open[0] != name:
            self.close()
            self.open = (name, load_runner(llm, max_kv_tokens=4096, parallel=ParallelConfig.spawned(2)))
        single, ssm_runner = self.single[name]
        return single, self.open[1], ssm_runner

    def close(self) -> None:
        if self.open is not None:
            self.open[1].close()
            self.open = None


@pytest.fixture(scope="module")
def runners(models):
    groups = Groups(models)
    yield groups
    groups.close()


@pytest.mark.parametrize("mode", ["incremental", "tree"])
@pytest.mark.parametrize("name", ["mha", "gqa"])
def test_two_ranks_decode_what_one_does(runners, name, mode):
    single, sharded, ssm = runners(name)
    one, two = Engine.from_runners(single, [ssm]), Engine.from_runners(sharded, [ssm])
    params = mode_params(mode, 24, TreeShape(WIDTHS))
    expected = [one.generate(p, params) for p in PROMPTS]
    # Several requests at once: their prompts and trees share every forward pass of the group.
    got = two.generate_batch([two.start(p, params) for p in PROMPTS])
    assert [r.output_ids for r in got] == [r.output_ids for r in expected]
    assert [r.num_llm_steps for r in got] == [r.num_llm_steps for r in expected]
    if mode == "tree":
        assert sum(r.num_llm_steps for r in got) < sum(len(r.output_ids) for r in got)  # trees were accepted
    assert sharded.allocator.num_used == 0


def test_prefix_cache_hits_on_two_ranks_decode_what_one_does_cold(runners):
    """The prefix cache is bookkeeping on rank 0; every rank reads the shared blocks' slots."""
    single, sharded, ssm = runners("gqa")
    cold = Engine.from_runners(single, [ssm], EngineConfig(scheduler=SchedulerConfig(
        admission_timeout_s=0.0, is_prefix_caching=False)))
    two = Engine.from_runners(sharded, [ssm])
    shared = [7 + i % 50 for i in range(70)]
    prompts = [shared + p for p in PROMPTS]
    params = mode_params("tree", 16, TreeShape(WIDTHS))
    expected = [cold.generate(p, params).output_ids for p in prompts]
    first = two.generate(prompts[0], params)  # the rest find its blocks
    later = [two.start(p, params) for p in prompts[1:]]
    assert all(g.session.num_reused >= 64 for g in later)
    assert [first.output_ids] + [r.output_ids for r in two.generate_batch(later)] == expected
    assert sharded.allocator.num_used == 0


def test_logits_match_and_each_rank_holds_half_the_kv_heads(runners):
    single, sharded, _ = runners("gqa")
    assert sharded.kv.k.shape[2] * 2 == single.kv.k.shape[2]
    a, b = single.new_sequence(), sharded.new_sequence()
    try:
        la, lb = single.prefill(a, PROMPTS[2]), sharded.prefill(b, PROMPTS[2])
        torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-4)
    finally:
        a.free()
        b.free()


def test_seeded_sampling_is_reproducible(runners):
    single, sharded, ssm = runners("gqa")
    two = Engine.from_runners(sharded, [ssm])

    def sample(engine, seed):
        sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
        return engine.generate(PROMPTS[0], mode_params("tree", 30, TreeShape(WIDTHS), sampling)).output_ids

    first = sample(two, 5)
    assert sample(two, 5) == first
    assert sample(Engine.from_runners(single, [ssm]), 5) == first
    assert sample(two, 6) != first


def test_sizes_that_split_a_kv_head_are_refused_before_anything_starts(models):
    llm, _ = models["gqa"]  # 4 heads, 2 KV heads
    before = set(multiprocessing.active_children())
    for num_ranks in (3, 4):
        with pytest.raises(UserError, match=f"--tensor-parallel {num_ranks} does not divide the model's 2 KV heads"):
            load_runner(llm, parallel=ParallelConfig(num_ranks))
    assert set(multiprocessing.active_children()) == before


def _dump_rank(spec: ShardSpec, pc: ParallelConfig, out: str) -> None:
    """Rank 1 of a launched group: serves rank 0's steps until told to stop, then saves its KV share."""
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    model, group = build_shard(spec, pc)
    kv = KVCache.allocate(model.cfg, spec.num_slots, model.dtype, model.device)
    serve_worker(model, kv, group)
    group.close()
    save_file({"k": kv.k.contiguous(), "v": kv.v.contiguous()}, out)


def test_sharded_kv_commit_moves_every_ranks_share(models, runners, tmp_path):
    """A tree step and a commit of a non-trivial path, on two ranks started like torchrun would
    (rank 0 spawns nothing): each rank's KV share equals its heads of the one-process cache."""
    runners.close()
    llm, _ = models["mha"]
    pc = replace(ParallelConfig.spawned(2), is_launched=True)
    out = tmp_path / "rank1.safetensors"
    spec = ShardSpec(str(llm), "float32", "cpu", 64)
    rank1 = multiprocessing.get_context("spawn").Process(target=_dump_rank, args=(spec, replace(pc, rank=1),
                                                                                  str(out)))
    rank1.start()
    single = ModelRunner.from_dir(llm, max_kv_tokens=64)
    sharded = load_runner(llm, max_kv_tokens=64, parallel=pc)
    try:
        for runner in (single, sharded):
            seq = runner.new_sequence()
            runner.prefill(seq, [5, 6, 7, 8])
            # root 9 with children 10, 11; 12 under 10, 13 under 11: accept 9 -> 11 -> 13
            runner.run([Work(seq, [9, 10, 11, 12, 13], [4, 5, 5, 6, 6], [-1, 0, 0, 1, 2])])
            before = runner.kv.k[:, seq.slots(4, 7)].clone()
            runner.commit(seq, [0, 2, 4])
            assert not torch.equal(runner.kv.k[:, seq.slots(4, 7)], before)  # slots really moved
        slots = seq.slots(0, 7)
        half = single.kv.k.shape[2] // 2
        torch.testing.assert_close(sharded.kv.k[:, slots], single.kv.k[:, slots, :half], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sharded.kv.v[:, slots], single.kv.v[:, slots, :half], rtol=1e-5, atol=1e-5)
    finally:
        sharded.close()
        rank1.join(timeout=60)
    assert rank1.exitcode == 0
    from safetensors.torch import load_file

    other = load_file(str(out))
    torch.testing.assert_close(other["k"][:, slots], single.kv.k[:, slots, half:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(other["v"][:, slots], single.kv.v[:, slots, half:], rtol=1e-5, atol=1e-5)


def test_a_rank_dying_breaks_the_group(models, runners):
    runners.close()
    sharded = load_runner(models["gqa"][0], max_kv_tokens=256, parallel=ParallelConfig.spawned(2))
    leader = sharded.model.leader
    reasons: list[str] = []
    leader.on_broken(reasons.append)
    engine = Engine.from_runners(sharded)
    try:
        assert len(engine.generate(PROMPTS[0], mode_params("incremental", 4)).output_ids) == 4
        os.kill(leader.workers[0].pid, signal.SIGKILL)
        assert wait_until(lambda: reasons, timeout=5)
        assert "rank 1 exited" in reasons[0]
        with pytest.raises(GroupBroken):
            engine.generate(PROMPTS[0], mode_params("incremental", 4))
        assert issubclass(GroupBroken, UnavailableError)  # the service answers UNAVAILABLE
    finally:
        sharded.close()


def test_launcher_environment_is_read():
    env = {"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "x", "MASTER_PORT": "1"}
    pc = ParallelConfig.from_env(4, env)
    assert (pc.num_ranks, pc.rank, pc.local_rank, pc.is_launched, pc.init_method) == (4, 2, 0, True, "env://")
    assert ParallelConfig.from_env(1, env).num_ranks == 4  # the launcher's size when the flag is left out
    with pytest.raises(UserError, match="WORLD_SIZE"):
        ParallelConfig.from_env(2, env)
    alone = ParallelConfig.from_env(2, {})
    assert not alone.is_launched and alone.init_method.startswith("tcp://127.0.0.1:")


def test_verifier_service_on_two_ranks(models, runners):
    llm, ssm = models["gqa"]
    single, _, ssm_runner = runners("gqa")
    expected = Engine.from_runners(single, [ssm_runner]).generate(PROMPTS[3], mode_params("tree", 20,
                                                                                          TreeShape(WIDTHS)))
    runners.close()
    with start_stack(llm, [ssm], tree_width=WIDTHS, is_load_aware=False, tensor_parallel=2) as stack:
        tokens = []
        for r in stack.verifier_stub.Generate(pb.VerifierGenerateRequest(prompt_ids=PROMPTS[3], max_new_tokens=20,
                                                                         speculate=True), timeout=60):
            tokens += list(r.token_ids)
        assert tokens == expected.output_ids
        assert stack.verifier_stub.Info(pb.InfoRequest(), timeout=5).vocab_size == 128
        runner = stack.verifier_servicer.engine.verifier.runner
        os.kill(runner.model.leader.workers[0].pid, signal.SIGKILL)
        assert wait_until(lambda: stack.verifier.health._server_status.get("")
                          == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=5)
        with pytest.raises(grpc.RpcError) as err:
            list(stack.verifier_stub.Generate(pb.VerifierGenerateRequest(prompt_ids=[3, 4], max_new_tokens=2),
                                              timeout=10))
        # UNAVAILABLE once stopped, CANCELLED while gRPC is stopping: a gateway resumes both elsewhere
        assert err.value.code() in {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
        assert err.value.code() in RESUMABLE_CODES
        runner.close()


def test_torchrun_launches_the_verifier(models):
    """Every rank runs `services.verifier` under torchrun (env:// rendezvous): rank 0 serves gRPC,
    rank 1 only follows its steps; the output is the one-process model's."""
    import subprocess
    import sys

    from grpc_health.v1 import health_pb2_grpc

    from specinfer.v1 import specinfer_pb2_grpc as pb_grpc
    from util import free_port

    llm, _ = models["gqa"]
    params = mode_params("incremental", 12)
    expected = Engine.from_runners(ModelRunner.from_dir(llm)).generate(PROMPTS[3], params).output_ids
    port = free_port()
    env = dict(os.environ, SPECINFER_LOG_LEVEL="warning", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), "-m", "services.verifier", "--model", str(llm),
                             "--device", "cpu", "--port", str(port), "--kv-budget", "2048", "--threads", "1"],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        health = health_pb2_grpc.HealthStub(channel)

        def serving() -> bool:
            try:
                return health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                    health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                return False

        assert wait_until(serving, timeout=120, interval=0.5), "the torchrun group never served"
        stub = pb_grpc.VerifierStub(channel)
        tokens = [t for r in stub.Generate(pb.VerifierGenerateRequest(prompt_ids=PROMPTS[3], max_new_tokens=12),
                                           timeout=60) for t in r.token_ids]
        assert tokens == expected
    finally:
        channel.close()
        os.killpg(proc.pid, signal.SIGTERM)  # torchrun stops both ranks
        proc.wait(timeout=60)


def test_a_step_survives_its_trip_as_plain_tensors():
    """What ranks > 0 receive is the batch rank 0 ran: scattered context slots, index writes,
    and every kind of mask (none, causal, a tree under a visible prefix, a tree alone)."""
    from specinfer.engine.models.transformer import ForwardBatch, SeqAttention
    from specinfer.engine.runtime.parallel import decode_batch, encode_batch

    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    with_prefix = torch.cat([torch.ones(3, 5, dtype=torch.bool), tree], dim=1)
    seqs = [SeqAttention(0, 1, slice(0, 9)), SeqAttention(1, 4, slice(16, 19), is_causal=True),
            SeqAttention(4, 7, torch.tensor([40, 41, 7, 8, 9, 50, 51, 52]), with_prefix),
            SeqAttention(7, 10, slice(60, 63), tree)]
    batch = ForwardBatch(torch.arange(100, 110), torch.arange(10) * 3, torch.tensor([8, 16, 17, 18, 50, 51, 52,
                                                                                     60, 61, 62]), seqs)
    ints, bits = encode_batch(batch)
    assert bits.numel() == 6 + 6  # columns every query sees (the prefix, the tree's root) do not travel
    got = decode_batch(ints, bits, "cpu")
    assert torch.equal(got.token_ids, batch.token_ids) and torch.equal(got.positions, batch.positions)
    assert torch.equal(got.write, batch.write) and got.logit_rows.numel() == 0
    for a, b in zip(got.seqs, seqs):
        assert (a.q_start, a.q_end, a.is_causal) == (b.q_start, b.q_end, b.is_causal)
        assert torch.equal(a.context, b.context) if isinstance(b.context, torch.Tensor) else a.context == b.context
        assert (a.mask is None) == (b.mask is None) and (a.mask is None or torch.equal(a.mask, b.mask))
    single = ForwardBatch(batch.token_ids[:1], batch.positions[:1], slice(3, 4), seqs[:1])
    assert decode_batch(*encode_batch(single), "cpu").write == slice(3, 4)
