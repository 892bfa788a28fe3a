"""Training the demo models: a byte-level BPE tokenizer, the LLM, and SSMs distilled from it.

The LLM learns next-token prediction on the training stream; every SSM is *distilled* from the
trained LLM (forward KL to its next-token distribution), because what speculation needs is that
the SSM's guesses match the LLM's choices (SpecInfer, Section 3). Hidden matrices train with Muon,
the rest with AdamW. Training is by step counts with seeded data order, so a build does not
depend on wall-clock time.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from specinfer.pool.demo_budget import EOS_ID, SPECIAL_TOKENS, DemoBudget, ModelShape
from specinfer.pool.thread_tuner import ThreadTuner
from specinfer.util import progress_bar, write_json
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaForCausalLM


@dataclass(frozen=True)
class TrainResult:
    steps: int
    tokens_seen: int
    final_loss_ema: float
    params: int
    seconds: float
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"steps": self.steps, "tokens_seen": self.tokens_seen, "final_loss_ema": self.final_loss_ema,
                "params": self.params, "minutes": round(self.seconds / 60, 3), **self.extra}


# ---- tokenizer -------------------------------------------------------------------------------


def train_tokenizer(texts: Sequence[str], vocab_size: int, progress: bool = False):
    """Byte-level BPE in the reference models' format: specials 0-2, no BOS added on encode."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1", special_tokens=[])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=progress,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def encode_stream(tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """All texts as one token stream, each file followed by `</s>`."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(list(texts), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


# The demo models know only Python source, so a chat is a transcript in Python comments; the
# model continues after "# assistant:" (the HTTP API's /v1/chat/completions renders this).
DEMO_CHAT_TEMPLATE = ("{% for message in messages %}# {{ message['role'] }}: {{ message['content'] }}\n"
                      "{% endfor %}{% if add_generation_prompt %}# assistant:{% endif %}")


def add_chat_template(model_dir: Path) -> None:
    """Gives a demo model built before it had one the demo chat template (best effort: a
    read-only cache keeps serving without it)."""
    path = Path(model_dir) / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text())
        if "chat_template" not in config:
            write_json(path, {**config, "chat_template": DEMO_CHAT_TEMPLATE})
    except (OSError, ValueError):
        pass


def save_tokenizer(tokenizer, model_dir: Path) -> None:
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = {
        "backend": "tokenizers",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "unk_token": SPECIAL_TOKENS[2],
        "model_max_length": 1000000000000000019884624838656,
        "tokenizer_class": "TokenizersBackend",
        "chat_template": DEMO_CHAT_TEMPLATE,
    }
    write_json(model_dir / "tokenizer_config.json", config)


# ---- training --------------------------------------------------------------------------------


