"""Co-located speculation: the verifier hosts its pool (SSMs, lookup, suffix) in its own process.

Same code path and pool semantics as the in-process engine (`LocalSpeculation`); the outputs are
those of the speculator service, token for token, greedy and seeded sampling alike; and a
verifier started with no speculator still speculates with the model-free members.
"""

from __future__ import annotations

import pytest

from services.verifier.config import parse_config
from specinfer.engine.llm_engine import Engine, mode_params
from specinfer.engine.runtime.runner import ModelRunner
from specinfer.errors import UserError
from specinfer.v1 import specinfer_pb2 as pb
from util import start_stack

PROMPTS = [[9, 8, 7, 6, 5], [3, 1, 4, 1, 5, 9, 2, 6], [100, 101, 102]]


def generate(stack, prompt, sampling=None, shape=(2, 2, 1), ssm_names=()) -> tuple[list[int], pb.GenerationStats]:
    kwargs = dict(prompt_ids=prompt, max_new_tokens=40, speculate=True, ignore_eos=True,
                  shape=pb.TreeShape(widths=list(shape)), ssm_names=list(ssm_names))
    if sampling is not None:
        kwargs["sampling"] = sampling
    tokens, stats = [], None
    for r in stack.verifier_stub.Generate(pb.VerifierGenerateRequest(**kwargs), timeout=60):
        tokens += list(r.token_ids)
        if r.HasField("stats"):
            stats = r.stats
    return tokens, stats


@pytest.mark.parametrize("sampling", [None, pb.SamplingParams(temperature=0.8, seed=7)])
def test_co_located_ssms_give_the_speculator_services_outputs(tiny_pair, sampling):
    outputs = {}
    for where in ("service", "co-located"):
        if where == "service":
            stack = start_stack(tiny_pair.llm, [tiny_pair.ssms[0]])
        else:
            stack = start_stack(tiny_pair.llm, co_located=(str(tiny_pair.ssms[0]),))
        try:
            assert list(stack.verifier_stub.Info(pb.InfoRequest(), timeout=10).ssm_names) == [tiny_pair.ssms[0].name]
            runs = [generate(stack, p, sampling) for p in PROMPTS]
            outputs[where] = [tokens for tokens, _ in runs]
            assert all(stats.tokens_per_step > 1.2 for _, stats in runs)  # it really speculated
        finally:
            stack.stop()
    assert outputs["co-located"] == outputs["service"]
    if sampling is None:
        engine = Engine.from_runners(ModelRunner.from_dir(tiny_pair.llm))
        assert outputs["service"] == [engine.generate(p, mode_params("incremental", 40, is_ignore_eos=True)).output_ids
                                      for p in PROMPTS]


def test_a_verifier_alone_speculates_with_the_model_free_members(tiny_pair):
    cfg = parse_config(["--model", str(tiny_pair.llm)], env={})
    assert cfg.co_located == ("lookup", "suffix")
    stack = start_stack(tiny_pair.llm, co_located=cfg.co_located)
    try:
        first, _ = generate(stack, PROMPTS[0])
        again, stats = generate(stack, PROMPTS[0])  # the suffix cache now holds the first output
        assert again == first
        assert stats.tokens_per_step > 3
        lookup_only, _ = generate(stack, PROMPTS[0], ssm_names=("lookup",))
        assert lookup_only == first
        with pytest.raises(Exception, match="no SSM named"):
            generate(stack, PROMPTS[0], ssm_names=("ssm-9",))
    finally:
        stack.stop()
    engine = Engine.from_runners(ModelRunner.from_dir(tiny_pair.llm))
    assert first == engine.generate(PROMPTS[0], mode_params("incremental", 40, is_ignore_eos=True)).output_ids


def test_the_co_located_pool_flags():
    assert parse_config(["--model", "m", "--ssm", "none"], env={}).co_located == ()
    assert parse_config(["--model", "m", "--speculator", "h:1"], env={}).co_located == ()
    assert parse_config(["--model", "m", "--ssm", "d", "--ssm", "lookup"], env={}).co_located == ("d", "lookup")
    assert parse_config(["--model", "m"], env={"SPECINFER_VERIFIER_SSMS": "suffix"}).co_located == ("suffix",)
    with pytest.raises(UserError, match="choose one"):
        parse_config(["--model", "m", "--ssm", "d", "--speculator", "h:1"], env={})
    with pytest.raises(UserError, match="none excludes"):
        parse_config(["--model", "m", "--ssm", "none", "--ssm", "lookup"], env={})


def test_up_co_located_starts_no_speculator_and_hands_the_pool_to_the_verifier(monkeypatch, tmp_path):
    from specinfer.cli.launcher import Stack, StackConfig

    spawned = []
    monkeypatch.setattr(Stack, "_spawn", lambda self, name, module, args, port, env: spawned.append((name, args)))
    Stack(StackConfig(llm=tmp_path / "llm", ssms=(tmp_path / "ssm",), model_free=("lookup",), is_co_located=True,
                      ssm_dtype="bfloat16")).start()
    assert [name for name, _ in spawned] == ["verifier", "gateway"]
    args = dict(spawned)["verifier"]
    assert "--speculator" not in args
    assert [args[i + 1] for i, a in enumerate(args) if a == "--ssm"] == [str(tmp_path / "ssm"), "lookup"]
    assert args[args.index("--ssm-dtype") + 1] == "bfloat16"
    spawned.clear()
    Stack(StackConfig(llm=tmp_path / "llm", ssms=(tmp_path / "ssm",), model_free=("lookup",))).start()
    assert [name for name, _ in spawned] == ["speculator-0", "verifier", "gateway"]
    speculator = dict(spawned)["speculator-0"]
    assert [speculator[i + 1] for i, a in enumerate(speculator) if a == "--ssm"] == [str(tmp_path / "ssm"), "lookup"]


def test_co_located_ssms_run_on_the_llms_thread(tiny_pair):
    """Every SSM pass and every LLM pass of a co-located verifier runs on one thread (the model's),
    however many request threads ask for trees: no second OpenMP team spins against the first."""
    import threading

    stack = start_stack(tiny_pair.llm, co_located=(str(tiny_pair.ssms[0]),))
    try:
        engine = stack.verifier_servicer.engine
        threads: dict[str, set[int]] = {"llm": set(), "ssm": set()}
        for name, runner in (("llm", engine.verifier.runner), ("ssm", engine.source.speculator.runners[0])):
            def run(works, _run=runner.run, _name=name):
                threads[_name].add(threading.get_ident())
                return _run(works)
            runner.run = run
        request_threads = [threading.Thread(target=generate, args=(stack, p)) for p in PROMPTS]
        for t in request_threads:
            t.start()
        for t in request_threads:
            t.join()
        assert threads["ssm"] and threads["ssm"] == threads["llm"] and len(threads["llm"]) == 1, threads
    finally:
        stack.stop()
