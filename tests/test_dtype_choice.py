"""`--ssm-dtype auto`: the SSMs' dtype is the fastest measured on this machine, chosen once at
load time and cached, and it never changes the output.

Fake timers make the choice deterministic where a test needs a given winner; the real timer
runs where only the contract (a working dtype, the same output) matters.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specinfer.engine.runtime import dtype_choice as dc
from specinfer.engine.models.config import ModelConfig
from specinfer.engine.runtime.exec_config import ExecConfig
from specinfer.engine.llm_engine import Engine, mode_params
from specinfer.engine.runtime.assemble import load_engine
from specinfer.engine.runtime.load import ModelPaths
from specinfer.engine.models.checkpoint import engine_weights, load_state_dict
from specinfer.engine.runtime.runner import ModelRunner
from specinfer.params import TreeShape
from specinfer.engine.layers import cpu_gemm
from specinfer.errors import UserError
from specinfer.limits import Q8_DTYPE

NEW_TOKENS = 24
CPUINFO = "processor\t: 0\nmodel name\t: Some CPU 9000\nflags\t\t: fpu sse avx512f avx512_bf16\n"


def fake_timer(ms: dict[str, float], calls: list | None = None):
    """A pass takes `ms[dtype]` milliseconds, whatever it computes."""

    def timer(runner, work) -> float:
        if calls is not None:
            calls.append(dc.runner_dtype(runner))
        return ms[dc.runner_dtype(runner)] / 1000

    return timer


def failing_timer(runner, work) -> float:
    raise AssertionError("measured although the choice is cached")


ALL_CANDIDATES = dc.candidates


@pytest.fixture(autouse=True)
def dense_candidates(request, monkeypatch):
    """The tests of the choice itself pick between the dense dtypes; those named for q8_0 see every
    candidate this machine has."""
    if "q8_0" not in request.node.name:
        monkeypatch.setattr(dc, "candidates", lambda device: [d for d in ALL_CANDIDATES(device) if d != Q8_DTYPE])


@pytest.fixture(scope="module")
def ssm_weights(tiny_pair):
    cfg = ModelConfig.from_dir(tiny_pair.ssms[0])
    return cfg, engine_weights(cfg, load_state_dict(tiny_pair.ssms[0]))


@pytest.fixture(scope="module")
def incremental(pair_runners, greedy_prompts):
    llm, _ = pair_runners
    engine = Engine.from_runners(llm)
    return [engine.generate(p, mode_params("incremental", NEW_TOKENS)).output_ids for p in greedy_prompts[:8]]


# ---- it never changes the output -----------------------------------------------------------------
@pytest.mark.parametrize("winner", ["bfloat16", "float32"])
def test_auto_greedy_tree_equals_incremental_whichever_dtype_wins(pair_runners, tiny_pair, greedy_prompts,
                                                                 incremental, tmp_path, winner):
    llm, _ = pair_runners
    loser = "float32" if winner == "bfloat16" else "bfloat16"
    ssm = dc.load_ssm(tiny_pair.ssms[0], "auto", "cpu", 4096, cache_dir=tmp_path,
                      timer=fake_timer({winner: 1.0, loser: 2.0}))
    torch_dtype = getattr(torch, winner)
    assert ssm.dtype_choice.dtype == winner and ssm.model.dtype == torch_dtype
    assert ssm.kv.k.dtype == ssm.kv.v.dtype == torch_dtype  # the KV cache is in the chosen dtype too
    engine = Engine.from_runners(llm, [ssm])
    params = mode_params("tree", NEW_TOKENS, TreeShape((2, 2, 1, 1)))
    accepted = 0
    for prompt, expected in zip(greedy_prompts, incremental):
        r = engine.generate(prompt, params)
        assert r.output_ids == expected
        accepted += sum(r.accepted_per_step)
    assert accepted > 0  # the SSM's drafts were used, not just ignored


def test_load_engine_with_auto_measures_for_real_and_equals_incremental(tiny_pair, greedy_prompts, incremental,
                                                                        tmp_path):
    lines = []
    engine = load_engine(ModelPaths(tiny_pair.llm, tiny_pair.ssms[:1]), "float32", "cpu", 4096, ssm_dtype="auto",
                         cache_dir=tmp_path, report=lines.append)
    (ssm,) = engine.source.speculator.runners
    choice = ssm.dtype_choice
    assert choice is not None and set(choice.ms_per_pass) == set(dc.candidates("cpu"))
    assert choice.dtype in choice.ms_per_pass and all(ms > 0 for ms in choice.ms_per_pass.values())
    assert ssm.model.dtype == ssm.kv.k.dtype == getattr(torch, choice.dtype)
    name = tiny_pair.ssms[0].name
    assert [line for line in lines if line.startswith(f"SSM {name}")] == [
        f"SSM {name}: measuring which dtype runs it fastest here ({', '.join(dc.candidates('cpu'))})",
        f"SSM {name}: {choice.describe()}"]
    params = mode_params("tree", NEW_TOKENS, TreeShape((1, 1, 3, 1)))
    assert [engine.generate(p, params).output_ids for p in greedy_prompts[:8]] == incremental


def test_an_explicit_dtype_is_used_as_given_and_measures_nothing(tiny_pair):
    ssm = dc.load_ssm(tiny_pair.ssms[0], "bfloat16", "cpu", 1024, timer=failing_timer)
    assert ssm.model.dtype == ssm.kv.k.dtype == torch.bfloat16 and ssm.dtype_choice is None
    with pytest.raises(Exception, match="unsupported dtype"):
        dc.load_ssm(tiny_pair.ssms[0], "int8", "cpu", 1024)


# ---- the choice --------------------------------------------------------------------------------
def test_the_faster_candidate_is_picked(ssm_weights):
    cfg, weights = ssm_weights
    assert dc.candidates("cpu")[0] == "float32" and "bfloat16" in dc.candidates("cpu")
    calls = []
    choice = dc.choose_dtype(cfg, weights, "cpu", ExecConfig(attention="sdpa"),
                             timer=fake_timer({"float32": 1.2, "bfloat16": 0.6}, calls))
    assert choice.dtype == "bfloat16" and not choice.is_cached
    assert choice.ms_per_pass == {"float32": 1.2, "bfloat16": 0.6}
    # Both candidates, every trial size, interleaved: a warm-up round, then timed rounds until
    # TRIAL_MIN_S of (here fake) time was measured: 0.2 s / 5.4 ms per round -> 38 timed rounds.
    sizes, _ = dc.trial_shapes(cfg)
    assert sorted(calls) == sorted(["float32", "bfloat16"] * len(sizes) * (1 + 38))
    firsts = [calls[i * len(sizes)] for i in range(4)]  # who leads each half-round: the order rotates
    assert firsts == ["float32", "bfloat16", "bfloat16", "float32"]
    slower_bf16 = dc.choose_dtype(cfg, weights, "cpu", ExecConfig(attention="sdpa"),
                                  timer=fake_timer({"float32": 0.6, "bfloat16": 1.2}))
    assert slower_bf16.dtype == "float32"


def test_the_warm_up_is_not_counted_and_the_fastest_repeat_is(ssm_weights):
    cfg, weights = ssm_weights
    # Three sizes: a slow warm-up round, then each size hit by one busy moment in some round.
    passes = iter([100.0, 100.0, 100.0, 50.0, 1.0, 1.0, 1.0, 50.0, 1.0, 1.0, 1.0, 50.0])
    ms, busy = dc.measure(lambda dtype: ModelRunner.from_weights(cfg, weights, dtype, "cpu", max_kv_tokens=256),
                          ["float32"], cfg, lambda runner, work: next(passes) / 1000, repeats=3, min_seconds=0)
    assert not busy  # one slow repeat per size: the median is the fastest
    assert dc.trial_shapes(cfg)[0] == [1, 4, 8] and ms == {"float32": pytest.approx(1.0)}


@pytest.mark.parametrize("ms_per_pass, timed_rounds", [(50.0, dc.TRIAL_REPEATS), (0.001, dc.TRIAL_MAX_REPEATS),
                                                       (400.0, 1)])  # 1.2 s in the first timed round
def test_rounds_go_on_until_enough_time_was_measured_within_bounds(ssm_weights, ms_per_pass, timed_rounds):
    cfg, weights = ssm_weights
    calls = []
    dc.measure(lambda dtype: ModelRunner.from_weights(cfg, weights, dtype, "cpu", max_kv_tokens=256),
               ["float32"], cfg, fake_timer({"float32": ms_per_pass}, calls))
    assert len(calls) == len(dc.trial_shapes(cfg)[0]) * (1 + timed_rounds)


def test_ties_go_to_the_preferred_dtype():
    assert dc.pick({"float32": 1.00, "bfloat16": 0.97}, prefer="float32") == "float32"  # within 5%
    assert dc.pick({"float32": 1.00, "bfloat16": 0.80}, prefer="float32") == "bfloat16"
    assert dc.pick({"float32": 0.80, "bfloat16": 0.78}, prefer="bfloat16") == "bfloat16"
    assert dc.pick({"float32": 1.00, "bfloat16": 0.80}, prefer="float16") == "bfloat16"  # not a candidate


def test_a_candidate_that_fails_or_computes_non_finite_logits_is_dropped(ssm_weights):
    cfg, weights = ssm_weights
    nan_weights = {name: torch.full_like(t, float("nan")) for name, t in weights.items()}

    def make_runner(dtype):
        if dtype == "float16":
            raise RuntimeError("not implemented for 'Half'")
        return ModelRunner.from_weights(cfg, nan_weights if dtype == "bfloat16" else weights, dtype, "cpu",
                                        max_kv_tokens=256)

    ms, _ = dc.measure(make_runner, ["float32", "bfloat16", "float16"], cfg, fake_timer({"float32": 1.0}))
    assert list(ms) == ["float32"]


def test_trial_shapes_stay_within_a_small_models_context(tmp_path):
    from util import save_tiny_llama

    small = ModelConfig.from_dir(save_tiny_llama(tmp_path / "m", max_pos=10))
    sizes, context = dc.trial_shapes(small)
    assert sizes == [1, 4, 8] and context + max(sizes) <= 10
    weights = engine_weights(small, load_state_dict(tmp_path / "m"))
    choice = dc.choose_dtype(small, weights, "cpu", ExecConfig(attention="sdpa"))
    assert choice.dtype in dc.candidates("cpu")


# ---- the cache ---------------------------------------------------------------------------------
def test_a_second_load_reads_the_cache_and_measures_nothing(tiny_pair, tmp_path):
    calls = []
    first = dc.load_ssm(tiny_pair.ssms[0], "auto", "cpu", 1024, cache_dir=tmp_path,
                        timer=fake_timer({"float32": 1.2, "bfloat16": 0.6}, calls))
    assert calls and first.dtype_choice.dtype == "bfloat16" and not first.dtype_choice.is_cached
    entries = json.loads((tmp_path / dc.CACHE_FILE).read_text())
    (entry,) = entries.values()
    assert entry["dtype"] == "bfloat16" and entry["key"]["model"]["hidden_size"] == 64
    lines = []
    second = dc.load_ssm(tiny_pair.ssms[0], "auto", "cpu", 1024, cache_dir=tmp_path, timer=failing_timer,
                         report=lines.append)
    assert second.dtype_choice == dc.DtypeChoice("bfloat16", {"float32": 1.2, "bfloat16": 0.6}, is_cached=True)
    assert second.model.dtype == second.kv.k.dtype == torch.bfloat16
    assert lines == [f"SSM {tiny_pair.ssms[0].name}: dtype bfloat16 (measured earlier: bf16 0.60 ms, "
                     "fp32 1.20 ms per pass)"]
    # Another architecture is another entry, measured on its own.
    from util import save_tiny_llama

    other_dir = save_tiny_llama(tmp_path / "models" / "other", vocab=128, hidden=32)
    other = dc.load_ssm(other_dir, "auto", "cpu", 1024, cache_dir=tmp_path,
                        timer=fake_timer({"float32": 0.5, "bfloat16": 0.6}))
    assert other.dtype_choice.dtype == "float32" and not other.dtype_choice.is_cached
    assert len(json.loads((tmp_path / dc.CACHE_FILE).read_text())) == 2


def test_a_cached_choice_loads_the_ssm_a_weight_at_a_time(tiny_pair, tmp_path, monkeypatch):
    """With its dtype cached, an SSM loads as any model does (`ModelRunner.from_dir`, a weight
    at a time), not through a whole state dict, and computes what the measured load's runner
    computes."""
    from specinfer.engine.runtime.runner import chain_work

    def logits(runner):
        seq = runner.new_sequence()
        return runner.run([chain_work(seq, [3, 7, 11, 19], logits="all")])[0]

    first = dc.load_ssm(tiny_pair.ssms[0], "auto", "cpu", 256, cache_dir=tmp_path,
                        timer=fake_timer({"float32": 1.2, "bfloat16": 0.6}))

    def no_state_dict(*args, **kwargs):
        raise AssertionError("a whole state dict was read")

    monkeypatch.setattr(dc, "load_state_dict", no_state_dict)
    second = dc.load_ssm(tiny_pair.ssms[0], "auto", "cpu", 256, cache_dir=tmp_path, timer=failing_timer)
    assert second.dtype_choice.is_cached and second.model.dtype == torch.bfloat16
    assert torch.equal(logits(second), logits(first))
    with pytest.raises(AssertionError, match="state dict"):  # a miss still measures over one state dict
        dc.load_ssm(tiny_pair.ssms[0], "auto", "cpu", 256, cache_dir=tmp_path / "empty",
                    timer=fake_timer({"float32": 1.2, "bfloat16": 0.6}))


def test_a_miss_reads_the_dtype_cache_once(tiny_pair, tmp_path, monkeypatch):
    """An SSM whose dtype is not cached looks it up once, then measures: the lookup is not
    repeated on the way to the measurement."""
    reads = []
    real_read = dc.read_cached
    monkeypatch.setattr(dc, "read_cached", lambda *a, **k: reads.append(1) or real_read(*a, **k))
    runner = dc.load_ssm(tiny_pair.ssms[0], "auto", "cpu", 256, cache_dir=tmp_path,
                         timer=fake_timer({"float32": 1.2, "bfloat16": 0.6}))
    assert not runner.dtype_choice.is_cached and len(reads) == 1


def test_a_busy_machine_is_measured_again_and_its_choice_not_cached(ssm_weights, tmp_path, monkeypatch):
    """Repeats that spread (three of every four passes of each size slowed 3x) are timed again, up to
    MAX_ATTEMPTS times, keeping the fastest; a machine that stays busy gets its choice used but not
    cached, and a calm later measurement is cached."""
    cfg, weights = ssm_weights
    seen: dict = {}

    def busy_timer(runner, work):
        cell = (runner.model.dtype, len(work.token_ids))
        seen[cell] = seen.get(cell, 0) + 1
        return (1.0 if seen[cell] % 4 == 2 else 3.0) / 1000 * (0.5 if runner.model.dtype == torch.bfloat16 else 1.0)

    attempts = []
    real_rounds = dc._timed_rounds
    monkeypatch.setattr(dc, "_timed_rounds", lambda *a, **k: attempts.append(1) or real_rounds(*a, **k))
    lines = []
    choice = dc.choose_dtype(cfg, weights, "cpu", ExecConfig(attention="sdpa"), cache_dir=tmp_path, timer=busy_timer,
                             report=lines.append)
    assert len(attempts) == dc.MAX_ATTEMPTS and choice.is_busy
    assert choice.dtype == "bfloat16" and choice.ms_per_pass == {"float32": 1.0, "bfloat16": 0.5}  # the fastest
    assert not (tmp_path / dc.CACHE_FILE).exists() and "not cached" in choice.describe()
    assert lines == ["measuring which dtype runs it fastest here (float32, bfloat16)"]
    attempts.clear()
    calm = dc.choose_dtype(cfg, weights, "cpu", ExecConfig(attention="sdpa"), cache_dir=tmp_path,
                           timer=fake_timer({"float32": 1.2, "bfloat16": 0.6}))
    assert len(attempts) == 1 and not calm.is_busy and (tmp_path / dc.CACHE_FILE).exists()


def test_the_cache_is_keyed_by_the_ssms_content_not_its_place(tiny_pair, tmp_path):
    """A boost-tuned SSM written where its cut was (same architecture, same path) is measured on
    its own; the same weights under another path are the same SSM. Hashes are remembered."""
    import shutil

    from specinfer.engine.runtime.machine_cache import DIGESTS_FILE, weights_digest

    place = tmp_path / "models" / "ssm"
    shutil.copytree(tiny_pair.ssms[0], place)
    cache = tmp_path / "cache"
    first = dc.load_ssm(place, "auto", "cpu", 64, cache_dir=cache, timer=fake_timer({"float32": 1.2, "bfloat16": 0.6}))
    assert not first.dtype_choice.is_cached
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(place, elsewhere)
    assert weights_digest(elsewhere) == weights_digest(place, cache)
    assert dc.load_ssm(elsewhere, "auto", "cpu", 64, cache_dir=cache, timer=failing_timer).dtype_choice.is_cached
    shutil.rmtree(place)
    shutil.copytree(tiny_pair.ssms[1], place)  # "tuned": other weights, the same architecture and place
    tuned = dc.load_ssm(place, "auto", "cpu", 64, cache_dir=cache, timer=fake_timer({"float32": 0.5, "bfloat16": 0.6}))
    assert tuned.dtype_choice.dtype == "float32" and not tuned.dtype_choice.is_cached
    digests = json.loads((cache / DIGESTS_FILE).read_text())
    assert len(digests) == 3  # one per file version hashed: the cut, its copy, the tuned one


def test_the_cache_key_holds_what_decides_the_choice(ssm_weights):
    cfg, _ = ssm_weights
    cands = ["float32", "bfloat16"]
    key = dc.cache_key(cfg, "cpu", "sdpa", "float32", cands, CPUINFO)
    assert key["device"] == "cpu" and key["device_name"].startswith("Some CPU 9000 (flags ")
    assert key["torch"] == torch.__version__ and key["threads"] == torch.get_num_threads()
    assert key["model"]["num_layers"] == cfg.num_layers and key["model"]["vocab_size"] == cfg.vocab_size
    assert dc.key_id(key) == dc.key_id(dc.cache_key(cfg, "cpu", "sdpa", "float32", cands, CPUINFO))
    from dataclasses import replace

    no_bf16 = CPUINFO.replace(" avx512_bf16", "")
    variants = [
        dc.cache_key(replace(cfg, hidden_size=cfg.hidden_size * 2), "cpu", "sdpa", "float32", cands, CPUINFO),
        dc.cache_key(replace(cfg, num_layers=cfg.num_layers + 1), "cpu", "sdpa", "float32", cands, CPUINFO),
        dc.cache_key(cfg, "cpu", "sdpa", "float32", cands, no_bf16),  # same model name, other instructions
        dc.cache_key(cfg, "cpu", "sdpa", "bfloat16", cands, CPUINFO),  # another LLM dtype to prefer
        dc.cache_key(cfg, "cpu", "triton", "float32", cands, CPUINFO),
        dc.cache_key(cfg, "cpu", "sdpa", "float32", ["float32"], CPUINFO),
        {**key, "torch": "0.0.1"},
        {**key, "threads": key["threads"] + 1},
        {**key, "cpu_matmul": "onednn" if key["cpu_matmul"] != "onednn" else "panels-avx2"},
    ]
    assert len({dc.key_id(key)} | {dc.key_id(v) for v in variants}) == len(variants) + 1
    # Fields that do not change a pass's speed do not split the cache.
    assert dc.key_id(dc.cache_key(replace(cfg, eos_token_ids=(5,)), "cpu", "sdpa", "float32", cands,
                                  CPUINFO)) == dc.key_id(key)


def test_an_unwritable_cache_dir_does_not_fail_the_load(tiny_pair, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    for cache_dir in (blocker, blocker / "below"):
        calls = []
        ssm = dc.load_ssm(tiny_pair.ssms[0], "auto", "cpu", 1024, cache_dir=cache_dir,
                          timer=fake_timer({"float32": 1.2, "bfloat16": 0.6}, calls))
        assert ssm.dtype_choice.dtype == "bfloat16" and calls  # measured, not cached
    assert not dc.write_cached(blocker, {"candidates": []}, dc.DtypeChoice("float32", {}))
    assert blocker.read_text() == "a file where the cache directory should be"
    assert list(tmp_path.iterdir()) == [blocker]  # no temporary file left behind


def test_a_corrupt_or_foreign_cache_entry_is_measured_again(ssm_weights, tmp_path):
    cfg, weights = ssm_weights
    (tmp_path / dc.CACHE_FILE).write_text("{not json")
    calls = []
    choice = dc.choose_dtype(cfg, weights, "cpu", ExecConfig(attention="sdpa"), cache_dir=tmp_path,
                             timer=fake_timer({"float32": 1.2, "bfloat16": 0.6}, calls))
    assert calls and choice.dtype == "bfloat16"
    entries = json.loads((tmp_path / dc.CACHE_FILE).read_text())  # rewritten whole
    (kid,) = entries
    entries[kid]["dtype"] = "float64"  # not a candidate: ignored
    (tmp_path / dc.CACHE_FILE).write_text(json.dumps(entries))
    calls.clear()
    again = dc.choose_dtype(cfg, weights, "cpu", ExecConfig(attention="sdpa"), cache_dir=tmp_path,
                            timer=fake_timer({"float32": 1.2, "bfloat16": 0.6}, calls))
    assert calls and again.dtype == "bfloat16" and not again.is_cached


def test_without_a_cache_dir_every_load_measures(ssm_weights):
    cfg, weights = ssm_weights
    for _ in range(2):
        calls = []
        dc.choose_dtype(cfg, weights, "cpu", ExecConfig(attention="sdpa"), cache_dir=None,
                        timer=fake_timer({"float32": 1.2, "bfloat16": 0.6}, calls))
        assert calls


def test_device_name_is_the_cpu_model_and_its_flags():
    name = dc.device_name("cpu", CPUINFO)
    assert name.startswith("Some CPU 9000") and name != dc.device_name("cpu", CPUINFO.replace("avx512f ", ""))
    assert dc.device_name("cpu", "") != ""  # no /proc/cpuinfo: still a name


def test_describe_lists_the_fastest_first():
    choice = dc.DtypeChoice("bfloat16", {"float32": 1.2, "bfloat16": 0.61})
    assert choice.describe() == "dtype bfloat16 (measured: bf16 0.61 ms, fp32 1.20 ms per pass)"
    assert choice.to_json() == {"dtype": "bfloat16", "ms_per_pass": {"float32": 1.2, "bfloat16": 0.61},
                                "cached": False}


# ---- every entry point defaults to auto; a bad value is a clear error ------------------------------
def test_every_entry_point_defaults_to_auto(monkeypatch, tmp_path):
    from services.speculator.config import SpeculatorConfig, parse_config as speculator_config
    from services.verifier.config import VerifierConfig, parse_config as verifier_config
    from specinfer.cli.launcher import Stack, StackConfig
    from specinfer.cli.main import build_parser
    from specinfer.limits import DEFAULT_SSM_DTYPE

    assert DEFAULT_SSM_DTYPE == "auto"
    parser = build_parser()
    for argv in (["generate", "--prompt", "x"], ["bench"], ["bench", "--concurrency", "1"], ["up"]):
        assert parser.parse_args(argv).ssm_dtype == "auto", argv
    assert VerifierConfig(Path("m")).ssm_dtype == SpeculatorConfig((Path("s"),)).dtype == StackConfig(
        Path("l"), ()).ssm_dtype == "auto"
    env = {"SPECINFER_CACHE_DIR": str(tmp_path)}
    v, s = verifier_config(["--model", "m"], env), speculator_config(["--ssm", "s"], env)
    assert v.ssm_dtype == s.dtype == "auto" and v.cache_dir == s.cache_dir == tmp_path
    # The LLM's dtype variable is not the SSMs': it leaves the speculator on auto.
    assert speculator_config(["--ssm", "s"], {"SPECINFER_DTYPE": "float32"}).dtype == "auto"
    pinned = {"SPECINFER_SSM_DTYPE": "bfloat16"}
    assert verifier_config(["--model", "m"], pinned).ssm_dtype == speculator_config(["--ssm", "s"], pinned).dtype
    assert speculator_config(["--ssm", "s"], pinned).dtype == "bfloat16"

    spawned = []
    monkeypatch.setattr(Stack, "_spawn", lambda self, name, module, args, port, env: spawned.append((name, args, env)))
    Stack(StackConfig(llm=tmp_path / "llm", ssms=(tmp_path / "ssm",), cache_dir=tmp_path / "c")).start()
    children = {name: (args, env) for name, args, env in spawned}
    speculator_args, speculator_env = children["speculator-0"]
    assert speculator_args[speculator_args.index("--dtype") + 1] == "auto"
    assert speculator_env["SPECINFER_CACHE_DIR"] == str(tmp_path / "c")
    spawned.clear()
    Stack(StackConfig(llm=tmp_path / "llm", ssms=(tmp_path / "ssm",), is_co_located=True)).start()
    verifier_args = dict((name, args) for name, args, _ in spawned)["verifier"]
    assert verifier_args[verifier_args.index("--ssm-dtype") + 1] == "auto"


@pytest.mark.parametrize("argv", [["generate", "--prompt", "x", "--ssm-dtype", "int8"],
                                  ["bench", "--ssm-dtype", "int8"],
                                  ["up", "--ssm-dtype", "fp32"]])
def test_an_unknown_ssm_dtype_exits_2_on_one_line(capsys, argv):
    from specinfer.cli.main import main

    assert main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and "--ssm-dtype" in lines[0] and "choose one of auto" in lines[0]


def test_an_unknown_ssm_dtype_in_a_services_environment_names_the_variable():
    from services.speculator.config import parse_config as speculator_config
    from services.verifier.config import parse_config as verifier_config
    from specinfer.errors import UserError

    with pytest.raises(UserError, match="SPECINFER_SSM_DTYPE='int8'"):
        verifier_config(["--model", "m"], {"SPECINFER_SSM_DTYPE": "int8"})
    with pytest.raises(UserError, match="SPECINFER_SSM_DTYPE='int8'"):
        speculator_config(["--ssm", "s"], {"SPECINFER_SSM_DTYPE": "int8"})


@pytest.fixture
def calm_machine(monkeypatch):
    """Passes timed alike every time: what a real measurement on a busy machine would not be
    (and would then not be cached)."""
    monkeypatch.setattr(dc, "time_pass", fake_timer({"float32": 1.2, "bfloat16": 0.6, "float16": 2.0}))


def test_the_co_located_pool_measures_and_prefers_the_llms_dtype(pair_runners, tiny_pair, tmp_path, calm_machine):
    from services.verifier.speculators import co_located_pool

    llm, _ = pair_runners
    pool = co_located_pool((str(tiny_pair.ssms[0]), "lookup"), llm, "auto", "cpu", prefer="float32",
                           cache_dir=tmp_path)
    (ssm,) = pool.speculator.runners
    assert ssm.dtype_choice is not None and ssm.model.dtype == getattr(torch, ssm.dtype_choice.dtype)
    (entry,) = json.loads((tmp_path / dc.CACHE_FILE).read_text()).values()
    assert entry["key"]["prefer"] == "float32" and entry["dtype"] == ssm.dtype_choice.dtype


def test_bench_reports_the_resolved_ssm_dtype(text_pair, tmp_path, capsys, calm_machine):
    from specinfer.cli.main import main

    llm, ssm = text_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    code = main(["bench", "--llm", str(llm), "--ssm", str(ssm), "--prompts", str(prompts), "--max-new-tokens", "6",
                 "--no-transformers", "--device", "cpu", "--tree-width", "2,1", "--cache-dir", str(tmp_path / "c")])
    out, err = capsys.readouterr()
    assert code == 0, err
    config = json.loads(out)["config"]
    choice = config["ssm_dtype_choice"][ssm.name]
    assert config["ssm_dtype"] == choice["dtype"] in ("float32", "bfloat16")
    assert set(choice["ms_per_pass"]) == set(dc.candidates("cpu"))
    assert f"specinfer: SSM {ssm.name}: dtype {choice['dtype']} (measured" in err
    assert (tmp_path / "c" / dc.CACHE_FILE).is_file()
    pinned = main(["bench", "--llm", str(llm), "--ssm", str(ssm), "--prompts", str(prompts), "--max-new-tokens", "6",
                   "--no-transformers", "--device", "cpu", "--tree-width", "2,1", "--ssm-dtype", "float32"])
    out, _ = capsys.readouterr()
    assert pinned == 0 and json.loads(out)["config"]["ssm_dtype"] == "float32"
    assert json.loads(out)["config"]["ssm_dtype_choice"] is None


# ---- deployments -------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]


def test_compose_and_kubernetes_run_the_ssms_on_auto():
    import yaml

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    speculator_env = compose["services"]["speculator"]["environment"]
    assert "SPECINFER_DTYPE" not in speculator_env  # the LLM's dtype does not pin the SSMs'
    common = compose["x-common-env"]
    assert common["SPECINFER_SSM_DTYPE"] == "${SPECINFER_SSM_DTYPE:-auto}"
    configmap = yaml.safe_load((ROOT / "docker/k8s/configmap.yaml").read_text())
    assert configmap["data"]["SPECINFER_SSM_DTYPE"] == "auto"
    assert "# SPECINFER_SSM_DTYPE=auto" in (ROOT / ".env.example").read_text()



# ---- q8_0: float32 arithmetic over 8-bit block codes ----------------------------------------------
def test_q8_0_rounds_each_block_to_its_own_scale():
    torch.manual_seed(0)
    weight = torch.randn(40, 96) * torch.logspace(-3, 1, 96)  # blocks of very different magnitudes
    codes = cpu_gemm.BlockCodes.q8_0(weight)
    assert codes.codes.dtype == torch.int8 and codes.scales.shape == (40, 3) and not codes.offsets.any()
    values = codes.values()
    step = codes.scales.repeat_interleave(32, dim=1)
    assert bool(((values - weight).abs() <= step / 2 * (1 + 1e-6)).all())  # within half a step of its block
    assert torch.equal(codes.codes.abs().view(40, 3, 32).amax(-1), torch.full((40, 3), 127, dtype=torch.int8))
    assert cpu_gemm.BlockCodes.q8_0(torch.randn(4, 40)) is None  # inputs that do not split into blocks of 32
    zero = cpu_gemm.BlockCodes.q8_0(torch.zeros(2, 32))
    assert torch.equal(zero.values(), torch.zeros(2, 32))


def test_q8_0_is_a_candidate_where_the_kernel_runs(tmp_path):
    assert (Q8_DTYPE in dc.candidates("cpu")) == cpu_gemm.available()
    with pytest.raises(UserError, match="runs on the CPU only"):
        ModelRunner.from_weights(*_tiny_weights(tmp_path / "m"), dtype=Q8_DTYPE, device="cuda")


def _tiny_weights(path: Path):
    from util import save_tiny_llama

    save_tiny_llama(path, hidden=64, layers=1)
    cfg = ModelConfig.from_dir(path)
    return cfg, engine_weights(cfg, load_state_dict(path))


@pytest.mark.skipif(not cpu_gemm.available(), reason="the CPU matrix kernel is not built here")
def test_q8_0_auto_greedy_tree_equals_incremental_when_it_wins(pair_runners, tiny_pair, greedy_prompts, incremental,
                                                               tmp_path):
    llm, _ = pair_runners
    cands = dc.candidates("cpu")
    ssm = dc.load_ssm(tiny_pair.ssms[0], "auto", "cpu", 4096, cache_dir=tmp_path,
                      timer=fake_timer({d: 0.5 if d == Q8_DTYPE else 1.0 for d in cands}))
    assert ssm.dtype_choice.dtype == Q8_DTYPE and dc.runner_dtype(ssm) == Q8_DTYPE
    assert ssm.model.dtype == ssm.kv.k.dtype == torch.float32
    matrices = [t for name, t in ssm.model.w.items() if name.endswith((".qkv", ".down", "lm_head"))]
    assert matrices and all(isinstance(t.data, cpu_gemm.CodePanels) for t in matrices)
    dense = ModelRunner.from_dir(tiny_pair.ssms[0], "float32", "cpu", 1024)
    seq, dense_seq = ssm.new_sequence(), dense.new_sequence()
    coded_logits, dense_logits = ssm.prefill(seq, list(range(3, 40))), dense.prefill(dense_seq, list(range(3, 40)))
    assert not torch.equal(coded_logits, dense_logits)  # the draft really computes over the rounded weights
    assert torch.allclose(coded_logits, dense_logits, atol=0.05 * float(dense_logits.abs().max()))
    engine = Engine.from_runners(llm, [ssm])
    params = mode_params("tree", NEW_TOKENS, TreeShape((2, 2, 1, 1)))
    assert [engine.generate(p, params).output_ids for p in greedy_prompts[:8]] == incremental


def test_the_trial_runners_hold_a_slice_of_the_embedding_and_the_chosen_one_all_of_it(tiny_pair, tmp_path,
                                                                                      monkeypatch):
    """Each dtype's trial runner holds only the token embedding's first `TRIAL_EMBED_ROWS` rows
    (a lookup costs the same in any table), not a whole copy in its dtype, and its trial tokens lie
    below them; the LM head stays whole. The runner loaded for the chosen dtype holds every row
    and computes what a plain load of that dtype computes, tied head or not."""
    from specinfer.engine.runtime.runner import ModelRunner, chain_work

    monkeypatch.setattr(dc, "TRIAL_EMBED_ROWS", 48)
    cfg = ModelConfig.from_dir(tiny_pair.ssms[0])
    assert cfg.vocab_size > 48
    built = []
    real = ModelRunner.from_weights

    def recording(cfg, weights, dtype, *args, **kwargs):
        built.append((dtype, weights["embed"].shape[0], weights["lm_head"].shape[0]))
        return real(cfg, weights, dtype, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "from_weights", staticmethod(recording))
    runner = dc.load_ssm(tiny_pair.ssms[0], "auto", "cpu", 256, cache_dir=tmp_path,
                         timer=fake_timer({"float32": 1.2, "bfloat16": 0.6}))
    *trials, chosen = built
    assert {d for d, _, _ in trials} == {"float32", "bfloat16"} and chosen[0] == "bfloat16"
    assert all(rows == 48 and head == cfg.vocab_size for _, rows, head in trials)
    assert chosen[1:] == (cfg.vocab_size, cfg.vocab_size)
    ids = [cfg.vocab_size - 1, 3, cfg.vocab_size - 7, 60]  # rows past the trial's slice
    plain = real(cfg, engine_weights(cfg, load_state_dict(tiny_pair.ssms[0])), "bfloat16", "cpu", 256)
    logits = [r.run([chain_work(r.new_sequence(), ids, logits="all")])[0] for r in (runner, plain)]
    assert torch.equal(*logits)
