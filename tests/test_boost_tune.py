"""Collective boost-tuning end to end on tiny random models, and the "mixed" pool policy.

Checks: tuned checkpoints load in the engine and in transformers; the summary reports each SSM's
held-out agreement before and after; a run interrupted twice and resumed ends with bitwise the
same weights as an uninterrupted one; SSM 2 trains exactly on the positions SSM 1 gets wrong;
greedy output with the mixed policy is the LLM's own.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from specinfer.pool.boost_data import BoostData, DataConfig
from specinfer.pool.boost_tune import BoostConfig, TrainConfig, agreement, boost_loss, boost_tune, load_model
from specinfer.engine.llm_engine import Engine, mode_params
from specinfer.errors import UserError
from specinfer.pool.make_ssm import make_ssm
from specinfer.engine.runtime.runner import ModelRunner
from specinfer.engine.drafting.speculator import Speculator
from specinfer.params import TreeShape
from specinfer.params import SamplingParams
from util import add_tokenizer, perturbed_copy, save_tiny_llama

CORPUS_FILES = ("textwrap.py", "colorsys.py", "bisect.py", "shlex.py")
DATA = DataConfig(num_prompts=12, eval_prompts=4, prompt_tokens=24, continuation_tokens=12, kl_top_k=8)
TRAIN = TrainConfig(steps=6, batch_size=4, lr=3e-3, kl_weight=0.5, warmup_steps=2, checkpoint_every=2)


@dataclasses.dataclass(frozen=True)
class Pool:
    llm: Path
    ssms: tuple[Path, ...]
    corpus: Path


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> Pool:
    root = tmp_path_factory.mktemp("boost")
    corpus = root / "corpus"
    corpus.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in CORPUS_FILES:
        shutil.copyfile(stdlib / name, corpus / name)
    llm = save_tiny_llama(root / "llm", vocab=300, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64,
                          max_pos=256, seed=5)
    add_tokenizer(llm, 300, [(corpus / n).read_text() for n in CORPUS_FILES])
    noisy = perturbed_copy(llm, root / "noisy", noise=0.5, seed=1)
    cut = make_ssm(llm, root / "cut", "1")  # the LLM's last layer alone
    return Pool(llm, (noisy, cut), corpus)


def config(pool: Pool, out: Path) -> BoostConfig:
    files = tuple(sorted(pool.corpus.iterdir()))
    return BoostConfig(llm=pool.llm, ssms=pool.ssms, corpus=files, out=out, data=DATA, train=TRAIN)


@pytest.fixture(scope="module")
def uninterrupted(pool, tmp_path_factory) -> tuple[Path, dict]:
    """One run through the CLI entry point (directories as corpus, --quiet)."""
    from specinfer.cli.main import _Parser
    from specinfer.pool.commands import add_pool_parsers, run_pool_command

    out = tmp_path_factory.mktemp("run") / "out"
    parser = _Parser(prog="specinfer")
    add_pool_parsers(parser.add_subparsers(dest="command", required=True, parser_class=_Parser))
    args = parser.parse_args([
        "boost-tune", "--llm", str(pool.llm), "--ssm", str(pool.ssms[0]), "--ssm", str(pool.ssms[1]),
        "--corpus", str(pool.corpus), "--out", str(out), "--num-prompts", "12", "--eval-prompts", "4",
        "--prompt-tokens", "24", "--continuation-tokens", "12", "--steps", "6", "--batch-size", "4", "--lr", "3e-3",
        "--kl-weight", "0.5", "--kl-top-k", "8", "--checkpoint-every", "2", "--warmup-steps", "2", "--device", "cpu", "--quiet",
    ])
    assert run_pool_command(args) == 0
    return out, json.loads((out / "summary.json").read_text())


def test_summary_and_checkpoints_load_everywhere(pool, uninterrupted):
    out, summary = uninterrupted
    assert [e["name"] for e in summary["ssms"]] == ["ssm-0-noisy", "ssm-1-cut"]
    for entry in summary["ssms"]:
        for key in ("eval_agreement_before", "eval_agreement_after", "train_positions", "train_positions_total"):
            assert key in entry
        assert 0.0 <= entry["eval_agreement_before"] <= 1.0 and 0.0 <= entry["eval_agreement_after"] <= 1.0
        ckpt = Path(entry["checkpoint"])
        assert (ckpt / "tokenizer.json").is_file() and (ckpt / "model.safetensors").is_file()
        AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        ModelRunner.from_dir(ckpt, max_kv_tokens=64)
    assert summary["ssms"][0]["train_positions"] == summary["train_positions"]  # SSM 1 trains on everything
    assert 0 < summary["ssms"][1]["train_positions"] < summary["train_positions"]
    assert "pool_eval_agreement_after" in summary and summary["sample_unit"] == "position"


def test_tuning_changes_agreement_on_training_data(pool, uninterrupted):
    """Six steps at a high learning rate move SSM 1's agreement on its own training positions up."""
    out, summary = uninterrupted
    data = BoostData.from_tensors(load_file(str(out / ".boost" / "data.safetensors")), "train")
    before = agreement(load_model(pool.ssms[0], "cpu"), data, 16, "cpu", False, "")
    after = load_file(str(out / ".boost" / "ssm-0" / "marks.safetensors"))["train_agree"]
    assert int(after.sum()) > int(before.sum())


