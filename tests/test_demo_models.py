"""The built-in demo models: a tiny-budget build is a set of valid, cached, shared-tokenizer checkpoints."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoTokenizer, LlamaForCausalLM

import specinfer.pool.demo_models as dm
from specinfer.engine.runtime.runner import ModelRunner, chain_work
from specinfer.util import CACHE_DIR_ENV, default_cache_dir

BUDGET = dm.DemoBudget.tiny()
SAMPLE = 'def greet(name: str) -> str:\n    """Say hello."""\n    return f"hello, {name}!"  # ünï\n'


@dataclass(frozen=True)
class Built:
    cache_dir: Path
    paths: dm.DemoPaths
    builds: list  # one entry per call of build_demo_models


class OneThread(dm.ThreadTuner):
    """Training on a fixed thread count: the tuner follows the machine's load, and a different
    count changes the last bits of the weights, so the reproducibility checks pin it."""

    def _free(self, busy: float) -> int:
        return 1


@pytest.fixture(scope="module", autouse=True)
def fixed_threads():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dm, "ThreadTuner", OneThread)
        yield


@pytest.fixture(scope="module")
def built(tmp_path_factory, fixed_threads) -> Built:
    cache_dir = tmp_path_factory.mktemp("demo-cache")
    builds: list[Path] = []
    real_build = dm.build_demo_models

    def counting_build(out_dir, *args, **kwargs):
        builds.append(Path(out_dir))
        return real_build(out_dir, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dm, "build_demo_models", counting_build)
        paths = dm.ensure_demo_models(cache_dir, BUDGET, seed=0, progress=False)
    return Built(cache_dir, paths, builds)


def model_dirs(paths: dm.DemoPaths) -> list[Path]:
    return [paths.llm, *paths.ssms]


def test_layout(built):
    paths = built.paths
    assert paths.root == built.cache_dir / dm.demo_dir_name(BUDGET, 0)
    assert len(paths.ssms) == BUDGET.num_ssms
    assert [p.parent for p in model_dirs(paths)] == [paths.root] * (1 + BUDGET.num_ssms)
    for d in model_dirs(paths):
        for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json", "training.json"):
            assert (d / name).is_file(), d / name
    assert not list(built.cache_dir.glob(".*partial*")), "temporary build dir left behind"


def test_checkpoints_load_with_transformers(built):
    ids = torch.tensor([[5, 70, 300, 12, 1, 9]])
    for d in model_dirs(built.paths):
        model = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLM"]
        assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (0, 1)
        with torch.no_grad():
            logits = model(ids).logits
        assert logits.shape == (1, ids.shape[1], BUDGET.vocab_size)
        assert torch.isfinite(logits).all()
    llm_cfg = json.loads((built.paths.llm / "config.json").read_text())
    assert llm_cfg["num_key_value_heads"] < llm_cfg["num_attention_heads"]
    assert llm_cfg["tie_word_embeddings"] is False
    for ssm in built.paths.ssms:
        assert json.loads((ssm / "config.json").read_text())["tie_word_embeddings"] is True


def test_checkpoints_load_with_runner_and_match_transformers(built):
    prompt = [7, 99, 250, 3, 41, 8, 17]
    for d in model_dirs(built.paths):
        runner = ModelRunner.from_dir(d, max_kv_tokens=64)
        seq = runner.new_sequence()
        (ours,) = runner.run([chain_work(seq, prompt, "all")])
        hf = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            theirs = hf(torch.tensor([prompt])).logits[0]
        assert (ours - theirs).abs().max().item() <= 1e-4


def test_ssms_differ(built):
    weights = [load_file(str(d / "model.safetensors")) for d in built.paths.ssms]
    key = "model.embed_tokens.weight"
    assert not torch.equal(weights[0][key], weights[1][key])


def test_tokenizer_shared_and_round_trips(built):
    dirs = model_dirs(built.paths)
    texts = {(d / "tokenizer.json").read_text() for d in dirs}
    assert len(texts) == 1, "LLM and SSMs must share one tokenizer"
    raw = Tokenizer.from_file(str(built.paths.llm / "tokenizer.json"))
    assert [raw.token_to_id(t) for t in ("<s>", "</s>", "<unk>")] == [0, 1, 2]
    assert raw.get_vocab_size() == BUDGET.vocab_size
    enc = raw.encode(SAMPLE)
    assert 0 not in enc.ids, "no BOS is added on encode"
    assert raw.decode(enc.ids) == SAMPLE
    hf_tok = AutoTokenizer.from_pretrained(built.paths.llm)
    ids = hf_tok(SAMPLE).input_ids
    assert ids == enc.ids
    assert hf_tok.decode(ids) == SAMPLE
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.unk_token_id) == (0, 1, 2)


def test_prompts_are_well_formed_and_held_out(built):
    lines = built.paths.prompts.read_text(encoding="utf-8").splitlines()
    assert len(lines) == BUDGET.num_prompts
    heldout = json.loads((built.paths.root / dm.HELDOUT_NAME).read_text())
    assert heldout["files"] and all(dm.is_heldout(rel) for rel in heldout["files"])
    sources = [(Path(heldout["stdlib"]) / rel).read_text(encoding="utf-8", errors="replace")
               for rel in heldout["files"]]
    lo, hi = BUDGET.prompt_chars
    prompts = [json.loads(line) for line in lines]
    assert len({p["prompt"] for p in prompts}) == len(prompts)
    for record in prompts:
        assert list(record) == ["prompt"]
        prompt = record["prompt"]
        assert isinstance(prompt, str) and lo <= len(prompt) <= hi
        # cut from a held-out file, starting at a line start
        assert any(src.startswith(prompt) or ("\n" + prompt) in src for src in sources)


def test_prompts_are_deterministic(built):
    corpus = dm.stdlib_corpus()
    assert dm.heldout_prompts(corpus, BUDGET, 0) == dm.heldout_prompts(corpus, BUDGET, 0)
    assert not set(corpus.train) & set(corpus.heldout)


def test_training_reports(built):
    llm = json.loads((built.paths.llm / dm.TRAINING_NAME).read_text())
    assert llm["steps"] == BUDGET.llm_steps and llm["params"] > 0 and llm["minutes"] >= 0
    assert llm["heldout_loss"] > 0
    assert len(llm["ssm_top1_agreement"]) == BUDGET.num_ssms
    assert all(0.0 <= a <= 1.0 for a in llm["ssm_top1_agreement"])
    for ssm in built.paths.ssms:
        report = json.loads((ssm / dm.TRAINING_NAME).read_text())
        assert report["steps"] == BUDGET.ssm_steps and report["distilled_from"] == "llm"


def test_second_call_reuses_cache(built, monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("a complete cache must not be rebuilt")

    manifest = built.paths.root / dm.MANIFEST_NAME
    before = manifest.stat().st_mtime_ns
    monkeypatch.setattr(dm, "build_demo_models", no_build)
    again = dm.ensure_demo_models(built.cache_dir, BUDGET, seed=0, progress=False)
    assert again == built.paths
    assert manifest.stat().st_mtime_ns == before
    assert len(built.builds) == 1


def test_incomplete_dirs_are_not_finished_builds(built, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(built.paths.root, copy)
    assert dm.load_demo_paths(copy) is not None
    manifest = json.loads((copy / dm.MANIFEST_NAME).read_text())
    assert dm.load_demo_paths(copy, BUDGET, 0) is not None
    assert dm.load_demo_paths(copy, BUDGET, 1) is None, "another seed's build is not this one"
    assert dm.load_demo_paths(copy, dataclasses.replace(BUDGET, llm_steps=BUDGET.llm_steps + 1), 0) is None
    (copy / dm.MANIFEST_NAME).write_text(json.dumps({**manifest, "complete": False}))
    assert dm.load_demo_paths(copy) is None
    (copy / dm.MANIFEST_NAME).write_text(json.dumps(manifest))
    (copy / "ssm-1" / "model.safetensors").unlink()
    assert dm.load_demo_paths(copy) is None, "a missing weight file makes the build incomplete"
    (copy / dm.MANIFEST_NAME).unlink()
    assert dm.load_demo_paths(copy) is None


def test_leftover_partial_dir_is_rebuilt(built, tmp_path, monkeypatch):
    """A crashed earlier run (root without manifest, stale temp dir) leads to a fresh, complete build."""
    name = dm.demo_dir_name(BUDGET, 0)
    root = tmp_path / name
    (root / "llm").mkdir(parents=True)
    (root / "llm" / "config.json").write_text("{}")
    (root / dm.PROMPTS_NAME).write_text('{"prompt": "half"}\n')
    stale = tmp_path / f".{name}{dm.PARTIAL_MARK}{2**22 + 12345}-abc"  # a pid that cannot be alive
    (stale / "llm").mkdir(parents=True)
    assert dm.load_demo_paths(root) is None and dm.load_demo_paths(stale) is None

    calls: list[Path] = []
    real_build = dm.build_demo_models
    monkeypatch.setattr(dm, "build_demo_models", lambda out, *a, **k: calls.append(out) or real_build(out, *a, **k))
    paths = dm.ensure_demo_models(tmp_path, BUDGET, seed=0, progress=False)
    assert len(calls) == 1 and calls[0] != root
    assert paths.root == root and dm.load_demo_paths(root) == paths
    assert not stale.exists()
    assert not list(tmp_path.glob(".*partial*"))
    assert len(paths.prompts.read_text().splitlines()) == BUDGET.num_prompts
    # same budget, seed and threads: the same weights (training does not depend on wall-clock time)
    for ours, first in zip(model_dirs(paths), model_dirs(built.paths)):
        a, b = load_file(str(ours / "model.safetensors")), load_file(str(first / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_demo_dir_names():
    assert dm.demo_dir_name(dm.DemoBudget.full(), 0) == dm.DEFAULT_DEMO_DIR_NAME
    assert dm.demo_dir_name(BUDGET, 0) != dm.demo_dir_name(BUDGET, 1) != dm.DEFAULT_DEMO_DIR_NAME
    assert dm.demo_dir_name(BUDGET, 0) == dm.demo_dir_name(dataclasses.replace(BUDGET), 0)


def test_cache_dir_is_the_flag_then_the_environment_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    assert default_cache_dir() == Path.home() / ".cache" / "specinfer"
    monkeypatch.setenv(CACHE_DIR_ENV, "")
    assert default_cache_dir() == Path.home() / ".cache" / "specinfer"
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "env"))
    assert default_cache_dir() == tmp_path / "env"
    assert default_cache_dir(tmp_path / "flag") == tmp_path / "flag"


def test_the_cache_dir_is_known_without_loading_torch():
    import subprocess
    import sys

    code = "import sys, specinfer.util, specinfer.cli.main; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


@pytest.mark.parametrize("flag", [False, True])
def test_every_command_reads_the_cache_dir_the_same_way(monkeypatch, tmp_path, flag):
    """`specinfer demo-models` (like generate, bench and up) gets --cache-dir, else $SPECINFER_CACHE_DIR."""
    import specinfer.cli.commands as commands
    from specinfer.cli.main import main

    seen = []
    monkeypatch.setattr(commands, "run_demo_models", lambda args, cache_dir: seen.append(cache_dir) or 0)
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "env"))
    argv = ["demo-models"] + (["--cache-dir", str(tmp_path / "flag")] if flag else [])
    assert main(argv) == 0
    assert seen == [tmp_path / ("flag" if flag else "env")]


def test_budget_presets_are_frozen_and_valid():
    full, tiny = dm.DemoBudget.full(), dm.DemoBudget.tiny()
    assert full.num_ssms >= 1 and full.llm_steps > tiny.llm_steps
    with pytest.raises(Exception):
        full.llm_steps = 1  # type: ignore[misc]
    with pytest.raises(ValueError):
        dataclasses.replace(tiny, vocab_size=100)
