"""The engine on the Triton attention backend equals the engine on SDPA (SpecInfer Section 4.2).

The whole engine runs here, not only the kernel: several requests at once with token trees from
two SSMs, a long prompt prefilled in chunks in the same forward passes as the others' trees,
requests joining and leaving between steps, greedy and seeded sampling, the fused commit of
accepted paths. On CPU the kernels run in Triton's interpreter (`use_interpreter()`, before
anything imports them), so the models are tiny. Also: how `ExecConfig` resolves per device, and
that flags which cannot apply are refused with a clear error.
"""

from __future__ import annotations

import json
import os

from specinfer.engine.kernels import use_interpreter

if os.environ.get("TRITON_INTERPRET") != "0":
    use_interpreter()  # before anything imports triton

import pytest
import torch

from specinfer.engine.runtime.backend import resolve_exec
from specinfer.engine.runtime.exec_config import ExecConfig
from specinfer.engine.llm_engine import Engine, EngineConfig, mode_params
from specinfer.engine.models.transformer import KVCache
from specinfer.engine.runtime.runner import ModelRunner, Work
from specinfer.engine.scheduling.scheduler import SchedulerConfig
from specinfer.errors import UserError
from specinfer.params import SamplingParams, TreeShape
from util import perturbed_copy, save_tiny_llama

pytest.importorskip("triton")

from specinfer.engine.kernels import is_interpreted  # noqa: E402
from specinfer.engine.kernels.commit import FusedCommitKVCache  # noqa: E402
from specinfer.engine.kernels.tree_attention import TritonAttention  # noqa: E402

DEVICE = "cpu" if is_interpreted() else "cuda"
SHAPE = TreeShape((2, 2, 1), max_nodes=8)
LONG_PROMPT = [(7 * i + 3) % 60 + 2 for i in range(40)]