def test_second_ssm_trains_only_on_what_the_first_gets_wrong(pool, uninterrupted):
    out, _ = uninterrupted
    data = BoostData.from_tensors(load_file(str(out / ".boost" / "data.safetensors")), "train")
    tuned_first = AutoModelForCausalLM.from_pretrained(out / "ssm-0-noisy", dtype=torch.float32).eval()
    with torch.no_grad():
        top1 = tuned_first(input_ids=data.tokens, use_cache=False).logits.argmax(-1)
    first_right = (top1 == data.targets) & data.mask
    weights = load_file(str(out / ".boost" / "ssm-1" / "marks.safetensors"))["train_weights"]
    assert torch.equal(weights, data.mask & ~first_right)
    assert load_file(str(out / ".boost" / "ssm-0" / "marks.safetensors"))["train_weights"].equal(data.mask)


@pytest.mark.parametrize("flags,message", [
    (["--sampled-fraction", "2"], "--sampled-fraction"), (["--lr", "0"], "--lr"),
    (["--ssm", "/nonexistent/ssm"], "not found"), (["--corpus", "/nonexistent/corpus"], "corpus path not found"),
])
def test_boost_tune_bad_input_is_one_line_user_error(pool, tmp_path, flags, message):
    from specinfer.cli.main import _Parser
    from specinfer.pool.commands import add_pool_parsers, run_pool_command

    parser = _Parser(prog="specinfer")
    add_pool_parsers(parser.add_subparsers(dest="command", required=True, parser_class=_Parser))
    argv = ["boost-tune", "--llm", str(pool.llm), "--ssm", str(pool.ssms[0]), "--corpus", str(pool.corpus),
            "--out", str(tmp_path / "o"), "--device", "cpu", "--quiet", *flags]
    with pytest.raises(UserError) as exc:
        run_pool_command(parser.parse_args(argv))
    assert message in str(exc.value) and "\n" not in str(exc.value)
    assert not (tmp_path / "o").exists()


def test_loss_ignores_zero_weight_positions():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    weights = torch.tensor([[0, 1, 1, 0, 0], [1, 0, 0, 0, 1]], dtype=torch.float32)
    ids = torch.randint(0, 11, (2, 5, 3))
    probs = torch.rand(2, 5, 3)
    loss = boost_loss(logits, targets, weights, ids, probs, 0.5)
    (grad,) = torch.autograd.grad(loss, logits)
    off = weights == 0
    changed_targets = torch.where(off, (targets + 1) % 11, targets)
    changed_logits = torch.where(off.unsqueeze(-1), torch.randn(2, 5, 11), logits.detach()).requires_grad_()
    loss2 = boost_loss(changed_logits, changed_targets, weights, ids, probs, 0.5)
    (grad2,) = torch.autograd.grad(loss2, changed_logits)
    assert torch.equal(loss, loss2)
    assert torch.equal(grad[~off], grad2[~off]) and not grad[off].any()


