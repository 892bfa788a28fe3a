"""`specinfer make-draft`: a speculative model for any LLM, distilled from it in minutes on a CPU.

SpecInfer (arXiv 2305.09781, Section 3) speculates with small speculative models (SSMs) that
are "distilled, quantized, and/or pruned variants" of the LLM and aligns them with it on the
LLM's own outputs. This command does both within a time budget, in one go:

1. **Cut.** The draft starts as a few of the LLM's own layers with its embeddings, final norm and
   LM head (`specinfer.pool.make_ssm`): it speaks the LLM's vocabulary and reads its hidden
   states with the LLM's own head.
2. **Teacher data.** The LLM answers prompts: seed chat prompts shipped with the package
   (`specinfer/pool/data/seed_prompts.jsonl`), rendered with the LLM's chat template, or windows
   of a corpus the user names. Half the answers are greedy, half sampled at the serving
   temperature (the contexts a stochastic request visits), generated in lockstep batches, and the
   LLM's top-k distribution at every answer position is kept, taken from the logits the
   generation computed, with no second pass of the LLM (`specinfer.pool.boost_data`).
   Batches are generated until the data's share of the budget is spent.
3. **Distillation.** The cut layers (and final norm) are trained on those positions with
   cross-entropy on the LLM's top-1 plus the cross-entropy against its top-k distribution
   (`boost_tune.Trainer`, `boost_tune.boost_loss`); the embeddings and LM head stay the LLM's
   (frozen: the head is most of a small draft's parameters, and training it would cost the most).
   The number of steps is set from the measured cost of the first steps, to end within budget.
4. **A reduced vocabulary.** The draft's head keeps the LLM's `--vocab` most frequent answer
   tokens (written into its config.json): most of a small draft's pass is its head, and the
   tokens it drops are ones the LLM rarely answers with. It only ever proposes; the LLM decides.
   The distillation's softmax is over those tokens too, the distribution the draft proposes
   from, and its head costs a training step that fraction of the whole vocabulary's.
5. **The LLM's answers.** The teacher answers themselves (token ids) are stored with the draft
   (`DRAFT_ANSWERS_FILE`): the suffix member of the pool drafts the LLM's habitual phrasing from
   them (`specinfer.engine.drafting.suffix`), at no model pass.
6. **Measurement.** Top-1 agreement with the LLM on held-out prompts, before and after (with the
   reduced head, as the draft will propose), the held-out answers' coverage by its vocabulary, and the
   greedy chain acceptance by depth (the chance that the first k drafted tokens are all the
   LLM's); the draft's and the LLM's one-token pass costs.

The draft is an ordinary checkpoint directory (safetensors, config, the LLM's tokenizer files)
that `--ssm` loads, with ``make_draft.json`` recording how it was built and what it measured.
The work in progress (the cut, the teacher data, training checkpoints) lives in a hidden sibling
of the output, so an interrupted build resumes from it with the same command; the output
directory appears only when the draft is complete.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import torch
from safetensors.torch import load_file, save_file

from specinfer.chat_template import ChatRenderer, ChatTemplate
from specinfer.engine.llm_engine import Engine
from specinfer.engine.models.config import DRAFT_ANSWERS_FILE, DRAFT_RECORD_FILE, DRAFT_VOCAB_KEY, ModelConfig
from specinfer.engine.runtime.load import read_prompts
from specinfer.engine.runtime.runner import ModelRunner, chain_work
from specinfer.errors import UserError
from specinfer.model_source import resolve
from specinfer.pool.boost_data import (
    BoostData, assemble, draw_prompts, generate_continuations, newline_token_ids, split_regions, targets_for,
)
from specinfer.pool.boost_tune import Trainer, agreement, load_model
from specinfer.pool.make_ssm import PROVENANCE_NAME as CUT_DONE
from specinfer.pool.make_ssm import check_fraction, copy_tokenizer_files, make_ssm, parse_layers
from specinfer.pool.tuning_config import DraftConfig, TrainConfig
from specinfer.tokenizer import TextTokenizer
from specinfer.util import progress_bar, quiet_transformers, staged_dir, write_atomic, write_json


SEED_PROMPTS = Path(__file__).parent / "data" / "seed_prompts.jsonl"
RUN_FORMAT = 1
MAX_DEPTH = 8  # acceptance is reported for depths 1..MAX_DEPTH
TIMING_STEPS = 3  # training steps timed before the step count is set (all within warmup)
WARMUP_STEPS = 10


@dataclass(frozen=True)
class DraftPlan:
    """One build: the LLM, the output directory, where its work in progress lives, the settings."""

    llm: Path
    out: Path
    cfg: DraftConfig
    corpus: Path | None = None
    cache_dir: Path | None = None

    @property
    def work(self) -> Path:
        return self.out.parent / f".{self.out.name}.make-draft"

    def run_record(self) -> dict:
        """What must match for a build to resume another's work (the time budget may differ)."""
        settings = {k: v for k, v in asdict(self.cfg).items() if k != "minutes"}
        return {"format": RUN_FORMAT, "llm": str(self.llm.resolve()),
                "corpus": str(self.corpus.resolve()) if self.corpus else None, "settings": settings}


