"""`make-draft` on a tiny random Llama: the distilled draft agrees with the LLM more than the
untrained cut it starts from, loads as an SSM with greedy output exactly the LLM's, carries the
LLM's answers for the suffix member, resumes an interrupted build, and refuses bad input with one
line (exit code 2). Chat prompt files ({"messages": [...]} lines) are rendered with the model's
chat template."""

from __future__ import annotations

import json
import shutil
import sysconfig
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specinfer.engine.llm_engine import Engine, mode_params
from specinfer.engine.models.config import DRAFT_VOCAB_KEY, ModelConfig
from specinfer.engine.models.transformer import UNSCORED_LOGIT
from specinfer.engine.runtime.runner import ModelRunner, chain_work
from specinfer.pool.boost_data import BoostData
from specinfer.errors import UserError
from specinfer.params import TreeShape
from specinfer.pool import make_draft as md
from specinfer.pool.make_draft import acceptance_by_depth, build_draft
from specinfer.pool.tuning_config import DraftConfig
from util import add_tokenizer, save_tiny_llama

CORPUS_FILES = ("textwrap.py", "colorsys.py", "bisect.py", "shlex.py")
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")
# Deterministic: a fixed number of teacher batches and steps (the time budget never binds).
# The draft keeps the LLM's first and last layers: as cut it hardly ever agrees with the LLM. Its
# head keeps 60 of the 300 tokens.
CFG = DraftConfig(minutes=60, layers="0,3", prompt_tokens=24, continuation_tokens=16, eval_prompts=8,
                  gen_batch_size=8, batch_size=8, lr=3e-3, kl_top_k=8, max_batches=3, steps=80, vocab=60)


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("make_draft")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / n).read_text() for n in CORPUS_FILES]
    model = save_tiny_llama(root / "llm", vocab=300, hidden=32, layers=4, heads=4, kv_heads=2, intermediate=64,
                            max_pos=256, seed=7, eos_token_id=None, init_std=0.2)
    add_tokenizer(model, 300, texts)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    (root / "corpus.txt").write_text("\n".join(texts))
    return model