def teacher_forced(runner, sequences, top_k):
    """The reference: one teacher-forced LLM pass per sequence, (top-1, top-k ids, renormalised top-k
    probabilities) at every position."""
    from specinfer.engine.runtime.runner import chain_work

    out = []
    for ids in sequences:
        seq = runner.new_sequence()
        try:
            (rows,) = runner.run([chain_work(seq, ids, "all")])
        finally:
            seq.free()
        top = torch.topk(torch.softmax(rows.float(), dim=-1), top_k, dim=-1)
        out.append((rows.float().argmax(-1), top.indices, top.values / top.values.sum(-1, keepdim=True)))
    return out


@pytest.mark.parametrize("top_k", [0, 8])
def test_targets_are_the_llms_own_distribution(pool, top_k):
    """The targets come from the generation's logprobs, with no second pass: they must be what a
    teacher-forced pass of the LLM over the same text gives, greedy and sampled rows alike (a sampled
    row's logprobs are of logits / T, turned back into the raw distribution)."""
    from specinfer.pool.boost_data import generate_continuations, targets_for

    runner = ModelRunner.from_dir(pool.llm, max_kv_tokens=1024)
    prompts = [[5, 9, 17, 33, 40], [7, 8, 100, 3], [11, 12, 13]]
    cfg = DataConfig(continuation_tokens=10, sampled_fraction=0.67, temperature=0.7, kl_top_k=top_k)
    conts, sampled, logprobs = generate_continuations(Engine.from_runners(runner), prompts, cfg, seed=0,
                                                      progress=False)
    assert sampled.count(True) == 2
    got = targets_for(prompts, conts, sampled, logprobs, top_k, cfg.temperature)
    want = teacher_forced(runner, [p + c for p, c in zip(prompts, conts)], max(top_k, 1))
    for p, c, (top1, ids, probs), (ref1, ref_ids, ref_probs), was_sampled in zip(prompts, conts, got, want, sampled):
        span = slice(len(p) - 1, len(p) + len(c) - 1)
        assert torch.equal(top1[span], ref1[span])
        assert torch.equal(top1[span], torch.tensor(c)) != was_sampled  # a sampled answer leaves the top-1
        assert ids.shape[-1] == top_k
        if top_k:
            assert torch.equal(ids[span], ref_ids[span])
            renormalised = probs[span] / probs[span].sum(-1, keepdim=True)
            assert torch.allclose(renormalised, ref_probs[span], atol=1e-5)
    assert runner.allocator.num_used == 0


def test_targets_keep_the_sampled_tokens_top1():
    """A sampled token's own logprob list gives its position's top-1 and the raw distribution:
    softmax(T * logprob) over the alternatives, whatever the sampled token was."""
    from specinfer.logprobs import TokenLogprob
    from specinfer.pool.boost_data import targets_for

    raw = torch.tensor([2.0, 1.0, 0.5])
    warped = torch.log_softmax(raw / 0.5, 0)
    lp = TokenLogprob(9, float(warped[2]), tuple((t, float(v)) for t, v in zip([4, 9, 6], warped)))
    (top1, ids, probs), = targets_for([[1, 2]], [[9, 3]], [True], [[lp, lp]], 3, 0.5)
    assert top1[1:3].tolist() == [4, 4]
    assert ids[1].tolist() == [4, 9, 6]
    assert torch.allclose(probs[1], torch.softmax(raw, 0), atol=1e-6)
    assert not probs[0].any() and not probs[3].any()


class Interrupt(Exception):
    pass


def interrupt_at(ssm: int, step: int):
    def hook(index: int, done: int) -> None:
        if (index, done) == (ssm, step):
            raise Interrupt
    return hook