class StoppedTime:
    """Seconds this process spent stopped (SIGSTOP, Ctrl-Z: `specinfer up` stops the demo draft's
    background build while the stack wants the CPUs), seen by a thread as gaps in its ticks."""

    def __init__(self, tick_s: float = 0.1, min_gap_s: float = 0.5):
        self.tick_s, self.min_gap_s = tick_s, min_gap_s
        self.stopped_s = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stopped-time", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        last = time.monotonic()
        while not self._done.wait(self.tick_s):
            now = time.monotonic()
            if now - last >= self.min_gap_s:  # a tick that came this late: the process was stopped
                self.stopped_s += now - last - self.tick_s
            last = now

    def close(self) -> None:
        self._done.set()
        self._thread.join()


class Clock:
    """The build's time budget: seconds since the start and seconds left, less the time the
    process spent stopped (`stopped`), which neither trains nor should shorten the training."""

    def __init__(self, minutes: float, now: Callable[[], float] = time.monotonic, stopped: StoppedTime | None = None):
        self.now = now
        self.start = now()
        self.budget_s = 60.0 * minutes
        self.stopped = stopped

    @property
    def stopped_s(self) -> float:
        return self.stopped.stopped_s if self.stopped is not None else 0.0

    @property
    def wall_s(self) -> float:
        return self.now() - self.start

    @property
    def elapsed_s(self) -> float:
        return self.wall_s - self.stopped_s

    @property
    def left_s(self) -> float:
        return self.budget_s - self.elapsed_s


def build_draft(llm: str | Path, out: str | Path, minutes: float | None = None, cache_dir: str | Path | None = None,
                progress: bool = True, corpus: str | Path | None = None, cfg: DraftConfig | None = None,
                overwrite: bool = False) -> dict:
    """Builds a draft for `llm` (a checkpoint directory or a GGUF file) at `out` within `minutes`
    (default `DraftConfig.minutes`) and returns its record (also written as `out/make_draft.json`).
    Resumes the work of an interrupted build of the same LLM and settings. UserError on bad input."""
    cfg = cfg or DraftConfig()
    if minutes is not None:
        cfg = replace(cfg, minutes=minutes)  # validated by DraftConfig
    plan = check_plan(Path(llm), Path(out), cfg, Path(corpus) if corpus else None,
                      Path(cache_dir) if cache_dir else None, overwrite)
    stopped = StoppedTime()
    try:
        return _build(plan, Clock(cfg.minutes, stopped=stopped), progress)
    finally:
        stopped.close()


def _build(plan: DraftPlan, clock: Clock, progress: bool) -> dict:
    """The build's stages: the cut, the teacher data, the distillation, the record."""
    cfg = plan.cfg
    say = (lambda line: print(f"make-draft: {line}", file=sys.stderr, flush=True)) if progress else (lambda line: None)
    cut = cut_draft(plan, say)
    train, evals = teacher_data(plan, clock, progress, say)
    vocab = draft_vocabulary(train, cfg.vocab, ModelConfig.from_dir(cut))
    record = distill(plan, cut, train, evals, clock, progress, say, vocab, answer_ids(train))
    if vocab is not None:  # the cut was timed with the whole head; the draft scores its vocabulary only
        record.update(draft_cost(record["llm_pass_ms"], plan.out))
    record["build_minutes"] = round(clock.wall_s / 60, 2)
    record["stopped_minutes"] = round(clock.stopped_s / 60, 2)
    write_json(plan.out / DRAFT_RECORD_FILE, record)

    shutil.rmtree(plan.work, ignore_errors=True)
    say(f"done in {record['build_minutes']} min: {plan.out}")
    return record