@pytest.fixture(scope="module")
def built(llm, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("built") / "draft"
    return out, build_draft(llm, out, progress=False, cfg=CFG)


def test_distilled_draft_agrees_more_than_the_cut(built):
    out, record = built
    assert record == json.loads((out / md.DRAFT_RECORD_FILE).read_text())
    assert record["steps"] == CFG.steps and record["train_answers"] == CFG.max_batches * CFG.gen_batch_size
    assert record["agreement_after"] >= record["agreement_before"] + 0.1, record
    before, after = record["acceptance_by_depth_before"], record["acceptance_by_depth_after"]
    assert len(after) == md.MAX_DEPTH and after[0] == record["agreement_after"]
    assert after[1] > before[1]
    assert all(a >= b for a, b in zip(after, after[1:]))  # a longer chain is never likelier
    assert record["draft_pass_ms"] > 0 and record["llm_pass_ms"] > 0
    assert not md.DraftPlan(Path("x"), out, CFG).work.exists()  # the work in progress is cleaned up


def test_draft_is_a_checkpoint_whose_greedy_output_is_the_llms(llm, built):
    out, record = built
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and (out / "tokenizer.json").is_file()
    vocab = config[DRAFT_VOCAB_KEY]
    assert len(vocab) == record["vocab_size"] == 60 and vocab == sorted(set(vocab))
    assert 0.5 < record["vocab_coverage"] < 1.0  # the answers use a token the head dropped, now and then
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.bin"))
    runner = ModelRunner.from_dir(llm, max_kv_tokens=4096)
    draft = ModelRunner.from_dir(out, max_kv_tokens=4096)
    plain, speculative = Engine.from_runners(runner), Engine.from_runners(runner, [draft])
    accepted = 0
    for prompt in ([5, 9, 17, 33, 40], [7, 8, 100, 3, 250, 12], [11, 12, 13, 14]):
        expected = plain.generate(prompt, mode_params("incremental", 40)).output_ids
        assert not set(expected) <= set(vocab)  # the LLM's output leaves the draft's vocabulary ...
        for mode, shape in (("tree", TreeShape((1, 1, 3, 1, 1, 1, 1, 1))), ("auto", TreeShape((1,) * 8))):
            result = speculative.generate(prompt, mode_params(mode, 40, shape))
            assert result.output_ids == expected, mode  # ... and is still the LLM's, token for token
            accepted += sum(result.accepted_per_step)
    assert accepted > 0


def test_the_draft_carries_the_llms_answers_and_the_suffix_member_drafts_from_them(llm, built, tmp_path):
    from safetensors.torch import save_file

    from specinfer.engine.models.config import DRAFT_ANSWERS_FILE
    from specinfer.engine.runtime.assemble import draft_answers, model_free_members

    out, record = built
    answers = draft_answers([out])
    assert len(answers) == record["answers"] == record["train_answers"]
    assert sum(map(len, answers)) == record["answer_tokens"] > 0
    assert all(1 <= len(a) <= CFG.continuation_tokens for a in answers)
    assert all(0 <= t < 300 for a in answers for t in a)
    lookup, suffix = model_free_members(("lookup", "suffix"), [out])
    assert suffix.seed.num_tokens == record["answer_tokens"] and not hasattr(lookup, "seed")
    assert model_free_members(("suffix",), [llm])[0].seed is None  # a checkpoint without answers adds none
    assert sum(map(len, draft_answers([out], max_tokens=20))) <= 20  # bounded, whole answers only
    # A seeded suffix member drafts an answer's continuation from its opening tokens alone.
    first = next(a for a in answers if len(a) >= 6)
    tree = suffix.propose(suffix.start([1] + first[:4]), 8, 24)
    assert first[4] in [tree.tokens[c] for c in tree.children[0]]
    # The engine with the draft and its seeded suffix member decodes exactly the LLM's tokens.
    runner = ModelRunner.from_dir(llm, max_kv_tokens=4096)
    draft = ModelRunner.from_dir(out, max_kv_tokens=4096)
    plain = Engine.from_runners(runner)
    pooled = Engine.from_runners(runner, [draft], model_free=model_free_members(("lookup", "suffix"), [out]))
    for prompt in ([1] + first[:3], [5, 9, 17, 33, 40]):
        expected = plain.generate(prompt, mode_params("incremental", 32)).output_ids
        assert pooled.generate(prompt, mode_params("auto", 32)).output_ids == expected
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    save_file({"tokens": torch.tensor([1, 2, 3], dtype=torch.int32), "lengths": torch.tensor([5], dtype=torch.int32)},
              str(bad / DRAFT_ANSWERS_FILE))
    with pytest.raises(UserError, match="do not add up"):
        draft_answers([bad])
    (bad / DRAFT_ANSWERS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(UserError, match="not a readable answers file"):
        draft_answers([bad])


def test_a_reduced_head_scores_its_vocabulary_as_the_whole_head_does_and_nothing_else(built, tmp_path):
    out, _ = built
    whole = tmp_path / "whole"
    shutil.copytree(out, whole)
    config = json.loads((whole / "config.json").read_text())
    vocab = torch.tensor(config.pop(DRAFT_VOCAB_KEY))
    (whole / "config.json").write_text(json.dumps(config))
    logits = {}
    for name, path in (("reduced", out), ("whole", whole)):
        runner = ModelRunner.from_dir(path, max_kv_tokens=256)
        seq = runner.new_sequence()
        logits[name] = runner.run([chain_work(seq, [5, 9, 17, 33, 40], logits="all")])[0]
    outside = torch.ones(300, dtype=torch.bool)
    outside[vocab] = False
    assert torch.all(logits["reduced"][:, outside] == UNSCORED_LOGIT)
    torch.testing.assert_close(logits["reduced"][:, vocab], logits["whole"][:, vocab], rtol=1e-5, atol=1e-5)
    assert torch.equal(logits["reduced"].argmax(-1), vocab[logits["whole"][:, vocab].argmax(-1)])
    assert torch.softmax(logits["reduced"] / 0.01, -1)[:, outside].sum() == 0  # never proposed, at any temperature


def test_the_vocabulary_is_the_most_frequent_answer_tokens_and_eos():
    tokens = torch.zeros(2, 6, dtype=torch.long)
    targets = torch.tensor([[0, 4, 4, 4, 2, 9], [0, 2, 2, 7, 7, 9]])
    mask = torch.tensor([[False, True, True, True, True, False], [False, True, True, True, True, True]])
    data = BoostData(tokens, torch.tensor([6, 6]), targets, mask, torch.tensor([False, False]),
                     torch.zeros(2, 6, 0, dtype=torch.long), torch.zeros(2, 6, 0))
    cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 12, "hidden_size": 8,
                                 "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                                 "num_key_value_heads": 2, "eos_token_id": 11})
    # 4 and 2 answer three times each, 7 twice, 9 once (its other position is outside the mask)
    assert md.draft_vocabulary(data, 3, cfg).tolist() == [2, 4, 11]
    assert md.draft_vocabulary(data, 4, cfg).tolist() == [2, 4, 7, 11]
    assert md.draft_vocabulary(data, 0, cfg) is None and md.draft_vocabulary(data, 12, cfg) is None
    assert md.coverage(torch.tensor([2, 4, 11]), data) == pytest.approx(6 / 9)


@pytest.mark.parametrize("value", [[], [3, 3], [12], [-1], "1,2", [1.5]])
def test_a_bad_draft_vocabulary_is_a_clear_error(value):
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 12, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, DRAFT_VOCAB_KEY: value}
    with pytest.raises(UserError, match=DRAFT_VOCAB_KEY):
        ModelConfig.from_dict(raw)


def test_frozen_vocabulary_stays_the_llms(llm, built):
    from safetensors.torch import load_file

    ours = load_file(str(built[0] / "model.safetensors"))
    theirs = load_file(str(llm / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(ours[name], theirs[name]), name
    assert not torch.equal(ours["model.layers.0.mlp.up_proj.weight"], theirs["model.layers.0.mlp.up_proj.weight"])


class Interrupt(Exception):
    pass


def test_interrupted_build_leaves_no_output_and_resumes_its_data(llm, tmp_path, monkeypatch):
    out = tmp_path / "draft"
    cfg = replace(CFG, max_batches=2, steps=4)
    calls = []
    real_batch = md._teacher_batch

    def counting(*args, **kwargs):
        calls.append(1)
        return real_batch(*args, **kwargs)

    monkeypatch.setattr(md, "_teacher_batch", counting)

    def interrupted(*args, **kwargs):
        raise Interrupt

    monkeypatch.setattr(md, "save_draft", interrupted)
    with pytest.raises(Interrupt):
        build_draft(llm, out, progress=False, cfg=cfg)
    assert not out.exists() and len(calls) == 3  # held-out batch + 2 training batches
    monkeypatch.undo()
    monkeypatch.setattr(md, "_teacher_batch", counting)
    record = build_draft(llm, out, progress=False, cfg=cfg)
    assert len(calls) == 3  # the teacher data was kept, not made again
    assert record["train_answers"] == 2 * cfg.gen_batch_size and (out / "model.safetensors").is_file()


def test_corpus_prompts(llm, tmp_path):
    cfg = replace(CFG, max_batches=1, steps=2)
    record = build_draft(llm, tmp_path / "d", progress=False, cfg=cfg, corpus=llm.parent / "corpus.txt")
    assert record["source"] == "corpus" and record["train_answers"] == cfg.gen_batch_size


def test_acceptance_by_depth_counts_whole_chains():
    agree = torch.tensor([[True, True, True, True, True, False], [False, True, False, True, False, False]])
    mask = torch.tensor([[False, True, True, True, True, True], [False, True, True, True, False, False]])
    # row 0 (positions 1-5, the last missed): 4 of 5 at depth 1, 3 of 4 pairs, 2 of 3 triples, 1 of 2, 0 of 1;
    # row 1 (positions 1-3; position 0 agrees but is no answer position): 2 of 3, 0 of 2, 0 of 1
    assert acceptance_by_depth(agree, mask, 6) == [0.75, 0.5, 0.5, 0.5, 0.0]


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    from specinfer.cli.main import main

    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case,message", [
    ("no-llm", "no such checkpoint"), ("minutes", "--minutes"), ("layers", "--layers"),
    ("not-empty", "not empty"), ("corpus", "--corpus"), ("no-template", "chat template"),
])
def test_bad_input_exits_2_with_one_line(llm, tmp_path, capsys, case, message):
    out = tmp_path / "out"
    argv = ["make-draft", "--llm", str(llm), "--out", str(out), "--quiet"]
    if case == "no-llm":
        argv[2] = str(tmp_path / "missing")
    elif case == "minutes":
        argv += ["--minutes", "0"]
    elif case == "layers":
        argv += ["--layers", "9"]
    elif case == "not-empty":
        out.mkdir()
        (out / "x").write_text("x")
    elif case == "corpus":
        argv += ["--corpus", str(tmp_path / "missing.txt")]
    elif case == "no-template":
        bare = tmp_path / "bare"
        shutil.copytree(llm, bare)
        config = json.loads((bare / "tokenizer_config.json").read_text())
        del config["chat_template"]
        (bare / "tokenizer_config.json").write_text(json.dumps(config))
        argv[2] = str(bare)
    code, err = run_cli(argv, capsys)
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not out.exists() or case == "not-empty"


# ---- chat prompt files -----------------------------------------------------------------------


def test_prompt_files_take_messages_rendered_with_the_chat_template(llm, tmp_path):
    from specinfer.cli.commands import prompt_texts

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi there"}]}) + "\n"
                    + json.dumps({"prompt": "plain text"}) + "\n")
    assert prompt_texts(path, llm) == ["<s>user: hi there\n<s>assistant:", "plain text"]
    path.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(UserError, match="every message"):
        prompt_texts(path, llm)
    path.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(UserError, match='"messages"'):
        prompt_texts(path, llm)