def sample_batches(stream: torch.Tensor, batch_size: int, seq_len: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless (batch, seq_len) windows at seeded random offsets of the token stream."""
    if len(stream) <= seq_len:
        raise ValueError(f"token stream of {len(stream)} tokens is shorter than seq_len={seq_len}")
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len)
    while True:
        starts = torch.randint(0, len(stream) - seq_len, (batch_size, 1), generator=gen)
        yield stream[starts + offsets]


def new_model(shape: ModelShape, vocab_size: int, seed: int):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(shape.llama_config(vocab_size)).float()
    model.train()
    return model


class Muon(torch.optim.Optimizer):
    """Momentum orthogonalised by Newton-Schulz (K. Jordan et al., 2024), for 2-D hidden weights.

    Self-contained (fp32, no dependence on `torch.optim.Muon`, which only newer torch has), so a
    build is the same computation on every supported torch. On a few hundred steps it reaches a
    far lower loss than AdamW, which is what a minutes-long CPU budget needs.
    """

    def __init__(self, params, lr: float, momentum: float = 0.95, ns_steps: int = 5):
        super().__init__(params, {"lr": lr, "momentum": momentum, "ns_steps": ns_steps})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = orthogonalize(p.grad.lerp(buf, group["momentum"]), group["ns_steps"])
                p.add_(update, alpha=-group["lr"] * math.sqrt(max(1.0, p.shape[0] / p.shape[1])))


def orthogonalize(g: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """Approximately U V^T of g = U S V^T by a quintic Newton-Schulz iteration."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.float()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / x.norm().clamp_min(eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if transposed else x


def make_optimizers(model: torch.nn.Module, adam_lr: float, muon_lr: float) -> list[torch.optim.Optimizer]:
    """Muon for the hidden matrices; AdamW for embeddings, output head and norms.

    Every param group remembers its `peak_lr`; the schedule scales all of them alike.
    """
    hidden, other = [], []
    for name, p in model.named_parameters():
        (hidden if p.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name else other).append(p)
    muon = Muon([{"params": hidden, "peak_lr": muon_lr}], lr=muon_lr)
    adam = torch.optim.AdamW([{"params": other, "peak_lr": adam_lr}], lr=adam_lr, betas=(0.9, 0.95),
                             eps=1e-8, weight_decay=0.0)
    return [muon, adam]


def lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _optimizer_step(model, optimizers: Sequence[torch.optim.Optimizer], loss: torch.Tensor, factor: float) -> None:
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = group["peak_lr"] * factor
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def train_llm(
    stream: torch.Tensor, vocab_size: int, budget: DemoBudget, seed: int, progress: bool,
    tuner: ThreadTuner | None = None,
):
    """Next-token training of the LLM on the training stream."""
    start = time.perf_counter()
    model = new_model(budget.llm_shape, vocab_size, seed)
    optimizers = make_optimizers(model, budget.llm_lr, budget.muon_lr)
    batches = sample_batches(stream, budget.batch_size, budget.seq_len, seed)
    ema = None
    with progress_bar(budget.llm_steps, "LLM", progress) as bar:
        for step in range(budget.llm_steps):
            if tuner:
                tuner.step(step)
            batch = next(batches)
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            _optimizer_step(model, optimizers, loss, lr_factor(step, budget.llm_steps, budget.warmup_steps))
            ema = _ema(ema, loss.item())
            bar.update(1)
            bar.set_postfix(loss=f"{ema:.3f}")
    model.eval()
    result = TrainResult(steps=budget.llm_steps, tokens_seen=budget.llm_steps * budget.batch_size * budget.seq_len,
                         final_loss_ema=ema, params=_num_params(model), seconds=time.perf_counter() - start)
    return model, result


def distill_ssms(
    teacher, stream: torch.Tensor, vocab_size: int, budget: DemoBudget, seed: int, progress: bool,
    tuner: ThreadTuner | None = None,
):
    """Trains every SSM to match the LLM's next-token distribution (forward KL).

    All SSMs learn from the same batches, so each LLM forward pass is paid once.
    """
    start = time.perf_counter()
    students = [new_model(budget.ssm_shape(i), vocab_size, seed + 1 + i) for i in range(budget.num_ssms)]
    optimizers = [make_optimizers(s, budget.ssm_lr, budget.muon_lr) for s in students]
    batches = sample_batches(stream, budget.batch_size, budget.seq_len, seed + 1000)
    emas: list[float | None] = [None] * len(students)
    with progress_bar(budget.ssm_steps, "SSM", progress) as bar:
        for step in range(budget.ssm_steps):
            if tuner:
                tuner.step(step)
            batch = next(batches)
            target, entropy = teacher_targets(teacher, batch)
            factor = lr_factor(step, budget.ssm_steps, budget.warmup_steps)
            for i, (student, opts) in enumerate(zip(students, optimizers)):
                loss = soft_cross_entropy(student(input_ids=batch, use_cache=False).logits, target)
                _optimizer_step(student, opts, loss, factor)
                emas[i] = _ema(emas[i], loss.item() - entropy)  # KL = cross-entropy - H(teacher)
            bar.update(1)
            bar.set_postfix(kl=" ".join(f"{e:.3f}" for e in emas))
    seconds = time.perf_counter() - start
    results = []
    for student, ema in zip(students, emas):
        student.eval()
        results.append(TrainResult(steps=budget.ssm_steps,
                                   tokens_seen=budget.ssm_steps * budget.batch_size * budget.seq_len,
                                   final_loss_ema=ema, params=_num_params(student), seconds=seconds,
                                   extra={"loss": "kl_to_llm", "final_loss": "ema of KL(llm || ssm)"}))
    return students, results


@torch.no_grad()
def teacher_targets(teacher, batch: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The teacher's next-token distributions on `batch`, and their mean entropy."""
    probs = F.softmax(teacher(input_ids=batch, use_cache=False).logits.float(), dim=-1)
    return probs, -(probs * torch.log(probs.clamp_min(1e-12))).sum(-1).mean().item()


def soft_cross_entropy(student_logits: torch.Tensor, teacher_probs: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the student against the teacher's distribution, averaged over positions.

    It differs from KL(teacher || student) by the teacher's entropy, a constant for the student,
    so its gradient is the forward-KL distillation gradient at a lower cost.
    """
    return -(teacher_probs * F.log_softmax(student_logits.float(), dim=-1)).sum(-1).mean()


# ---- evaluation ------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(llm, ssms: Sequence, stream: torch.Tensor, budget: DemoBudget) -> dict:
    """Held-out LLM loss and how often each SSM's (and the pool's) top-1 is the LLM's top-1."""
    windows = _eval_windows(stream, budget.seq_len, budget.eval_windows)
    losses, agree, pool_hits, positions = [], [0] * len(ssms), 0, 0
    for window in windows.split(4):
        llm_logits = llm(input_ids=window, use_cache=False).logits.float()
        losses.append(F.cross_entropy(llm_logits[:, :-1].flatten(0, 1), window[:, 1:].flatten(), reduction="sum"))
        llm_top = llm_logits.argmax(-1)
        any_hit = torch.zeros_like(llm_top, dtype=torch.bool)
        for i, ssm in enumerate(ssms):
            hit = ssm(input_ids=window, use_cache=False).logits.argmax(-1) == llm_top
            agree[i] += int(hit.sum())
            any_hit |= hit
        pool_hits += int(any_hit.sum())
        positions += llm_top.numel()
    predicted = windows.shape[0] * (windows.shape[1] - 1)
    return {
        "heldout_loss": round(float(sum(losses)) / predicted, 4),
        "heldout_tokens": int(windows.numel()),
        "ssm_top1_agreement": [round(a / positions, 4) for a in agree],
        "ssm_pool_top1_agreement": round(pool_hits / positions, 4),
    }


def _eval_windows(stream: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    count = max(1, min(count, len(stream) // seq_len))
    if len(stream) < seq_len:
        raise ValueError("held-out text is shorter than one evaluation window")
    return stream[: count * seq_len].view(count, seq_len)


def format_metrics(metrics: dict) -> str:
    agree = ", ".join(f"{a:.1%}" for a in metrics["ssm_top1_agreement"])
    return (f"held-out LLM loss {metrics['heldout_loss']:.3f}; SSM top-1 agreement with the LLM {agree} "
            f"(pool {metrics['ssm_pool_top1_agreement']:.1%})")


def _ema(previous: float | None, value: float, decay: float = 0.95) -> float:
    return value if previous is None else decay * previous + (1 - decay) * value


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