@pytest.fixture(scope="module", params=["mha", "gqa"])
def models(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    kv_heads = 4 if request.param == "mha" else 2
    llm = save_tiny_llama(root / "llm", layers=2, heads=4, kv_heads=kv_heads, seed=3, eos_token_id=None)
    return llm, perturbed_copy(llm, root / "ssm", noise=0.3, seed=4)


def engine(models, attention: str) -> Engine:
    """The LLM with two SSMs (a noisy copy, and the LLM itself: long accepted paths that commits
    really move); a small token budget so that a long prompt is prefilled in chunks, in the same
    passes as the other requests' trees."""
    llm, ssm = models
    cfg = ExecConfig(attention=attention)
    runners = [ModelRunner.from_dir(d, device=DEVICE, max_kv_tokens=640, block_size=8, exec_cfg=cfg)
               for d in (llm, ssm, llm)]
    sched = SchedulerConfig(token_budget=40, min_prefill_chunk=8, admission_timeout_s=0.0)
    return Engine.from_runners(runners[0], runners[1:], EngineConfig(scheduler=sched, is_load_aware=False))


def spy_steps(runner: ModelRunner) -> list[list[tuple[int, int, bool]]]:
    """Records each forward pass's requests as (queries, committed prefix, is a chain)."""
    steps: list = []
    prepare = runner.tree_backend.prepare

    def recording(seqs, requests, device, window_seqs=None):
        steps.append([(r.n, r.num_committed, r.parents == list(range(-1, len(r.parents) - 1))) for r in requests])
        return prepare(seqs, requests, device, window_seqs)

    runner.tree_backend.prepare = recording
    return steps


def run_joining_and_leaving(eng: Engine, sampling: SamplingParams = SamplingParams()) -> list[list[int]]:
    """Two requests start; after two steps a long prompt joins (chunked prefill beside their
    trees); the short request leaves early; the rest run to the end."""
    short = eng.start([3, 17, 4, 29, 8], mode_params("tree", 4, SHAPE, sampling))
    mid = eng.start([60, 2, 33], mode_params("tree", 14, SHAPE, sampling))
    gens = [short, mid]
    for step in range(40):
        live = [g for g in gens if not g.is_done]
        if not live:
            break
        eng.step(live)
        for g in live:
            if g.is_done:
                eng.finish(g)
        if step == 1:
            gens.append(eng.start(LONG_PROMPT, mode_params("tree", 10, SHAPE, sampling)))
    assert all(g.is_done for g in gens)
    return [g.result.output_ids for g in gens]


def test_greedy_engine_output_triton_equals_sdpa(models):
    reference, fast = engine(models, "sdpa"), engine(models, "triton")
    llm = fast.verifier.runner
    assert isinstance(llm.model.attention_backend, TritonAttention) and isinstance(llm.kv, FusedCommitKVCache)
    assert reference.verifier.runner.tree_backend is None
    for runner in [llm, *fast.source.speculator.runners]:  # no request may take the SDPA path
        runner.model.attention = None
    steps = spy_steps(llm)
    got = run_joining_and_leaving(fast)
    assert got == run_joining_and_leaving(reference)
    assert [len(o) for o in got] == [4, 14, 10]
    # A pass held the long prompt's first chunk (a chain of many queries) beside another request's
    # tree, one launch per layer for both; a later pass continued the prompt after its committed
    # chunk (with its first tree).
    assert any(any(is_chain and n > 8 for n, _, is_chain in s) and any(not ch for _, _, ch in s) for s in steps)
    assert any(n > 8 + SHAPE.max_nodes and c > 8 for s in steps for n, c, _ in s)
    assert max(len(s) for s in steps) >= 2


def test_sampled_engine_output_triton_equals_sdpa_under_a_seed(models):
    if models[0].parent.name.startswith("mha"):
        pytest.skip("GQA covers the sampled path; the interpreter is slow")
    sampling = SamplingParams(temperature=0.9, seed=11)
    reference, fast = engine(models, "sdpa"), engine(models, "triton")
    got = run_joining_and_leaving(fast, sampling)
    assert got == run_joining_and_leaving(reference, sampling)
    assert got != run_joining_and_leaving(engine(models, "sdpa"), SamplingParams(temperature=0.9, seed=12))


def test_fused_commit_equals_the_reference_commit(models):
    runner = ModelRunner.from_dir(models[0], device=DEVICE, max_kv_tokens=128, block_size=8,
                                  exec_cfg=ExecConfig(attention="triton"))
    seq = runner.new_sequence()
    runner.prefill(seq, [5, 6, 7, 8, 9, 10, 11])  # 7 committed: the tree straddles two blocks
    parents = [-1, 0, 0, 1, 2, 3, 4]
    runner.run([Work(seq, [20 + i for i in range(7)], [7, 8, 8, 9, 9, 10, 10], parents, "all")])
    before = runner.kv.k.clone()
    expected = KVCache(runner.kv.k.clone(), runner.kv.v.clone())
    base = seq.num_committed
    path = [0, 2, 4, 6]  # accepted root-to-leaf path, scattered over the scratch region
    src = torch.tensor([seq.slot(base + s) for s in path[1:]])
    dst = torch.tensor([seq.slot(base + j) for j in range(1, len(path))])
    expected.move(src, dst)
    runner.commit(seq, path)
    assert torch.equal(runner.kv.k, expected.k) and torch.equal(runner.kv.v, expected.v)
    assert not torch.equal(runner.kv.k, before)  # the commit really moved rows


def test_exec_config_resolution_per_device():
    cpu = resolve_exec(ExecConfig(), "cpu")
    assert (cpu.attention, cpu.cuda_graphs, cpu.offload) == ("sdpa", False, False)  # auto on CPU: SDPA
    assert resolve_exec(cpu, "cpu") == cpu  # idempotent
    assert resolve_exec(ExecConfig(attention="triton"), "cpu").attention == "triton"  # the interpreter
    for bad, flag in ((ExecConfig(cuda_graphs=True), "--cuda-graphs"), (ExecConfig(offload=True), "--offload")):
        with pytest.raises(UserError, match=flag):
            resolve_exec(bad, "cpu")
    with pytest.raises(UserError, match="attention"):
        ExecConfig(attention="flash")


def test_exec_config_under_tensor_parallel_and_offload_refuses_graphs():
    if DEVICE != "cuda":
        pytest.skip("CUDA only: the combinations are refused before that on CPU")
    assert resolve_exec(ExecConfig(), "cuda", is_parallel=True).cuda_graphs is False
    with pytest.raises(UserError, match="--cuda-graphs"):
        resolve_exec(ExecConfig(cuda_graphs=True, offload=True), "cuda")


@pytest.mark.parametrize("flags, message", [
    (["--cuda-graphs", "--device", "cpu"], "--cuda-graphs needs a CUDA device"),
    (["--offload", "--device", "cpu"], "--offload streams"),
    (["--attention", "flash"], "choose one of auto, triton, sdpa"),
])
def test_cli_refuses_what_cannot_apply_with_exit_code_2(text_pair, capsys, flags, message):
    from specinfer.cli.main import main

    llm, ssm = text_pair
    assert main(["generate", "--llm", str(llm), "--ssm", str(ssm), "--prompt", "def", "--max-new-tokens", "2",
                 *flags]) == 2
    assert message in capsys.readouterr().err


def test_cli_generate_on_each_backend_gives_one_output(text_pair, capsys):
    from specinfer.cli.main import main

    llm, ssm = text_pair
    outputs = []
    for attention in ("sdpa", "triton"):
        assert main(["generate", "--llm", str(llm), "--ssm", str(ssm), "--prompt", "import os", "--max-new-tokens",
                     "6", "--device", "cpu", "--attention", attention, "--no-cuda-graphs", "--mode", "tree"]) == 0
        outputs.append({k: v for k, v in json.loads(capsys.readouterr().out).items() if "latency" not in k})
    assert outputs[0] == outputs[1] and outputs[0]["text"]


def test_up_refuses_cuda_graphs_without_cuda_before_building_anything(capsys, tmp_path):
    from specinfer.cli.main import main

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine may use CUDA graphs")
    assert main(["up", "--cuda-graphs", "--cache-dir", str(tmp_path)]) == 2
    assert "--cuda-graphs" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # no demo models were built


def test_service_flags_and_environment():
    from services.speculator.config import parse_config as speculator_config
    from services.verifier.config import parse_config as verifier_config

    env = {"SPECINFER_MODEL_DIR": "/m", "SPECINFER_ATTENTION": "triton", "SPECINFER_CUDA_GRAPHS": "off",
           "SPECINFER_OFFLOAD": "1"}
    assert verifier_config([], env).execution == ExecConfig("triton", False, True)
    assert verifier_config(["--cuda-graphs", "on", "--attention", "sdpa"], env).execution == ExecConfig(
        "sdpa", True, True)  # flags over the environment (resolving refuses this pair later)
    assert verifier_config([], {"SPECINFER_MODEL_DIR": "/m"}).execution == ExecConfig()
    assert speculator_config(["--ssm", "/s", "--cuda-graphs", "on"], {}).execution == ExecConfig("auto", True)
    for bad in ({"SPECINFER_ATTENTION": "flash"}, {"SPECINFER_CUDA_GRAPHS": "sometimes"}):
        with pytest.raises(UserError):
            verifier_config([], {"SPECINFER_MODEL_DIR": "/m", **bad})


def test_tensor_parallel_ranks_run_the_triton_backend(models):
    """Each rank of a two-rank group (gloo) runs Triton attention on its half of the heads; the
    greedy output equals the one-process SDPA model's."""
    from specinfer.engine.runtime.assemble import load_runner
    from specinfer.engine.runtime.parallel import ParallelConfig

    if models[0].parent.name.startswith("mha"):
        pytest.skip("one head layout is enough: the group costs two processes")
    llm = models[0]
    single = ModelRunner.from_dir(llm, device=DEVICE, max_kv_tokens=256, exec_cfg=ExecConfig(attention="sdpa"))
    sharded = load_runner(llm, device=DEVICE, max_kv_tokens=256, parallel=ParallelConfig.spawned(2),
                          exec_cfg=ExecConfig(attention="triton"))
    try:
        assert isinstance(sharded.model.model.attention_backend, TritonAttention)  # rank 0's own shard
        params = mode_params("tree", 8, SHAPE)
        outputs = [Engine.from_runners(r, [ModelRunner.from_dir(llm, device=DEVICE, max_kv_tokens=256)]).generate(
            [3, 17, 4, 29, 8], params).output_ids for r in (single, sharded)]
        assert outputs[0] == outputs[1] and len(outputs[0]) == 8
    finally:
        sharded.close()
