"""The `specinfer` CLI contract: JSONL output, and one-line exit-code-2 errors for bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from pathlib import Path

from specinfer.cli.main import main
from util import save_text_pair, save_tiny_llama, set_config

CORPUS = ["def add(a, b):\n    return a + b\n", "class Foo:\n    pass\n", "for i in range(10):\n    print(i)\n"] * 20
VOCAB = 300


@pytest.fixture(scope="module")
def cli_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    llm, ssm = save_text_pair(root, VOCAB, CORPUS, hidden=32, max_pos=128, seed=4, ssm_seed=5, noise=0.05)
    other = save_tiny_llama(root / "other_vocab", vocab=VOCAB + 8, hidden=32, layers=1, max_pos=128, seed=6)
    gpt2 = root / "gpt2"
    shutil.copytree(llm, gpt2)
    set_config(gpt2, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    return {"llm": llm, "ssm": ssm, "other": other, "gpt2": gpt2, "root": root}


def run_cli(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_writes_jsonl(cli_models, capsys):
    m = cli_models
    code, out, err = run_cli(["generate", "--llm", str(m["llm"]), "--ssm", str(m["ssm"]), "--prompt", "def add(",
                              "--max-new-tokens", "12", "--tree-width", "2,1,1", "--device", "cpu"], capsys)
    assert code == 0, err
    (record,) = [json.loads(line) for line in out.splitlines()]
    for key in ("prompt", "text", "output_token_ids", "num_llm_steps", "tokens_per_step", "latency_s"):
        assert key in record
    assert record["prompt"] == "def add(" and len(record["output_token_ids"]) == 12
    assert record["tokens_per_step"] == pytest.approx(12 / record["num_llm_steps"], rel=1e-3)


def test_generate_prompts_file_in_order_and_modes_agree(cli_models, capsys, tmp_path):
    m = cli_models
    prompts = tmp_path / "p.jsonl"
    texts = ["class Foo", "for i in", "def add(a"]
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    outputs = {}
    for mode in ("incremental", "sequence", "tree"):
        dest = tmp_path / f"{mode}.jsonl"
        code, _, err = run_cli(["generate", "--llm", str(m["llm"]), "--ssm", str(m["ssm"]), "--prompts", str(prompts),
                                "--mode", mode, "--max-new-tokens", "10", "--output", str(dest)], capsys)
        assert code == 0, err
        records = [json.loads(line) for line in dest.read_text().splitlines()]
        assert [r["prompt"] for r in records] == texts
        outputs[mode] = [r["output_token_ids"] for r in records]
    assert outputs["incremental"] == outputs["sequence"] == outputs["tree"]


def test_sampling_flags_and_seed_reproducible(cli_models, capsys):
    m = cli_models
    argv = ["generate", "--llm", str(m["llm"]), "--ssm", str(m["ssm"]), "--prompt", "def", "--max-new-tokens", "10",
            "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--seed", "7"]
    first = run_cli(argv, capsys)
    second = run_cli(argv, capsys)
    assert first[0] == 0 and json.loads(first[1])["output_token_ids"] == json.loads(second[1])["output_token_ids"]


BAD = {
    "missing directory": (["--llm", "{root}/nope"], "not found"),
    "unsupported architecture": (["--llm", "{gpt2}"], "unsupported architecture"),
    "empty prompt": (["--llm", "{llm}", "--prompt", ""], "empty"),
    "beyond context": (["--llm", "{llm}", "--max-new-tokens", "500"], "exceeds the model context"),
    "malformed tree width": (["--llm", "{llm}", "--ssm", "{ssm}", "--tree-width", "1,x"], "tree width"),
    "ssm vocabulary differs": (["--llm", "{llm}", "--ssm", "{other}"], "vocabulary"),
    "bad max tokens": (["--llm", "{llm}", "--max-new-tokens", "0"], "max-new-tokens"),
    "bad temperature": (["--llm", "{llm}", "--temperature", "-1"], "temperature"),
    "tree mode without ssm": (["--llm", "{llm}", "--ssm", "none", "--mode", "tree"], "needs at least one --ssm"),
    "presence penalty out of range": (["--llm", "{llm}", "--presence-penalty", "3"], "--presence-penalty"),
    "frequency penalty out of range": (["--llm", "{llm}", "--frequency-penalty", "-2.5"], "--frequency-penalty"),
    "repetition penalty of 0": (["--llm", "{llm}", "--repetition-penalty", "0"], "--repetition-penalty"),
    "min_p above 1": (["--llm", "{llm}", "--min-p", "1.5"], "--min-p"),
    "missing schema file": (["--llm", "{llm}", "--json-schema", "{root}/nope.json"], "--json-schema"),
    "schema that is not JSON": (["--llm", "{llm}", "--json-schema", "{llm}/model.safetensors"], "--json-schema"),
    "missing grammar file": (["--llm", "{llm}", "--grammar", "{root}/nope.ebnf"], "--grammar"),
    "empty choice": (["--llm", "{llm}", "--choice", "yes", "--choice", ""], "--choice"),
    "two constraints": (["--llm", "{llm}", "--regex", "a+", "--choice", "a"], "not allowed with argument"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_one_line_exit_2(cli_models, capsys, case):
    extra, fragment = BAD[case]
    argv = ["generate"] + [a.format(**{k: str(v) for k, v in cli_models.items()}) for a in extra]
    if "--prompt" not in argv:
        argv += ["--prompt", "def f"]
    code, out, err = run_cli(argv, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], err
    assert "Traceback" not in err and out == ""


def test_generate_and_client_generate_build_the_same_request(tmp_path):
    """`specinfer generate` (in process) and `specinfer client generate` (through the gateway)
    turn the same flags into the same SamplingParams and Constraint."""
    from specinfer.cli.client import GatewayClient, add_client_parser
    from specinfer.cli.commands import generation_params
    from specinfer.cli.main import build_parser
    from specinfer.cli.request_flags import constraint_fields, constraint_from_flags, processor_values, \
        sampling_from_flags
    from specinfer.params import Constraint
    from specinfer.serving.convert import params_from_generate_request

    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}}')
    grammar = tmp_path / "g.ebnf"
    grammar.write_text('root ::= "yes" | "no"')
    common = ["--temperature", "0.5", "--seed", "3", "--frequency-penalty", "0.5", "--presence-penalty", "-1",
              "--repetition-penalty", "1.25", "--min-p", "0.125"]
    cases = [(["--json-schema", str(schema)], Constraint("json_schema", schema.read_text())),
             (["--regex", "[0-9]+"], Constraint("regex", "[0-9]+")),
             (["--choice", "yes", "--choice", "no"], Constraint("choice", choices=("yes", "no"))),
             (["--grammar", str(grammar)], Constraint("grammar", grammar.read_text())),
             ([], None)]
    for extra, want in cases:
        local = build_parser().parse_args(["generate", "--prompt", "x", *common, *extra])
        sampling = sampling_from_flags(local, temperature=local.temperature, top_p=local.top_p, top_k=local.top_k,
                                       seed=local.seed)
        _, params = generation_params(local, True, "tree", sampling, constraint_from_flags(local))
        assert params.constraint == want and params.sampling.presence_penalty == -1.0
        remote = build_parser().parse_args(["client", "generate", "--prompt", "x", *common, *extra])
        request = GatewayClient._request("x", temperature=remote.temperature, top_p=remote.top_p, top_k=remote.top_k,
                                         seed=remote.seed, **processor_values(remote), **constraint_fields(remote))
        sent = params_from_generate_request(request)
        assert sent.sampling == params.sampling and sent.constraint == params.constraint


def test_bad_prompts_file(cli_models, capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    code, _, err = run_cli(["generate", "--llm", str(cli_models["llm"]), "--prompts", str(bad)], capsys)
    assert code == 2 and "bad.jsonl:2" in err


def test_real_entry_point_has_no_traceback(cli_models):
    proc = subprocess.run([sys.executable, "-m", "specinfer.cli", "generate", "--llm", str(cli_models["root"] / "nope"),
                           "--prompt", "x"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


@pytest.mark.parametrize("extra, fragment", [(["--concurrency", "1,x"], "comma-separated"),
                                             (["--concurrency", "1", "--rounds", "0"], "--rounds"),
                                             (["--concurrency", "1", "--compare-pipeline", "--co-located"],
                                              "--compare-pipeline"),
                                             (["--concurrency", "1", "--noisy-phase-s", "-1"], "--noisy-phase-s"),
                                             (["--concurrency", "1", "--num-speculators", "-1"], "--num-speculators")])
def test_bad_serving_bench_flags_exit_2_before_starting_a_stack(cli_models, capsys, extra, fragment):
    code, out, err = run_cli(["bench", "--llm", str(cli_models["llm"]), "--ssm", str(cli_models["ssm"])] + extra, capsys)
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1 and out == ""


SHARED_SETTINGS = ("--attention", "--cuda-graphs", "--offload", "--model-free", "--prefix-caching", "--dtype",
                   "--ssm-dtype", "--kv-budget", "--kv-memory-fraction")


def test_bench_against_transformers_prints_none_of_its_chatter(cli_models, capsys, tmp_path):
    """transformers' assisted generation warns from within (a deprecation its own candidate
    generator raises) and its loads draw progress bars: bench's stderr is bench's own lines."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add("}) + "\n")
    code, out, err = run_cli(["bench", "--llm", str(cli_models["llm"]), "--ssm", str(cli_models["ssm"]), "--prompts",
                              str(prompts), "--max-new-tokens", "6", "--device", "cpu", "--ssm-dtype", "float32",
                              "--cache-dir", str(tmp_path)], capsys)
    assert code == 0 and "transformers_assisted" in json.loads(out)["results"]
    assert all(line.startswith(("specinfer: ", "bench: ")) for line in err.splitlines()), err


