"""`specinfer boost-tune`: collective boost-tuning of an SSM pool (SpecInfer Section 3).

SpecInfer (arXiv 2305.09781) aligns a pool of small speculative models (SSMs) with the LLM by an
unsupervised, AdaBoost-like procedure, "collective boost-tuning":

1. take prompts from a corpus and let the LLM generate continuations (`specinfer.pool.boost_data`);
2. fine-tune SSM 1 to reproduce the LLM on all of them;
3. mark the samples where SSM 1 now reproduces the LLM, and fine-tune SSM 2 on the rest;
4. and so on through the pool: SSM k trains on what none of SSMs 1..k-1 got right.

**What a sample is here: a position.** A sample is one continuation position (a context and the
LLM's next token there). SSM k has it right when its top-1 token equals the LLM's top-1 token,
which is exactly when its width-1 draft at that node would be accepted by greedy verification.
Sequences would be too coarse: a small SSM almost never reproduces a whole 64-token
continuation, so "drop the sequences SSM 1 got right" would drop nothing. SSM k still reads
every context in full; only its loss is restricted to the positions the earlier SSMs missed.

**Loss.** Cross-entropy on the LLM's top-1 tokens (the continuation tokens, for greedy
continuations), plus optionally ``kl_weight`` times the cross-entropy against the LLM's top
``kl_top_k`` probabilities (forward KL to the truncated, renormalised LLM distribution, up to a
constant): useful for stochastic serving, where the whole distribution matters.

**Determinism and resuming.** Data is built once from the seed and stored. Training batches and
the learning rate are pure functions of (seed, SSM index, step), so a run resumed from a
checkpoint (weights + AdamW moments, every ``checkpoint_every`` steps, written atomically) ends
with the same weights as an uninterrupted one. Everything is stored as safetensors/JSON.

Layout of ``OUT``: ``ssm-<i>-<name>/`` (tuned checkpoints, in pool order), ``summary.json``, and
``.boost/`` (the run's state: config, data, per-SSM checkpoints and agreement marks).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from specinfer.pool.boost_data import BoostData, build_data, read_corpus
from specinfer.pool.tuning_config import DataConfig, TrainConfig
from specinfer.errors import UserError
from specinfer.util import progress_bar, quiet_transformers, staged_dir, write_atomic, write_json
from safetensors.torch import load_file, save_file
from specinfer.engine.models.config import ModelConfig
from specinfer.engine.runtime.runner import ModelRunner
from specinfer.tokenizer import TextTokenizer
from specinfer.pool.hf_model import load_hf_model
from specinfer.model_source import resolve
from specinfer.pool.make_ssm import copy_tokenizer_files
from specinfer.engine.runtime.load import ModelPaths, check_models, resolve_device
from safetensors import safe_open

STATE_DIR = ".boost"
RUN_FORMAT = 1
SUMMARY_NAME = "summary.json"
DONE_NAME = "boost.json"


@dataclass(frozen=True)
class BoostConfig:
    llm: Path
    ssms: tuple[Path, ...]
    corpus: tuple[Path, ...]
    out: Path
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    device: str = "cpu"

    def run_record(self) -> dict:
        """What must match for `--resume` to continue a run (the output dir and device may differ)."""
        return {"format": RUN_FORMAT, "llm": str(self.llm.resolve()), "ssms": [str(s.resolve()) for s in self.ssms],
                "corpus": [str(c) for c in self.corpus], "data": asdict(self.data), "train": asdict(self.train)}

    def ssm_names(self) -> list[str]:
        return [f"ssm-{i}-{resolve(p.resolve()).name}" for i, p in enumerate(self.ssms)]


StepHook = Callable[[int, int], None]  # (ssm index, steps done) after every optimizer step


# ---- the run ---------------------------------------------------------------------------------


def boost_tune(cfg: BoostConfig, resume: bool = False, progress: bool = True, on_step: StepHook | None = None) -> dict:
    """Boost-tunes every SSM of the pool in order; returns (and writes) the summary."""
    state = _prepare_state(cfg, resume)
    train, evals = load_or_build_data(cfg, state, progress)
    agreed = torch.zeros_like(train.mask)  # positions some earlier SSM already gets right
    entries = []
    for i, (source, name) in enumerate(zip(cfg.ssms, cfg.ssm_names())):
        entry, agree = tune_one(cfg, state, i, source, cfg.out / name, train, evals, agreed, progress, on_step)
        agreed |= agree
        entries.append(entry)
    summary = make_summary(cfg, state, entries, train, evals)
    write_json(cfg.out / SUMMARY_NAME, summary)
    if progress:
        print(format_summary(summary), file=sys.stderr)
    return summary


def _prepare_state(cfg: BoostConfig, resume: bool) -> Path:
    state = cfg.out / STATE_DIR
    record_path = state / "run.json"
    record = cfg.run_record()
    if record_path.is_file():
        if not resume:
            raise UserError(f"{cfg.out} already holds a boost-tune run: pass --resume to continue it, or another --out")
        if json.loads(record_path.read_text()) != json.loads(json.dumps(record)):
            raise UserError(f"--resume: the run in {cfg.out} was started with different models, corpus or settings")
        return state
    if cfg.out.exists() and any(p.name != STATE_DIR for p in cfg.out.iterdir()):
        raise UserError(f"output directory {cfg.out} is not empty")
    state.mkdir(parents=True, exist_ok=True)
    write_json(record_path, record)
    return state


def load_or_build_data(cfg: BoostConfig, state: Path, progress: bool) -> tuple[BoostData, BoostData]:
    path = state / "data.safetensors"
    if path.is_file():
        tensors = load_file(str(path))
        return BoostData.from_tensors(tensors, "train"), BoostData.from_tensors(tensors, "eval")
    d = cfg.data
    kv_tokens = max(d.gen_batch_size, 8) * (d.prompt_tokens + d.continuation_tokens + 16)
    llm = ModelRunner.from_dir(cfg.llm, "float32", cfg.device, max_kv_tokens=kv_tokens)
    tokenizer = TextTokenizer.from_dir(cfg.llm, ModelConfig.from_dir(cfg.llm).eos_token_ids)
    train, evals = build_data(llm, tokenizer, cfg.corpus, d, progress)
    write_atomic(path, lambda tmp: save_file({**train.to_tensors("train"), **evals.to_tensors("eval")}, str(tmp)))
    return train, evals


def tune_one(cfg: BoostConfig, state: Path, index: int, source: Path, final_dir: Path, train: BoostData,
             evals: BoostData, agreed: torch.Tensor, progress: bool, on_step: StepHook | None) -> tuple[dict, torch.Tensor]:
    """Tunes SSM `index` on the positions no earlier SSM gets right; returns its summary entry and
    the training positions it gets right afterwards."""
    ssm_state = state / f"ssm-{index}"
    ssm_state.mkdir(exist_ok=True)
    if (final_dir / DONE_NAME).is_file():  # finished in an earlier (interrupted) run
        marks = load_file(str(ssm_state / "marks.safetensors"))
        return json.loads((final_dir / DONE_NAME).read_text()), marks["train_agree"]
    model = load_model(source, cfg.device)
    before_path = ssm_state / "before.safetensors"
    if not before_path.is_file():
        before = agreement(model, evals, cfg.train.eval_batch_size, cfg.device, progress, f"SSM {index} before")
        write_atomic(before_path, lambda tmp: save_file({"eval_agree": before}, str(tmp)))
    before = load_file(str(before_path))["eval_agree"]
    weights = train.mask & ~agreed
    trainer = Trainer(model, cfg.train, index, cfg.device)
    trainer.resume_from(ssm_state / "ckpt")
    trainer.fit(train, weights, ssm_state / "ckpt", progress, on_step)
    after = agreement(model, evals, cfg.train.eval_batch_size, cfg.device, progress, f"SSM {index} after")
    train_agree = agreement(model, train, cfg.train.eval_batch_size, cfg.device, progress, f"SSM {index} marks")
    write_atomic(ssm_state / "marks.safetensors",
            lambda tmp: save_file({"train_agree": train_agree, "eval_agree": after, "train_weights": weights}, str(tmp)))
    entry = {
        "index": index, "name": final_dir.name, "source": str(source), "checkpoint": str(final_dir),
        "train_positions": int(weights.sum()), "train_positions_total": train.num_positions,
        "steps": cfg.train.steps if int(weights.sum()) else 0, "final_loss": trainer.last_loss,
        "eval_agreement_before": _rate(before, evals.mask), "eval_agreement_after": _rate(after, evals.mask),
        "train_agreement_after": _rate(train_agree, train.mask),
    }
    save_final(model, source, final_dir, entry)
    return entry, train_agree


# ---- training --------------------------------------------------------------------------------


class Trainer:
    """AdamW on one SSM; batches and learning rate depend only on (seed, SSM index, step)."""

    def __init__(self, model, cfg: TrainConfig, index: int, device: str, vocab: torch.Tensor | None = None):
        self.model = model
        self.cfg = cfg
        self.index = index
        self.device = device
        # A draft's reduced vocabulary (sorted token ids): it proposes from those tokens alone, so
        # it trains on a softmax over them, which its head scores at a fraction of the whole's cost.
        self.vocab = None if vocab is None else vocab.to(device)
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}  # frozen ones stay
        # A frozen head's rows for that vocabulary are gathered once, not at every step.
        self.frozen_head = None
        if self.vocab is not None and not any(p.requires_grad for p in model.lm_head.parameters()):
            self.frozen_head = tuple(None if t is None else t.detach() for t in vocab_head(model, self.vocab))
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=cfg.lr, betas=(0.9, 0.95),
                                           weight_decay=cfg.weight_decay, foreach=False)
        self.step = 0
        self.last_loss: float | None = None

    def lr_at(self, step: int) -> float:
        cfg = self.cfg
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        factor = cfg.min_lr_factor + (1 - cfg.min_lr_factor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return cfg.lr * factor

    def batch_rows(self, eligible: torch.Tensor, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(((self.cfg.seed * 1_000_003) + self.index) * 1_000_003 + step)
        picks = torch.randint(0, len(eligible), (self.cfg.batch_size,), generator=gen)
        return eligible[picks]

    def fit(self, data: BoostData, weights: torch.Tensor, ckpt: Path, progress: bool, on_step: StepHook | None) -> None:
        eligible = torch.nonzero(weights.any(dim=1)).flatten()
        if len(eligible) == 0:
            return  # every position is already right: nothing to train on
        self.model.train()
        with progress_bar(self.cfg.steps, f"SSM {self.index} tuning", progress, initial=self.step) as bar:
            while self.step < self.cfg.steps:
                rows = self.batch_rows(eligible, self.step)
                loss = self.train_step(data, weights, rows)
                self.step += 1
                self.last_loss = round(loss, 5)
                if self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.steps:
                    self.save(ckpt)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}")
                if on_step is not None:
                    on_step(self.index, self.step)
        self.model.eval()

    def train_step(self, data: BoostData, weights: torch.Tensor, rows: torch.Tensor) -> float:
        width = int(data.lengths[rows].max())
        w = weights[rows, :width]
        picked = torch.nonzero(w, as_tuple=True)  # only weighted positions need the LM head
        logits = logits_at(self.model, data.tokens[rows, :width].to(self.device), picked, self.vocab,
                           head=self.frozen_head)
        targets, topk_ids = data.targets[rows, :width][picked].to(self.device), data.topk_ids[rows, :width][picked]
        w, topk_probs = w[picked].float().to(self.device), data.topk_probs[rows, :width][picked].to(self.device)
        if self.vocab is not None:
            targets, w, topk_ids, topk_probs = in_vocabulary(self.vocab, targets, w, topk_ids.to(self.device),
                                                             topk_probs)
        loss = boost_loss(logits, targets, w, topk_ids.to(self.device), topk_probs, self.cfg.kl_weight)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    # -- checkpoints: weights + AdamW moments + step, as safetensors, replaced atomically --

    def save(self, ckpt: Path) -> None:
        tensors = {f"param.{n}": p.detach().cpu().contiguous() for n, p in self.params.items()}
        for n, p in self.params.items():
            st = self.optimizer.state.get(p)
            if st:
                tensors[f"exp_avg.{n}"] = st["exp_avg"].cpu().contiguous()
                tensors[f"exp_avg_sq.{n}"] = st["exp_avg_sq"].cpu().contiguous()
                tensors[f"adam_step.{n}"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1).cpu()
        meta = {"step": str(self.step), "last_loss": json.dumps(self.last_loss)}
        write_atomic(ckpt.with_suffix(".safetensors"), lambda tmp: save_file(tensors, str(tmp), metadata=meta))

    def resume_from(self, ckpt: Path) -> None:
        path = ckpt.with_suffix(".safetensors")
        if not path.is_file():
            return
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(tensors[f"param.{n}"])
                if f"exp_avg.{n}" in tensors:
                    self.optimizer.state[p] = {
                        "step": tensors[f"adam_step.{n}"].reshape(()).clone(),
                        "exp_avg": tensors[f"exp_avg.{n}"].to(p.device),
                        "exp_avg_sq": tensors[f"exp_avg_sq.{n}"].to(p.device),
                    }
        self.step = int(meta["step"])
        self.last_loss = json.loads(meta["last_loss"])


def boost_loss(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, topk_ids: torch.Tensor,
               topk_probs: torch.Tensor, kl_weight: float) -> torch.Tensor:
    """Weighted mean over positions of CE(LLM top-1) + kl_weight * CE(renormalised LLM top-k).

    Positions of weight 0 (padding, prompts, positions an earlier SSM gets right) contribute
    nothing, neither to the loss nor to its gradient.
    """
    logp = F.log_softmax(logits, dim=-1)
    per_pos = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if kl_weight and topk_ids.shape[-1]:
        p = topk_probs / topk_probs.sum(-1, keepdim=True).clamp_min(1e-12)
        per_pos = per_pos - kl_weight * (p * logp.gather(-1, topk_ids)).sum(-1)
    per_pos = torch.where(weights > 0, per_pos, torch.zeros_like(per_pos))
    return (per_pos * weights).sum() / weights.sum().clamp_min(1.0)


def in_vocabulary(vocab: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, topk_ids: torch.Tensor,
                  topk_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Targets and top-k ids as indices into `vocab` (sorted token ids), for logits over those
    tokens alone: a position whose top-1 lies outside weighs nothing (the draft cannot propose it),
    and top-k tokens outside get probability 0 (the rest renormalise in `boost_loss`)."""
    def index(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        at = torch.searchsorted(vocab, ids).clamp_(max=len(vocab) - 1)
        return at, vocab[at] == ids

    at, is_in = index(targets)
    topk_at, topk_in = index(topk_ids)
    return (at, torch.where(is_in, weights, torch.zeros_like(weights)), topk_at,
            torch.where(topk_in, topk_probs, torch.zeros_like(topk_probs)))


def vocab_head(model, vocab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head's weight and bias rows of the tokens `vocab` (token ids)."""
    head = model.lm_head
    return head.weight[vocab], None if head.bias is None else head.bias[vocab]


def logits_at(model, tokens: torch.Tensor, picked: tuple[torch.Tensor, torch.Tensor],
              vocab: torch.Tensor | None = None, head: tuple[torch.Tensor, torch.Tensor | None] | None = None
              ) -> torch.Tensor:
    """(P, V) float32 logits of a causal LM at the positions `picked` = (rows, columns) of `tokens`
    (only those rows go through the LM head; soft-capped where the family caps its logits); with
    `vocab` (token ids), (P, len(vocab)): the logits of those tokens alone, from `head` when given
    (`vocab_head`'s rows, gathered once)."""
    hidden = model.model(input_ids=tokens, use_cache=False).last_hidden_state
    hidden = hidden[picked[0].to(hidden.device), picked[1].to(hidden.device)]
    if vocab is None:
        logits = model.lm_head(hidden)
    else:
        logits = F.linear(hidden, *(head or vocab_head(model, vocab)))
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits.float()


@torch.no_grad()
def agreement(model, data: BoostData, batch: int, device: str, progress: bool, desc: str,
              vocab: torch.Tensor | None = None) -> torch.Tensor:
    """(N, L) bool: the SSM's top-1 equals the LLM's top-1 (only inside `data.mask`); with
    `vocab` (token ids), the SSM's top-1 among those tokens only, as a draft with that reduced
    vocabulary proposes."""
    model.eval()
    out = torch.zeros_like(data.mask)
    vocab = None if vocab is None else vocab.to(device)
    head = None if vocab is None else vocab_head(model, vocab)
    with progress_bar(len(data), desc, progress) as bar:
        for lo in range(0, len(data), batch):
            rows = slice(lo, min(lo + batch, len(data)))
            width = int(data.lengths[rows].max())
            picked = torch.nonzero(data.mask[rows, :width], as_tuple=True)
            logits = logits_at(model, data.tokens[rows, :width].to(device), picked, vocab, head=head)
            top1 = (logits.argmax(-1) if vocab is None else vocab[logits.argmax(-1)]).cpu()
            block = torch.zeros_like(data.mask[rows, :width])
            block[picked] = top1 == data.targets[rows, :width][picked]
            out[rows, :width] = block
            bar.update(rows.stop - rows.start)
    return out


# ---- models and outputs ----------------------------------------------------------------------


def load_model(model_dir: Path, device: str):
    """An SSM (a checkpoint directory, safetensors only, or a GGUF file) as a float32
    transformers causal LM of its family."""
    return load_hf_model(model_dir, torch.float32, device)


def save_final(model, source: Path, out_dir: Path, entry: dict) -> None:
    """The tuned SSM as an ordinary HF checkpoint with the source's tokenizer (a GGUF's, as
    built from its metadata); `boost.json` last."""
    with staged_dir(out_dir) as tmp:
        with quiet_transformers():
            model.save_pretrained(tmp, safe_serialization=True)
        copy_tokenizer_files(resolve(source).meta_dir, tmp)
    write_json(out_dir / DONE_NAME, entry)


def make_summary(cfg: BoostConfig, state: Path, entries: list[dict], train: BoostData, evals: BoostData) -> dict:
    before_any = torch.zeros_like(evals.mask)
    after_any = torch.zeros_like(evals.mask)
    for i in range(len(entries)):
        before_any |= load_file(str(state / f"ssm-{i}" / "before.safetensors"))["eval_agree"]
        after_any |= load_file(str(state / f"ssm-{i}" / "marks.safetensors"))["eval_agree"]
    return {
        "llm": str(cfg.llm), "sample_unit": "position", "agreement": "SSM top-1 == LLM top-1",
        "train_sequences": len(train), "train_positions": train.num_positions,
        "eval_sequences": len(evals), "eval_positions": evals.num_positions,
        "pool_eval_agreement_before": _rate(before_any, evals.mask),
        "pool_eval_agreement_after": _rate(after_any, evals.mask),
        "ssms": entries, "config": {"data": asdict(cfg.data), "train": asdict(cfg.train)},
    }


def format_summary(summary: dict) -> str:
    lines = [f"boost-tune: held-out top-1 agreement with the LLM ({summary['eval_positions']} positions)"]
    for e in summary["ssms"]:
        lines.append(f"  {e['name']:<32} {e['eval_agreement_before']:.1%} -> {e['eval_agreement_after']:.1%}"
                     f"   (trained on {e['train_positions']}/{e['train_positions_total']} positions)")
    lines.append(f"  {'pool (any SSM)':<32} {summary['pool_eval_agreement_before']:.1%} -> "
                 f"{summary['pool_eval_agreement_after']:.1%}")
    return "\n".join(lines)


def _rate(hits: torch.Tensor, mask: torch.Tensor) -> float:
    return round(int((hits & mask).sum()) / max(1, int(mask.sum())), 4)


# ---- command line ----------------------------------------------------------------------------


def config_from_args(args: argparse.Namespace) -> BoostConfig:
    check_models(ModelPaths(args.llm, tuple(args.ssm)))  # dirs, architectures, same vocabulary
    data = DataConfig(num_prompts=args.num_prompts, eval_prompts=args.eval_prompts, prompt_tokens=args.prompt_tokens,
                      continuation_tokens=args.continuation_tokens, sampled_fraction=args.sampled_fraction,
                      temperature=args.temperature, kl_top_k=args.kl_top_k if args.kl_weight > 0 else 0,
                      seed=args.seed)
    train = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, kl_weight=args.kl_weight,
                        warmup_steps=args.warmup_steps, checkpoint_every=args.checkpoint_every, seed=args.seed)
    return BoostConfig(llm=args.llm, ssms=tuple(args.ssm), corpus=tuple(read_corpus(args.corpus, args.exclude)),
                       out=args.out, data=data, train=train, device=resolve_device(args.device))


def run_boost_tune(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    summary = boost_tune(cfg, resume=args.resume, progress=not args.quiet)
    if args.quiet:
        print(format_summary(summary))
    print(json.dumps({"out": str(cfg.out), "ssms": [e["checkpoint"] for e in summary["ssms"]],
                      "summary": str(cfg.out / SUMMARY_NAME)}))
    return 0