def test_shipped_prompt_sets_are_distinct_chats():
    from specinfer.engine.runtime.load import read_prompts

    seeds = read_prompts(md.SEED_PROMPTS, allow_messages=True)
    bench = read_prompts(Path(__file__).parent.parent / "specinfer" / "pool" / "data" / "heldout_chat_prompts.jsonl", allow_messages=True)
    assert len(seeds) >= 200 and len(bench) >= 40
    assert all(isinstance(p, list) and p[0]["role"] == "user" for p in seeds + bench)
    texts = [p[0]["content"] for p in seeds]
    assert len(set(texts)) == len(texts)
    assert not set(texts) & {p[0]["content"] for p in bench}  # the benchmark's questions are held out


def test_training_shortens_to_the_time_left(tmp_path):
    from types import SimpleNamespace

    from specinfer.pool.tuning_config import TrainConfig

    now = [0.0]
    clock = md.Clock(1.0, now=lambda: now[0])  # 60 s
    trainer = SimpleNamespace(cfg=TrainConfig(steps=200), step=0)
    check = md._keep_to_budget(trainer, clock, reserve_s=10.0, steps_path=tmp_path / "steps.json")
    for done in range(1, 11):  # one second a step: at step 10, 40 s (40 steps) are left after the reserve
        now[0] = float(done)
        check(0, done)
    assert trainer.cfg.steps == 50
    assert json.loads((tmp_path / "steps.json").read_text())["steps"] == 50
    for done in range(11, 21):  # the pace holds: nothing changes
        now[0] = float(done)
        check(0, done)
    assert trainer.cfg.steps == 50


