"""Start-up that talks and does not repeat work: the load-aware policy's cost model is calibrated
once per model and machine and cached (`engine.runtime.calibration`), measured robustly, and every
step of loading is told."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from specinfer.engine.runtime import calibration
from specinfer.cpu_load import CpuSnapshot
from specinfer.engine.runtime.runner import ModelRunner
from specinfer.engine.scheduling.policy import CostModel, is_busy


def constant_timer(calls: list | None = None, ms_per_token: float = 0.01, base_ms: float = 1.0):
    """A pass of n tokens takes base + n * per-token milliseconds, every time."""

    def timer(runner, work) -> float:
        if calls is not None:
            calls.append(len(work.token_ids))
        return (base_ms + ms_per_token * len(work.token_ids)) / 1000

    return timer


def failing_timer(runner, work) -> float:
    raise AssertionError("calibrated although this machine calibrated this model before")


@pytest.fixture(scope="module")
def llm_runner(tiny_pair):
    return ModelRunner.from_dir(tiny_pair.llm, max_kv_tokens=1024)


def test_the_calibration_is_cached_by_model_and_machine(llm_runner, tmp_path, monkeypatch):
    lines, calls = [], []
    first = calibration.calibrated_cost_model(llm_runner, tmp_path, lines.append, constant_timer(calls))
    assert calls and lines[0].startswith("calibrating the LLM cost model") and lines[1].startswith("calibrated in")
    assert first.points[0] == (1, pytest.approx(0.00101)) and not first.is_busy
    lines.clear()
    again = calibration.calibrated_cost_model(llm_runner, tmp_path, lines.append, failing_timer)
    assert again.points == first.points and lines[0].startswith("LLM cost model calibrated earlier on this machine")
    # Another thread count is another machine for the policy: measured on its own.
    monkeypatch.setattr(torch, "get_num_threads", lambda: 977)
    calls.clear()
    calibration.calibrated_cost_model(llm_runner, tmp_path, lines.append, constant_timer(calls))
    assert calls and len(json.loads((tmp_path / calibration.CACHE_FILE).read_text())) == 2


def test_the_key_holds_what_decides_the_costs(llm_runner, tiny_pair):
    key = calibration.calibration_key(llm_runner, "model name\t: Some CPU 9000\nflags\t: avx2\n")
    assert key["device"] == "cpu" and key["device_name"].startswith("Some CPU 9000")
    assert key["dtype"] == "float32" and key["threads"] == torch.get_num_threads()
    assert key["model"]["num_layers"] == llm_runner.cfg.num_layers and key["sizes"][0] == 1
    half = ModelRunner.from_dir(tiny_pair.llm, dtype="bfloat16", max_kv_tokens=1024)
    assert calibration.calibration_key(half)["dtype"] == "bfloat16"
    tight = ModelRunner.from_dir(tiny_pair.llm, max_kv_tokens=64)  # fewer sizes fit: another calibration
    assert calibration.calibration_key(tight)["sizes"] != key["sizes"]


def test_the_key_tells_weights_the_kernel_reads_in_16_bits_from_float32_ones(tiny_pair, monkeypatch):
    """The same architecture costs less a pass where its matrices are stored narrower (a bfloat16
    checkpoint, a GGUF's codes): another calibration."""
    from specinfer.engine.layers import cpu_gemm

    if not cpu_gemm.available():
        pytest.skip("the CPU kernel is not built here")
    as_stored = calibration.calibration_key(ModelRunner.from_dir(tiny_pair.llm, max_kv_tokens=1024))
    monkeypatch.setattr(cpu_gemm, "exact_storage", lambda w: torch.bfloat16)  # as if a bfloat16 checkpoint's
    narrow = calibration.calibration_key(ModelRunner.from_dir(tiny_pair.llm, max_kv_tokens=1024))
    assert narrow["weight_storage"] == ["torch.bfloat16"] and as_stored["weight_storage"] != narrow["weight_storage"]


def test_repeats_that_spread_are_measured_again_and_a_busy_result_is_not_cached(llm_runner, tmp_path):
    seen: dict = {}

    def busy(runner, work) -> float:  # of each size's warm-up and 5 repeats, all but the first repeat slowed 4x
        n = len(work.token_ids)
        seen[n] = seen.get(n, 0) + 1
        return (1.0 if seen[n] % (1 + calibration.REPEATS) == 2 else 4.0) * (1 + 0.01 * n) / 1000

    lines = []
    model = calibration.calibrated_cost_model(llm_runner, tmp_path, lines.append, busy)
    assert model.is_busy and "not cached" in lines[-1] and not (tmp_path / calibration.CACHE_FILE).exists()
    # every size was timed MAX_ATTEMPTS times over (a warm-up and REPEATS rounds each), keeping the fastest
    assert seen[1] == calibration.MAX_ATTEMPTS * (1 + calibration.REPEATS)
    assert model.points[0] == (1, pytest.approx(0.00101))
    calm = calibration.calibrated_cost_model(llm_runner, tmp_path, lines.append, constant_timer())
    assert not calm.is_busy and (tmp_path / calibration.CACHE_FILE).exists()


def test_a_calibration_begun_on_a_loaded_machine_is_used_but_not_cached(llm_runner, tmp_path, monkeypatch):
    """Steadily slow repeats do not spread: other work kept the CPUs busy."""
    from specinfer.engine.runtime import machine_cache

    monkeypatch.setattr(machine_cache, "is_loaded", lambda device="cpu", **kwargs: True)
    lines = []
    model = calibration.calibrated_cost_model(llm_runner, tmp_path, lines.append, constant_timer())
    assert model.is_busy and "not cached" in lines[-1] and not (tmp_path / calibration.CACHE_FILE).exists()


def test_a_calibration_during_which_other_work_started_is_used_but_not_cached(llm_runner, tmp_path, monkeypatch):
    """The load average lags a neighbour that starts with the measurement (the demo draft's build,
    spawned a moment before the stack calibrates): the CPU time others took meanwhile tells."""
    from specinfer.engine.runtime import machine_cache

    monkeypatch.setattr(machine_cache, "is_loaded", lambda device="cpu", since=None, **kwargs: since is not None)
    lines = []
    model = calibration.calibrated_cost_model(llm_runner, tmp_path, lines.append, constant_timer())
    assert model.is_busy and "not cached" in lines[-1] and not (tmp_path / calibration.CACHE_FILE).exists()


def test_a_load_average_left_high_by_work_that_ended_does_not_keep_a_quiet_calibration_uncached(
        llm_runner, tmp_path, monkeypatch):
    """The load average lags work that has just stopped (the demo draft's build, which waits while
    the stack starts): where other processes' CPU time is known, it alone decides."""
    from specinfer.engine.runtime import machine_cache

    if CpuSnapshot().busy_s is None:
        pytest.skip("no /proc/stat: the load average is all there is here")
    monkeypatch.setattr(machine_cache, "is_loaded", lambda device="cpu", since=None, **kwargs: since is None)
    lines = []
    model = calibration.calibrated_cost_model(llm_runner, tmp_path, lines.append, constant_timer())
    assert not model.is_busy and "not cached" not in lines[-1] and (tmp_path / calibration.CACHE_FILE).exists()


def test_other_processes_busy_during_a_measurement_make_the_machine_loaded(unloaded_machine):
    is_loaded = unloaded_machine
    start = CpuSnapshot()
    if start.busy_s is None:
        pytest.skip("no /proc/stat: other processes' CPU time is not known here")
    subprocess.run([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"],
                   check=True)  # one core kept busy by another process for most of the span
    assert start.other_cores() > 0.5 and is_loaded("cpu", since=start)
    assert not is_loaded("cuda", since=start)


def test_a_machine_is_loaded_when_its_load_average_exceeds_its_cpus(unloaded_machine):
    is_loaded = unloaded_machine  # the rule itself, which the other tests see as "never"
    assert is_loaded("cpu", load_average=8.6, num_cpus=2) and not is_loaded("cpu", load_average=1.2, num_cpus=2)
    assert not is_loaded("cuda", load_average=8.6, num_cpus=2)  # what a GPU pass costs is not the CPUs' load


def test_busy_means_repeats_spread_not_a_slow_machine():
    assert not is_busy({1: [0.5, 0.5, 0.51], 2: [0.9, 0.9, 0.9]})  # slow and steady
    assert is_busy({1: [0.1, 0.1, 0.3, 0.3, 0.3], 2: [0.2, 0.2, 0.2]})
    assert not is_busy({1: [0.1, 0.5]})  # two repeats tell nothing
    assert not is_busy({1: [0.1, 0.5, 0.1]})  # one slow repeat: the median is the fastest


def test_a_second_generate_speculates_without_calibrating_again(text_pair, tmp_path, capsys, monkeypatch):
    """The goal: the first `generate` on a machine calibrates (and says so on stderr), the second
    reads the calibration and starts speculating at once."""
    from specinfer.cli.main import main

    from specinfer.engine.scheduling import policy

    llm, ssm = text_pair
    from specinfer.engine.runtime import dtype_choice

    # a calm machine, whatever runs beside the tests (a busy one's measurements are not cached)
    monkeypatch.setattr(policy, "_time_pass", constant_timer())
    monkeypatch.setattr(dtype_choice, "time_pass", constant_timer())
    argv = ["generate", "--llm", str(llm), "--ssm", str(ssm), "--prompt", "def add(a, b):", "--max-new-tokens", "8",
            "--cache-dir", str(tmp_path), "--device", "cpu"]
    assert main(argv) == 0
    first = capsys.readouterr()
    assert "calibrating the LLM cost model" in first.err and "specinfer: loading the LLM" in first.err
    assert "KV cache:" in first.err and f"SSM {ssm.name}: measuring which dtype" in first.err

    def no_calibration(*args, **kwargs):
        raise AssertionError("calibrated again")

    monkeypatch.setattr(CostModel, "calibrate", no_calibration)
    longer = argv[:argv.index("--prompt") + 1] + ["import os\nimport sys\nfor x in range(3):"] + argv[
        argv.index("--prompt") + 2:]  # another prompt length: another KV size, the same calibration
    assert main(longer + ["--max-new-tokens", "20"]) == 0
    second = capsys.readouterr()
    assert "calibrated earlier on this machine" in second.err and "calibrating" not in second.err
    assert f"SSM {ssm.name}: dtype" in second.err and "measured earlier" in second.err
    assert json.loads(second.out)["mode"] == "auto"


def test_cache_keys_compare_as_json_reads_them_back(tmp_path):
    """A key holding a tuple (a config's per-layer types) is a list once read back: still a hit."""
    from specinfer.engine.runtime.machine_cache import read_entry, write_entry

    key = {"model": {"layer_types": ("full", "sliding")}, "threads": 2}
    assert write_entry(tmp_path, "m.json", key, {"value": 1})
    assert read_entry(tmp_path, "m.json", key)["value"] == 1
    assert read_entry(tmp_path, "m.json", {**key, "threads": 3}) is None
