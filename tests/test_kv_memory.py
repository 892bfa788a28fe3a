"""The KV cache's size (`engine.runtime.memory`): a budget as given, or sized from the model and
the free memory like vLLM's, within what the requests can use; and the flags that set it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from specinfer.cli.launcher import Stack
from specinfer.engine.models.config import ModelConfig
from specinfer.engine.runtime.memory import Memory, host_memory, num_parameters, plan_kv
from specinfer.errors import UserError
from specinfer.limits import DEFAULT_KV_MEMORY_FRACTION_CPU, DEFAULT_KV_MEMORY_FRACTION_CUDA

GIB = 1 << 30
REAL_START = Stack.start
# SmolLM2-135M's shape: 30 layers of 3 KV heads of 64, tied embeddings of 49152 x 576
SMOL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                   num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
                   rms_norm_eps=1e-5, tie_word_embeddings=True)
SMOL_TOKEN = 2 * 30 * 3 * 64 * 4  # K and V of every layer in float32: 46,080 bytes


def test_the_default_follows_the_model_its_dtype_and_the_free_memory():
    weights = num_parameters(SMOL) * 4
    ram = Memory(20 * GIB, 24 * GIB, "RAM")
    plan = plan_kv([(SMOL, "float32")], "cpu", request_tokens=2624, max_batch=256, memory=ram)
    assert plan.bytes_per_token == SMOL_TOKEN
    assert plan.num_tokens == int(DEFAULT_KV_MEMORY_FRACTION_CPU * (20 * GIB - weights)) // SMOL_TOKEN
    half = plan_kv([(SMOL, "bfloat16")], "cpu", request_tokens=2624, max_batch=256, memory=ram)
    assert half.bytes_per_token == SMOL_TOKEN // 2 and half.num_tokens > 2 * plan.num_tokens - 2  # and lighter weights
    gpu = plan_kv([(SMOL, "float32")], "cuda", request_tokens=2624, max_batch=256, memory=Memory(GIB, GIB, "cuda:0"))
    assert gpu.num_tokens == int(DEFAULT_KV_MEMORY_FRACTION_CUDA * (GIB - weights)) // SMOL_TOKEN
    mine = plan_kv([(SMOL, "float32")], "cpu", fraction=0.5, request_tokens=2624, max_batch=256, memory=ram)
    assert mine.num_tokens == int(0.5 * (20 * GIB - weights)) // SMOL_TOKEN
    assert f"{DEFAULT_KV_MEMORY_FRACTION_CPU:g} of the" in plan.describe() and f"{plan.num_tokens:,} tokens" in plan.describe()


def test_never_more_than_the_batch_uses_nor_less_than_one_request():
    ram = Memory(20 * GIB, 24 * GIB, "RAM")
    capped = plan_kv([(SMOL, "float32")], "cpu", fraction=0.5, request_tokens=2624, max_batch=2, memory=ram)
    assert capped.num_tokens == 2 * 2624 and "2 requests" in capped.reason
    small = Memory(700 << 20, GIB, "RAM")  # 160 MB free once the weights load: 1% holds 35 tokens
    floor = plan_kv([(SMOL, "float32")], "cpu", request_tokens=2624, max_batch=256, memory=small)
    assert floor.num_tokens == 2624 and "one request" in floor.reason
    with pytest.raises(UserError, match="one request of 8,000 tokens"):
        plan_kv([(SMOL, "float32")], "cpu", request_tokens=8000, max_batch=256, memory=small)


def test_a_given_budget_wins_and_co_located_ssms_caches_count():
    ssm = ModelConfig(**{**SMOL.__dict__, "num_layers": 2})
    both = plan_kv([(SMOL, "float32"), (ssm, "bfloat16")], "cpu", budget=(0, 100 << 20))
    assert both.bytes_per_token == SMOL_TOKEN + 2 * 3 * 64 * 2 * 2
    assert both.num_tokens == (100 << 20) // both.bytes_per_token
    assert plan_kv([(SMOL, "float32")], budget=(4096, 0)).num_tokens == 4096
    with pytest.raises(UserError, match="kv-memory-fraction"):
        plan_kv([(SMOL, "float32")], fraction=1.5, memory=Memory(GIB, GIB, "RAM"))


def test_parameters_are_counted_from_the_config(tmp_path):
    from safetensors import safe_open

    from util import save_tiny_llama

    for tie in (False, True):
        path = save_tiny_llama(tmp_path / str(tie), tie=tie)
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            stored = sum(f.get_tensor(k).numel() for k in f.keys())
        assert num_parameters(ModelConfig.from_dir(path)) == stored
    assert 134e6 < num_parameters(SMOL) < 135e6


def test_host_memory_reads_meminfo_within_a_cgroup_limit(tmp_path):
    meminfo = "MemTotal:       24000000 kB\nMemFree:  1000 kB\nMemAvailable:   18000000 kB\n"
    none = tmp_path / "none"
    assert host_memory(meminfo, none) == Memory(18000000 * 1024, 24000000 * 1024, "RAM")
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{4 * GIB}\n")
    (v2 / "memory.current").write_text(f"{GIB}\n")
    assert host_memory(meminfo, v2) == Memory(3 * GIB, 4 * GIB, "RAM")
    (v2 / "memory.max").write_text("max\n")
    assert host_memory(meminfo, v2).total_bytes == 24000000 * 1024
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{2 * GIB}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{GIB // 2}\n")
    assert host_memory(meminfo, tmp_path / "v1") == Memory(GIB + GIB // 2, 2 * GIB, "RAM")


def test_the_verifier_sizes_its_cache_and_says_so(tiny_pair, caplog):
    """By default a tiny model's cache is what --max-batch requests of the longest allowed length
    use (memory is plenty); a byte budget is divided by what a token takes in every cache."""
    from services.verifier.config import VerifierConfig
    from services.verifier.server import kv_plan
    from specinfer.limits import RequestLimits
    from util import start_stack

    limits = RequestLimits(max_prompt_tokens=100, max_new_tokens=20)
    cfg = VerifierConfig(tiny_pair.llm, max_batch=3, limits=limits, max_tree_nodes=8, device="cpu")
    plan = kv_plan(cfg)
    assert plan.num_tokens == 3 * (100 + 20 + 8) and plan.bytes_per_token == 2 * 2 * 2 * 16 * 4
    co_located = kv_plan(VerifierConfig(tiny_pair.llm, co_located=(str(tiny_pair.ssms[0]), "lookup"),
                                        kv_budget=(0, 1 << 20), ssm_dtype="float32", device="cpu"))
    assert co_located.num_tokens == (1 << 20) // (2 * 512)
    with caplog.at_level(logging.INFO), start_stack(tiny_pair.llm, [], max_batch=3, limits=limits,
                                                    max_tree_nodes=8) as stack:
        assert stack.verifier_servicer.engine.verifier.runner.kv.num_slots == 384  # 3 * 128, whole blocks
    assert any(r.getMessage().startswith("LLM loaded") and "KV cache: 384 tokens" in r.getMessage()
               for r in caplog.records)


def test_up_and_bench_take_the_kv_flags_and_up_forwards_them(monkeypatch, tiny_pair, tmp_path):
    from specinfer.cli import launcher
    from specinfer.cli.launcher import StackConfig
    from specinfer.cli.main import main

    started = []

    def start(self):
        started.append(self.cfg)
        raise KeyboardInterrupt

    monkeypatch.setattr(Stack, "start", start)
    monkeypatch.setattr(launcher, "is_port_free", lambda host, port: True)
    base = ["up", "--llm", str(tiny_pair.llm), "--cache-dir", str(tmp_path)]
    assert main(base + ["--kv-budget", "8192", "--kv-memory-fraction", "0.5"]) == 0
    monkeypatch.setenv("SPECINFER_KV_BUDGET", "1GiB")
    assert main(base) == 0
    assert main(base + ["--kv-memory-fraction", "2"]) == 2
    assert [(c.kv_budget, c.kv_memory_fraction) for c in started] == [((8192, 0), 0.5), ((0, GIB), None)]
    spawned = []
    monkeypatch.setattr(Stack, "start", REAL_START)
    monkeypatch.setattr(Stack, "_spawn", lambda self, name, module, args, port, env: spawned.append((name, args)))
    for cfg in started + [StackConfig(llm=Path("/m"), ssms=())]:
        Stack(cfg).start()
    verifiers = [args for name, args in spawned if name == "verifier"]
    assert [a[a.index("--kv-budget") + 1] if "--kv-budget" in a else None for a in verifiers] == [
        "8192", f"{GIB}B", None]
    assert "--kv-memory-fraction" in verifiers[0] and "--kv-memory-fraction" not in verifiers[2]