def test_distillation_scores_the_draft_s_vocabulary_alone(built):
    """The draft trains on a softmax over its reduced vocabulary, the one it proposes from: the
    logits of those tokens are the whole head's, targets and top-k ids become indices into the
    vocabulary, a position whose top-1 lies outside weighs nothing, and top-k tokens outside get
    probability 0."""
    from specinfer.pool.boost_tune import in_vocabulary, load_model, logits_at

    vocab = torch.tensor([2, 4, 7, 11])
    at, weights, topk_at, topk_probs = in_vocabulary(
        vocab, torch.tensor([4, 5, 11]), torch.tensor([1.0, 1.0, 0.5]), torch.tensor([[4, 2], [5, 7], [11, 300]]),
        torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.9, 0.1]]))
    assert weights.tolist() == [1.0, 0.0, 0.5] and at[[0, 2]].tolist() == [1, 3]
    assert topk_at[0].tolist() == [1, 0] and int(topk_at[1, 1]) == 2 and int(topk_at[2, 0]) == 3
    assert torch.equal(topk_probs, torch.tensor([[0.6, 0.4], [0.0, 0.5], [0.9, 0.0]]))

    out, _ = built
    model = load_model(out, "cpu")
    vocab = torch.tensor(json.loads((out / "config.json").read_text())[DRAFT_VOCAB_KEY])
    tokens = torch.tensor([[5, 9, 17, 33, 40, 41]])
    picked = (torch.zeros(4, dtype=torch.long), torch.tensor([1, 2, 4, 5]))
    with torch.no_grad():
        reduced, whole = logits_at(model, tokens, picked, vocab), logits_at(model, tokens, picked)
    assert reduced.shape == (4, len(vocab))
    torch.testing.assert_close(reduced, whole[:, vocab], rtol=1e-5, atol=1e-5)