def test_resume_after_interruptions_gives_identical_weights(pool, uninterrupted, tmp_path):
    reference, _ = uninterrupted
    cfg = config(pool, tmp_path / "out")
    # The reference run went through the CLI: make sure both runs really are the same run.
    recorded = json.loads((reference / ".boost" / "run.json").read_text())
    assert recorded["data"] == json.loads(json.dumps(dataclasses.asdict(DATA)))
    assert recorded["train"] == json.loads(json.dumps(dataclasses.asdict(TRAIN)))
    with pytest.raises(Interrupt):  # mid-SSM 1, one step after its checkpoint at step 2
        boost_tune(cfg, progress=False, on_step=interrupt_at(0, 3))
    with pytest.raises(UserError, match="--resume"):
        boost_tune(cfg, progress=False)
    with pytest.raises(Interrupt):  # SSM 1 finished, SSM 2 interrupted before any checkpoint
        boost_tune(cfg, resume=True, progress=False, on_step=interrupt_at(1, 1))
    summary = boost_tune(cfg, resume=True, progress=False)
    for name in ("ssm-0-noisy", "ssm-1-cut"):
        ours = load_file(str(tmp_path / "out" / name / "model.safetensors"))
        theirs = load_file(str(reference / name / "model.safetensors"))
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), name
    assert summary["ssms"] == [
        {**e, "checkpoint": str(tmp_path / "out" / e["name"])}
        for e in json.loads((reference / "summary.json").read_text())["ssms"]
    ]
    other = dataclasses.replace(cfg, train=dataclasses.replace(TRAIN, steps=7))
    with pytest.raises(UserError, match="different"):
        boost_tune(other, resume=True, progress=False)


# ---- the mixed policy ------------------------------------------------------------------------


def test_mixed_policy_greedy_equals_incremental(tiny_pair, greedy_prompts):
    llm = ModelRunner.from_dir(tiny_pair.llm, max_kv_tokens=4096)
    ssms = [ModelRunner.from_dir(p, max_kv_tokens=4096) for p in tiny_pair.ssms]
    engine = Engine.from_runners(llm, ssms)
    widths = (1, 1, 3, 1, 1, 1, 1, 1)
    base = Engine.from_runners(llm)
    for prompt in greedy_prompts[:10]:
        expected = base.generate(prompt, mode_params("incremental", 48)).output_ids
        mixed = engine.generate(prompt, mode_params("tree", 48, TreeShape(widths, policy="mixed")))
        merged = engine.generate(prompt, mode_params("tree", 48, TreeShape(widths, policy="merge")))
        assert mixed.output_ids == expected == merged.output_ids
        assert sum(mixed.accepted_per_step) > 0
    assert llm.allocator.num_used == 0 and all(s.allocator.num_used == 0 for s in ssms)


def test_mixed_policy_tree_shapes(tiny_pair):
    ssms = [ModelRunner.from_dir(p, max_kv_tokens=512) for p in tiny_pair.ssms]
    speculator = Speculator(ssms)
    widths = (2, 2, 1, 1)
    for policy in ("mixed", "merge"):
        states = speculator.start([5, 9, 17, 33])
        shape = TreeShape(widths, 64, policy=policy)
        merged, trees, _, _ = speculator.propose([(states, shape, SamplingParams(), None)])[0]
        primary, other = trees[0].tree, trees[1].tree
        assert len(primary) == 1 + 2 + 4 + 4 + 4
        if policy == "mixed":  # a width-1 chain of the same depth
            assert len(other) == 1 + len(widths) and all(len(c) <= 1 for c in other.children)
            assert len(merged) <= len(primary) + len(widths)
        else:
            assert len(other) == len(primary)
        speculator.release(states)
    with pytest.raises(UserError, match="policy"):
        TreeShape(widths, policy="best")


def test_kl_top_k_is_bounded_by_the_engines_logprobs():
    """The LLM's top-k comes from the engine's logprobs, so a larger k is refused, naming the bound."""
    from specinfer.limits import MAX_LOGPROBS

    DataConfig(kl_top_k=MAX_LOGPROBS)
    with pytest.raises(UserError, match=rf"--kl-top-k must be in \[0, {MAX_LOGPROBS}\]"):
        DataConfig(kl_top_k=MAX_LOGPROBS + 1)