# ---- checks ----------------------------------------------------------------------------------


def check_plan(llm: Path, out: Path, cfg: DraftConfig, corpus: Path | None, cache_dir: Path | None,
               overwrite: bool) -> DraftPlan:
    """Every input checked before any weights load."""

    if not llm.exists():
        raise UserError(f"--llm {llm}: no such checkpoint directory or .gguf file")
    resolve(llm, cache_dir)  # a GGUF's metadata under --cache-dir; a bad file fails here
    llm_cfg = ModelConfig.from_dir(llm)  # missing config, unsupported architecture: UserError
    parse_layers(cfg.layers, llm_cfg.num_layers)
    check_fraction(cfg.mlp_keep)
    if out.resolve() == llm.resolve() or llm.resolve() in out.resolve().parents:
        raise UserError("--out must be outside the LLM's checkpoint")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"output directory {out} is not empty (pass --overwrite to replace it)")
    if corpus is not None and not corpus.is_file():
        raise UserError(f"--corpus {corpus}: no such file")
    if corpus is None:

        if ChatTemplate.from_dir(llm) is None:
            raise UserError(f"the LLM {llm} has no chat template to render the seed prompts with: "
                            "give --corpus FILE (text like what it will serve)")
    plan = DraftPlan(llm, out, cfg, corpus, cache_dir)
    record_path = plan.work / "run.json"
    if record_path.is_file() and json.loads(record_path.read_text()) != json.loads(json.dumps(plan.run_record())):

        shutil.rmtree(plan.work)  # another LLM or other settings: its work does not apply
    plan.work.mkdir(parents=True, exist_ok=True)
    write_json(record_path, plan.run_record())
    return plan


# ---- 1. the cut ------------------------------------------------------------------------------


def cut_draft(plan: DraftPlan, say) -> Path:

    cut = plan.work / "cut"
    if not (cut / CUT_DONE).is_file():
        say(f"cutting layers {plan.cfg.layers} of {plan.llm.name}")
        make_ssm(plan.llm, cut, plan.cfg.layers, plan.cfg.mlp_keep, overwrite=True)
    return cut


# ---- 2. teacher data -------------------------------------------------------------------------


def read_seed_prompts(path: Path = SEED_PROMPTS) -> list[list[dict]]:
    """The message lists of a JSONL file of {"messages": [...]} lines."""

    return [p for p in read_prompts(path, allow_messages=True) if isinstance(p, list)]


def chat_prompt_ids(llm: Path, tokenizer, conversations: Sequence[list[dict]]) -> list[list[int]]:

    renderer = ChatRenderer(ChatTemplate.from_dir(llm))
    return [tokenizer.encode(renderer.render(messages)) for messages in conversations]