def _synthetic_data(vocab_size: int, rows: int = 4, length: int = 8) -> BoostData:
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, vocab_size, (rows, length), generator=gen)
    mask = torch.zeros(rows, length, dtype=torch.bool)
    mask[:, 2:length - 1] = True
    return BoostData(tokens=tokens, lengths=torch.full((rows,), length), targets=torch.roll(tokens, -1, 1) * mask,
                     mask=mask, sampled=torch.zeros(rows, dtype=torch.bool),
                     topk_ids=torch.zeros(rows, length, 0, dtype=torch.long), topk_probs=torch.zeros(rows, length, 0))


@pytest.mark.parametrize("is_head_frozen", [True, False])
def test_a_frozen_head_s_vocabulary_rows_are_gathered_once_and_train_the_same(built, is_head_frozen):
    """A draft with a reduced vocabulary and the LLM's frozen head takes that head's rows once,
    not at every step, and trains exactly as if it gathered them each time; a head that trains
    keeps gathering them, so its gradient still reaches it."""
    from specinfer.pool.boost_tune import Trainer, load_model
    from specinfer.pool.tuning_config import TrainConfig

    out, _ = built
    vocab = torch.tensor(json.loads((out / "config.json").read_text())[DRAFT_VOCAB_KEY])
    data = _synthetic_data(int(vocab.max()) + 1)
    data.targets[data.mask] = vocab[data.targets[data.mask] % len(vocab)]  # answers inside the vocabulary
    cfg = TrainConfig(steps=3, batch_size=2, lr=1e-2, warmup_steps=1)
    models, trainers = [], []
    for _ in range(2):
        model = load_model(out, "cpu")
        if is_head_frozen:
            md.freeze_vocabulary(model)
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone(),
                                                  requires_grad=not is_head_frozen)  # untied: each its own
        models.append(model)
        trainers.append(Trainer(model, cfg, 0, "cpu", vocab))
    assert (trainers[0].frozen_head is not None) == is_head_frozen
    trainers[1].frozen_head = None  # the reference: gathers the rows at every step
    rows = torch.arange(2)
    for _ in range(cfg.steps):
        losses = [t.train_step(data, data.mask, rows) for t in trainers]
        assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
    head_moved = not torch.equal(models[0].lm_head.weight, load_model(out, "cpu").lm_head.weight)
    assert head_moved != is_head_frozen


@pytest.mark.parametrize("dtype", ["float32", "q8_0", "bfloat16"])
@pytest.mark.parametrize("is_tied", [True, False])
def test_the_memory_plan_counts_a_draft_s_reduced_head_as_it_loads(built, tmp_path, dtype, is_tied):
    """A draft with a reduced vocabulary holds its whole embedding and, apart, the head's rows of
    that vocabulary (tied to the embedding or not): the weights' estimate (what the KV cache's
    budget is left after) is what the loaded draft holds, within the panels' padding."""
    from safetensors.torch import load_file, save_file

    from specinfer.engine.layers import cpu_gemm
    from specinfer.engine.layers.embedding import CodedTable
    from specinfer.engine.layers.linear import can_pack
    from specinfer.engine.runtime.memory import weight_bytes

    out, _ = built
    if is_tied:  # the same draft with its head tied to the embedding, as a pretrained LLM's often is
        shutil.copytree(out, tmp_path / "tied")
        out = tmp_path / "tied"
        raw = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps(raw | {"tie_word_embeddings": True}))
        weights = load_file(str(out / "model.safetensors"))
        weights.pop("lm_head.weight")
        save_file(weights, str(out / "model.safetensors"))
    cfg = ModelConfig.from_dir(out)
    assert cfg.tie_word_embeddings == is_tied and 0 < len(cfg.head_token_ids) < cfg.vocab_size
    if not cpu_gemm.available() or (dtype == "bfloat16" and not can_pack(torch.device("cpu"), torch.bfloat16)):
        pytest.skip("the CPU kernel (or oneDNN's bfloat16) is not here")
    held = 0
    for t in {id(t): t for t in ModelRunner.from_dir(out, dtype, "cpu", 64).model.w.values()}.values():
        held += t.nbytes() if isinstance(t, CodedTable) else t.numel() * t.element_size()  # a tensor or panels
    assert 0.99 * held <= weight_bytes(out, dtype) <= 1.1 * held