def test_every_shared_setting_is_declared_once_for_the_services_and_the_commands():
    """The settings the command line and the services both have live in one module; nowhere
    else is one of them declared again (as an argparse argument or a Flag)."""
    import re

    root = Path(__file__).resolve().parents[1]
    declared = re.compile(r"""(add_argument|Flag)\(\s*"(--[a-z-]+)\"""")
    for path in list((root / "specinfer").rglob("*.py")) + list((root / "services").rglob("*.py")):
        if path.name == "shared_flags.py":
            continue
        for _, name in declared.findall(path.read_text()):
            assert name not in SHARED_SETTINGS, f"{path.relative_to(root)} declares {name} again"


def test_a_shared_setting_reads_the_same_flag_forms_and_variable_everywhere():
    from services.speculator.config import parse_config as speculator_config
    from services.verifier.config import parse_config as verifier_config
    from specinfer.cli.main import build_parser

    parser = build_parser()
    off = {"SPECINFER_PREFIX_CACHING": "off", "SPECINFER_CUDA_GRAPHS": "off", "SPECINFER_ATTENTION": "sdpa"}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in off.items():
            mp.setenv(key, value)
        for argv in (["generate", "--prompt", "x"], ["bench"], ["up"]):
            args = parser.parse_args(argv)
            assert (args.prefix_caching, args.cuda_graphs, args.attention) == (False, False, "sdpa"), argv
        assert parser.parse_args(["up", "--prefix-caching"]).prefix_caching is True  # the flag wins
    verifier = verifier_config(["--model", "m"], off)
    assert (verifier.is_prefix_caching, verifier.execution.cuda_graphs, verifier.execution.attention) == (
        False, False, "sdpa")
    for form in (["--no-prefix-caching"], ["--prefix-caching", "off"]):
        assert verifier_config(["--model", "m", *form], {}).is_prefix_caching is False
        assert parser.parse_args(["generate", "--prompt", "x", *form]).prefix_caching is False
    assert verifier_config(["--model", "m", "--offload"], {}).execution.offload is True
    assert speculator_config(["--ssm", "s", "--no-model-free", "--no-cuda-graphs"], {}).execution.cuda_graphs is False


def test_bench_reports_the_pool_members_at_its_own_decoding(capsys):
    """Greedy and sampled steps judge an SSM apart: a sampled bench reports the sampled verdicts,
    not the greedy ones (which a sampled run never touches)."""
    from types import SimpleNamespace

    from specinfer.cli.bench import member_verdicts
    from specinfer.engine.drafting.dynamic import MemberGain
    from specinfer.params import TreeBudget

    gains = {True: MemberGain(), False: MemberGain()}
    for _ in range(3):
        gains[False].observe(0, 0.5, accepted=1, nodes=2, levels=1)
    engine = SimpleNamespace(source=SimpleNamespace(speculator=SimpleNamespace(runners=[None], member_gain=gains),
                                                    names=["ssm-0"]),
                             load_policy=SimpleNamespace(budget=lambda _: TreeBudget()))
    assert member_verdicts(engine, ["draft"], is_greedy=False)["ssm-0"]["runs"] == 3
    assert member_verdicts(engine, ["draft"], is_greedy=True)["ssm-0"]["runs"] == 0
    assert "ssm-0 (draft) stays in the trees" in capsys.readouterr().err