def corpus_prompt_ids(corpus: Path, tokenizer, cfg: DraftConfig, count: int) -> tuple[list[list[int]], list[list[int]]]:
    """(training prompts, held-out prompts): windows of the corpus file at line starts."""

    ids = tokenizer.tok.encode_batch([corpus.read_text(encoding="utf-8", errors="replace")],
                                     add_special_tokens=False)[0].ids
    min_len = max(1, cfg.prompt_tokens // 2)
    train, evals = split_regions([ids], newline_token_ids(tokenizer), 0.1, min_len)
    if not train or not evals:
        raise UserError(f"--corpus {corpus}: too short for prompts of {min_len} tokens")
    return (draw_prompts(train, count, min_len, cfg.prompt_tokens, cfg.seed * 2),
            draw_prompts(evals, cfg.eval_prompts, min_len, cfg.prompt_tokens, cfg.seed * 2 + 1))


def split_seed_prompts(prompts: Sequence[list[int]], num_eval: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """A seeded held-out subset of `num_eval` prompts (at most a quarter), and the rest shuffled."""
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    num_eval = min(num_eval, max(1, len(prompts) // 4))
    return [list(prompts[i]) for i in order[num_eval:]], [list(prompts[i]) for i in order[:num_eval]]


def teacher_data(plan: DraftPlan, clock: Clock, progress: bool, say) -> tuple[BoostData, BoostData]:
    """(training data, held-out data), generated by the LLM until the data's share of the budget
    is spent; each finished batch is stored, so a resumed build keeps what was generated."""


    cfg = plan.cfg
    data_dir = plan.work / "data"
    data_dir.mkdir(exist_ok=True)
    done = plan.work / "data.done"
    have = sorted(data_dir.glob("batch-*.safetensors"))
    if done.is_file() and have and (plan.work / "costs.json").is_file():
        return concat_batches(have, "train"), BoostData.from_tensors(load_file(str(data_dir / "eval.safetensors")), "eval")
    llm_cfg = ModelConfig.from_dir(plan.llm)
    tokenizer = TextTokenizer.from_dir(plan.llm, llm_cfg.eos_token_ids)
    if plan.corpus is not None:
        train_prompts, eval_prompts = corpus_prompt_ids(plan.corpus, tokenizer, cfg, 4096)
    else:
        ids = chat_prompt_ids(plan.llm, tokenizer, read_seed_prompts())
        train_prompts, eval_prompts = split_seed_prompts(ids, cfg.eval_prompts, cfg.seed)
    longest = max(len(p) for p in train_prompts + eval_prompts) + cfg.continuation_tokens + 16
    say(f"loading the LLM ({llm_cfg.num_layers} layers) for teacher data")
    llm = ModelRunner.from_dir(plan.llm, "float32", "cpu", max_kv_tokens=(cfg.gen_batch_size + 1) * longest)
    engine = Engine.from_runners(llm)
    if not (plan.work / "costs.json").is_file():
        write_json(plan.work / "costs.json", pass_costs(llm, plan.work / "cut"))
    data_cfg = cfg.data_config()
    eval_path = data_dir / "eval.safetensors"
    if not eval_path.is_file():
        greedy = replace(data_cfg, sampled_fraction=0.0)
        evals = _teacher_batch(engine, eval_prompts, greedy, cfg.seed * 7919 + 1, progress)
        write_atomic(eval_path, lambda tmp: save_file(evals.to_tensors("eval"), str(tmp)))
    evals = BoostData.from_tensors(load_file(str(eval_path)), "eval")
    data_end_s = clock.elapsed_s + cfg.data_share * clock.left_s
    index = len(have)
    batch_s = 0.0
    with progress_bar(max(1, round(data_end_s - clock.elapsed_s)), "teacher data (s)", progress) as bar:
        while index == 0 or (clock.elapsed_s + batch_s <= data_end_s  # one more batch fits
                             and not 0 < cfg.max_batches <= index):
            started = clock.elapsed_s
            lo = index * cfg.gen_batch_size
            chunk = [train_prompts[(lo + k) % len(train_prompts)] for k in range(cfg.gen_batch_size)]
            batch = _teacher_batch(engine, chunk, data_cfg, cfg.seed * 7919 + 2 + index, progress)
            path = data_dir / f"batch-{index:04d}.safetensors"
            write_atomic(path, lambda tmp: save_file(batch.to_tensors("train"), str(tmp)))
            index += 1
            batch_s = clock.elapsed_s - started
            bar.update(min(round(batch_s), bar.total - bar.n))
            bar.set_postfix(answers=index * cfg.gen_batch_size)
    done.write_text(json.dumps({"batches": index}))
    del engine, llm
    train = concat_batches(sorted(data_dir.glob("batch-*.safetensors")), "train")
    say(f"teacher data: {len(train)} answers, {train.num_positions} positions "
        f"({evals.num_positions} held out) in {clock.elapsed_s / 60:.1f} min")
    return train, evals


def _teacher_batch(engine, prompts: Sequence[list[int]], data_cfg, seed: int, progress: bool) -> BoostData:

    continuations, sampled, logprobs = generate_continuations(engine, prompts, data_cfg, seed, progress)
    keep = [n for n, c in enumerate(continuations) if len(c) >= 2] or [0]  # an answer that ends at once teaches
    prompts, continuations, sampled, logprobs = ([xs[n] for n in keep]  # nothing (one kept: never an empty batch)
                                                 for xs in (prompts, continuations, sampled, logprobs))
    scores = targets_for(prompts, continuations, sampled, logprobs, data_cfg.kl_top_k, data_cfg.temperature)
    return assemble(prompts, continuations, sampled, scores, data_cfg.kl_top_k)


def concat_batches(paths: Sequence[Path], prefix: str) -> BoostData:
    """Batches of teacher data as one, padded to the widest."""

    parts = [BoostData.from_tensors(load_file(str(p)), prefix) for p in paths]
    width = max(p.tokens.shape[1] for p in parts)

    def pad(t: torch.Tensor) -> torch.Tensor:
        if t.dim() < 2 or t.shape[1] == width:
            return t
        shape = list(t.shape)
        shape[1] = width - t.shape[1]
        return torch.cat([t, torch.zeros(shape, dtype=t.dtype)], dim=1)

    return BoostData(**{name: torch.cat([pad(getattr(p, name)) for p in parts])
                        for name in ("tokens", "lengths", "targets", "mask", "sampled", "topk_ids", "topk_probs")})


# ---- 3. distillation -------------------------------------------------------------------------


def freeze_vocabulary(model) -> None:
    """Keeps the LLM's embeddings and LM head as they are (tied or not): only the layers and the
    final norm train."""
    model.get_input_embeddings().weight.requires_grad_(False)
    head = model.get_output_embeddings()
    if head is not None:
        head.weight.requires_grad_(False)


def draft_vocabulary(train: BoostData, size: int, cfg: ModelConfig) -> torch.Tensor | None:
    """The `size` tokens the draft's head keeps (sorted ids), None for the whole vocabulary: the
    LLM's most frequent answer tokens, by its top-1 at every answer position plus the probability
    its top-k gives each token there (the tokens sampled answers take), and its EOS tokens."""
    if not 0 < size < cfg.vocab_size:
        return None
    mask = train.mask
    score = torch.bincount(train.targets[mask], minlength=cfg.vocab_size).double()
    if train.topk_ids.shape[-1]:
        score += torch.bincount(train.topk_ids[mask].flatten(), weights=train.topk_probs[mask].flatten().double(),
                                minlength=cfg.vocab_size)
    eos = [i for i in cfg.eos_token_ids if 0 <= i < cfg.vocab_size]
    score[eos] = float("inf")
    # Ties (tokens the answers never used, most of them) go to the lower ids: a BPE vocabulary
    # numbers its tokens in merge order, the commoner first.
    order = torch.arange(cfg.vocab_size, dtype=torch.float64) / cfg.vocab_size
    return torch.topk(score - order * 1e-6, size).indices.sort().values


def coverage(vocab: torch.Tensor | None, data: BoostData) -> float:
    """The share of the LLM's top-1 answer tokens of `data` that `vocab` holds."""
    targets = data.targets[data.mask]
    return 1.0 if vocab is None or not len(targets) else float(torch.isin(targets, vocab).float().mean())


def answer_ids(data: BoostData) -> list[list[int]]:
    """The LLM's answers in `data` (each row's tokens after its prompt)."""
    out = []
    for n in range(len(data)):
        positions = data.mask[n].nonzero()
        if len(positions):  # position j predicts token j + 1: the answer starts after the first
            out.append(data.tokens[n, int(positions[0]) + 1:int(data.lengths[n])].tolist())
    return out


def distill(plan: DraftPlan, cut: Path, train: BoostData, evals: BoostData, clock: Clock, progress: bool,
            say, vocab: torch.Tensor | None = None, answers: Sequence[list[int]] = ()) -> dict:


    cfg = plan.cfg
    model = load_model(cut, "cpu")
    freeze_vocabulary(model)
    before_path = plan.work / "before.safetensors"
    if not before_path.is_file():
        before = agreement(model, evals, 8, "cpu", progress, "agreement before", vocab)
        write_atomic(before_path, lambda tmp: _save({"agree": before}, tmp))
    before = load_file(str(before_path))["agree"]
    steps_path = plan.work / "steps.json"
    ckpt = plan.work / "ckpt"
    weights = train.mask.clone()
    train_cfg = distill_config(cfg, max(TIMING_STEPS + 1, WARMUP_STEPS * 2))
    trainer = Trainer(model, train_cfg, 0, "cpu", vocab)
    trainer.resume_from(ckpt)
    if cfg.steps:
        steps = cfg.steps
    elif steps_path.is_file():
        steps = json.loads(steps_path.read_text())["steps"]
    else:  # time a few steps (in warmup, whose learning rate does not depend on the step count)
        trainer.cfg = replace(train_cfg, steps=TIMING_STEPS)
        started = clock.elapsed_s
        trainer.fit(train, weights, ckpt, False, None)
        step_s = (clock.elapsed_s - started) / TIMING_STEPS
        steps = max(TIMING_STEPS, TIMING_STEPS + int((clock.left_s - eval_reserve_s(evals, cfg, step_s)) / step_s))
        write_json(steps_path, {"steps": steps, "step_s": round(step_s, 3)})
        say(f"distilling: {steps} steps of {step_s:.2f} s")
    trainer.cfg = replace(train_cfg, steps=steps)
    on_step = None if cfg.steps else _keep_to_budget(trainer, clock, eval_reserve_s(evals, cfg), steps_path)
    trainer.fit(train, weights, ckpt, progress, on_step)
    steps = trainer.cfg.steps
    after = agreement(model, evals, 8, "cpu", progress, "agreement after", vocab)
    cost = json.loads((plan.work / "costs.json").read_text())
    record = {
        "from_llm": str(plan.llm.resolve()), "layers": json.loads((cut / "make_ssm.json").read_text())["layers"],
        "mlp_keep": cfg.mlp_keep, "source": "corpus" if plan.corpus else "seed chat prompts",
        "corpus": str(plan.corpus) if plan.corpus else None,
        "train_answers": len(train), "train_positions": train.num_positions, "eval_positions": evals.num_positions,
        "steps": steps, "final_loss": trainer.last_loss,
        "agreement_before": rate(before, evals.mask), "agreement_after": rate(after, evals.mask),
        "acceptance_by_depth_before": acceptance_by_depth(before, evals.mask),
        "acceptance_by_depth_after": acceptance_by_depth(after, evals.mask),
        "vocab_size": len(vocab) if vocab is not None else model.config.vocab_size,
        "vocab_coverage": round(coverage(vocab, evals), 4),
        "answers": len(answers), "answer_tokens": sum(map(len, answers)),
        **cost, "settings": asdict(cfg),
    }
    save_draft(model, plan, record, vocab, answers)
    say(f"held-out top-1 agreement {record['agreement_before']:.1%} -> {record['agreement_after']:.1%}; "
        f"chain acceptance by depth {record['acceptance_by_depth_after']}")
    return record


def distill_config(cfg: DraftConfig, steps: int, checkpoint_every: int = 25) -> TrainConfig:
    """The distillation's training settings for `steps` steps."""
    return TrainConfig(steps=steps, batch_size=cfg.batch_size, lr=cfg.lr, kl_weight=cfg.kl_weight,
                       warmup_steps=WARMUP_STEPS, checkpoint_every=checkpoint_every, seed=cfg.seed)


def eval_reserve_s(evals: BoostData, cfg: DraftConfig, step_s: float | None = None) -> float:
    """Seconds kept for the held-out agreement (a forward pass per batch: under a training step's
    cost) and saving; without a measured step cost, a rough allowance."""
    return 15.0 + (1.2 * step_s * len(evals) / cfg.batch_size if step_s else 30.0)


def _keep_to_budget(trainer, clock: Clock, reserve_s: float, steps_path: Path):
    """A step hook that shortens the run when the measured pace says it would overrun the budget
    (a busy machine slows training down): the steps left are what the time left allows."""
    started, first = clock.elapsed_s, trainer.step

    def check(_index: int, done: int) -> None:
        if (done - first) % 10 or done == first:
            return
        step_s = (clock.elapsed_s - started) / (done - first)
        fits = done + max(1, int((clock.left_s - reserve_s) / step_s))
        if fits < trainer.cfg.steps:
            trainer.cfg = replace(trainer.cfg, steps=fits)
            write_json(steps_path, {"steps": fits, "step_s": round(step_s, 3)})

    return check


def _save(tensors: dict, path: Path) -> None:

    save_file(tensors, str(path))


def rate(hits: torch.Tensor, mask: torch.Tensor) -> float:
    return round(int((hits & mask).sum()) / max(1, int(mask.sum())), 4)


def acceptance_by_depth(agree: torch.Tensor, mask: torch.Tensor, max_depth: int = MAX_DEPTH) -> list[float]:
    """Entry k - 1: over held-out positions j with k positions left, the share where the draft's
    top-1 equals the LLM's at j, j + 1, ..., j + k - 1 (a greedy chain of k drafted tokens all
    accepted: once accepted, the draft's context is the LLM's own, as it was in teacher forcing)."""
    out = []
    run = mask.clone()  # run[:, j]: positions j .. j + k - 1 all agree (and all lie in the mask)
    hits = agree & mask
    streak = hits.clone()
    for k in range(1, max_depth + 1):
        if k > 1:
            streak = streak[:, :-1] & hits[:, k - 1:]
            run = run[:, :-1] & mask[:, k - 1:]
        total = int(run.sum())
        if total == 0:
            break
        out.append(round(int((streak & run).sum()) / total, 4))
    return out


def one_token_ms(runner, reps: int = 7) -> float:
    """Median milliseconds of a one-token pass of `runner` after a 64-token context."""
    seq = runner.new_sequence()
    try:
        runner.prefill(seq, list(range(3, 67)))
        times = []
        with torch.no_grad():
            for _ in range(reps):
                start = time.perf_counter()
                runner.run([chain_work(seq, [7], "last")])
                times.append(time.perf_counter() - start)
        return 1000 * sorted(times)[reps // 2]
    finally:
        seq.free()


def pass_costs(llm_runner, draft: Path, reps: int = 7) -> dict:
    """Median milliseconds of a one-token pass (after a 64-token context) of the LLM and of the
    draft (its shape: training changes no cost), both in the engine's runner: the price of one
    drafted token against one LLM step."""
    llm_ms = one_token_ms(llm_runner, reps)
    return draft_cost(llm_ms, draft, reps)


def draft_cost(llm_ms: float, draft: Path, reps: int = 7) -> dict:
    """The draft's one-token pass against the LLM's `llm_ms` (see `pass_costs`)."""
    draft_ms = one_token_ms(ModelRunner.from_dir(draft, "float32", "cpu", max_kv_tokens=256), reps)
    return {"llm_pass_ms": round(llm_ms, 2), "draft_pass_ms": round(draft_ms, 2),
            "draft_to_llm_pass_cost": round(draft_ms / llm_ms, 3)}


def save_draft(model, plan: DraftPlan, record: dict, vocab: torch.Tensor | None = None,
               answers: Sequence[list[int]] = ()) -> None:
    """The draft as an ordinary checkpoint with the LLM's tokenizer files, at `plan.out`; its
    reduced vocabulary, if any, in its config.json (`DRAFT_VOCAB_KEY`, which other readers ignore),
    and the LLM's `answers` it was built from in `DRAFT_ANSWERS_FILE`."""

    with staged_dir(plan.out) as tmp:
        with quiet_transformers():
            model.save_pretrained(tmp, safe_serialization=True)
        if vocab is not None:
            config = json.loads((tmp / "config.json").read_text())
            config[DRAFT_VOCAB_KEY] = vocab.tolist()
            write_json(tmp / "config.json", config)
        if answers:
            save_file({"tokens": torch.tensor([t for a in answers for t in a], dtype=torch.int32),
                       "lengths": torch.tensor([len(a) for a in answers], dtype=torch.int32)},
                      str(tmp / DRAFT_ANSWERS_FILE))
        copy_tokenizer_files(resolve(plan.llm).meta_dir, tmp)
        gen = resolve(plan.llm).meta_dir / "generation_config.json"
        if gen.is_file() and not (tmp / "generation_config.json").is_file():
            (tmp / "generation_config.json").write_bytes(gen.read_bytes())
        write_json(tmp / DRAFT_RECORD_FILE, record)


# ---- command line ----------------------------------------------------------------------------


def config_from_args(args: argparse.Namespace) -> DraftConfig:
    return DraftConfig(minutes=args.minutes, layers=args.layers, mlp_keep=args.mlp_keep, seed=args.seed,
                       vocab=args.vocab)


def run_make_draft(args: argparse.Namespace) -> int:
    record = build_draft(args.llm, args.out, cache_dir=args.cache_dir, progress=not args.quiet, corpus=args.corpus,
                         cfg=config_from_args(args), overwrite=args.overwrite)
    print(json.dumps({"out": str(args.out), "build_minutes": record["build_minutes"],
                      "agreement_before": record["agreement_before"], "agreement_after": record["agreement_after"],
                      "acceptance_by_depth": record["acceptance_by_depth_after"],
                      "draft_to_llm_pass_cost": record["draft_to_llm_pass_cost"]}))
    return 0
