"""Built-in demo models: a small Llama LLM and small SSMs, trained here from Python's own stdlib.

SpecInfer (arXiv 2305.09781) speculates with *small speculative models* (SSMs) that are "small
models of the same family" as the LLM and share its tokenizer (Section 3); its evaluation pairs
LLaMA-7B with LLaMA-68M-class SSMs and merges several SSMs into one token tree (Sections 3 and 6).
A fresh machine has no model hub, so this module builds a pair of that kind from text every
machine already has: the ``*.py`` sources of Python's standard library.

What gets built (every model directory is an ordinary Hugging Face checkpoint):

* a byte-level BPE tokenizer (``<s>``=0, ``</s>``=1, ``<unk>``=2, no BOS added), shared by all models;
* ``llm/``: a ``LlamaForCausalLM`` with grouped-query attention and untied embeddings, trained on
  the training files;
* ``ssm-<i>/``: much cheaper Llama models with tied embeddings, *distilled* from the trained LLM
  (KL divergence to its next-token distribution), because what speculation needs is that the
  SSM's guesses match the LLM's choices; each SSM differs in shape and seed so that a merged pool
  of SSMs (SpecInfer's collective boost-tuning, Section 3) is not redundant;
* ``prompts.jsonl``: prompts cut, at line starts, from a fixed, hash-selected subset of held-out
  stdlib files (listed in ``heldout_files.json``), for benchmarks;
* ``manifest.json``: written last; a directory without a valid manifest is never used.

Training is by step counts, with seeded data order, so a build does not depend on wall-clock time.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

DEFAULT_DEMO_DIR_NAME = "demo-models-v1"
MANIFEST_NAME = "manifest.json"
PROMPTS_NAME = "prompts.jsonl"
HELDOUT_NAME = "heldout_files.json"
TRAINING_NAME = "training.json"
MANIFEST_FORMAT = 1
SPECIAL_TOKENS = ("<s>", "</s>", "<unk>")
BOS_ID, EOS_ID = 0, 1
PARTIAL_MARK = ".partial-"

# Directories of the stdlib that are not ordinary library code: test suites, vendored wheels,
# generated tables (codecs) and the pydoc help text (one 700 kB string).
EXCLUDED_DIR_NAMES = frozenset(
    {"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages", "ensurepip",
     "encodings", "pydoc_data", "lib-dynload"}
)
EXCLUDED_FILE_PREFIXES = ("_sysconfigdata",)
HELDOUT_MODULUS = 20  # a file is held out when hash(relative path) % 20 == 0: about 5%


# ---- configuration ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """Architecture of one Llama model (the vocabulary comes from the tokenizer)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int = 1024

    def llama_config(self, vocab_size: int):
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.hidden_size // self.num_heads,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            pad_token_id=None,
        )


LLM_SHAPE = ModelShape(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=688,
                       tie_word_embeddings=False)
SSM_SHAPES = (
    ModelShape(num_layers=1, hidden_size=128, num_heads=2, num_kv_heads=2, intermediate_size=384,
               tie_word_embeddings=True),
    ModelShape(num_layers=2, hidden_size=96, num_heads=2, num_kv_heads=1, intermediate_size=256,
               tie_word_embeddings=True),
)
TINY_LLM_SHAPE = ModelShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128,
                            tie_word_embeddings=False, max_position_embeddings=256)
TINY_SSM_SHAPES = (
    ModelShape(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64,
               tie_word_embeddings=True, max_position_embeddings=256),
)


@dataclass(frozen=True)
class DemoBudget:
    """How much to train. The i-th SSM has shape ``ssm_shapes[i % len(ssm_shapes)]``."""

    vocab_size: int
    llm_steps: int
    ssm_steps: int
    batch_size: int
    seq_len: int
    num_ssms: int
    llm_lr: float  # AdamW: embeddings, output head, norms
    ssm_lr: float
    muon_lr: float  # Muon: the hidden matrices of every model
    llm_shape: ModelShape
    ssm_shapes: tuple[ModelShape, ...]
    max_train_files: int | None = None  # None = every training file
    num_prompts: int = 32
    prompt_chars: tuple[int, int] = (240, 640)  # min and max prompt length in characters
    eval_windows: int = 32  # held-out windows of seq_len tokens for the loss/agreement report
    warmup_steps: int = 20

    def __post_init__(self) -> None:
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError("vocab_size must cover the 256 bytes plus the special tokens")
        if min(self.llm_steps, self.ssm_steps, self.batch_size, self.num_ssms) < 1 or self.seq_len < 8:
            raise ValueError("steps, batch_size and num_ssms must be positive; seq_len at least 8")
        if not self.ssm_shapes:
            raise ValueError("ssm_shapes must not be empty")

    @classmethod
    def full(cls) -> "DemoBudget":
        """What `specinfer demo-models` builds: 4.8 minutes measured on two idle CPU cores.

        Step times there: LLM 0.64 s, distillation of both SSMs 0.36 s. Small batches, many
        steps: at this token budget that beat larger batches at equal compute. Measured result:
        held-out LLM loss 4.27; SSM top-1 agreement with the LLM 65% and 64%, pool 74%.
        """
        return cls(vocab_size=4096, llm_steps=300, ssm_steps=240, batch_size=8, seq_len=256, num_ssms=2,
                   llm_lr=5e-3, ssm_lr=5e-3, muon_lr=0.02, llm_shape=LLM_SHAPE, ssm_shapes=SSM_SHAPES,
                   warmup_steps=20)

    @classmethod
    def tiny(cls) -> "DemoBudget":
        """For tests: valid checkpoints in seconds, quality irrelevant."""
        return cls(vocab_size=512, llm_steps=4, ssm_steps=4, batch_size=4, seq_len=64, num_ssms=2,
                   llm_lr=5e-3, ssm_lr=5e-3, muon_lr=0.02, llm_shape=TINY_LLM_SHAPE, ssm_shapes=TINY_SSM_SHAPES,
                   max_train_files=12, num_prompts=4, eval_windows=2, warmup_steps=1)

    def ssm_shape(self, index: int) -> ModelShape:
        return self.ssm_shapes[index % len(self.ssm_shapes)]

    def fingerprint(self, seed: int) -> str:
        blob = json.dumps({"budget": asdict(self), "seed": seed, "format": MANIFEST_FORMAT}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class DemoPaths:
    root: Path
    llm: Path
    ssms: tuple[Path, ...]
    prompts: Path

    @classmethod
    def from_manifest(cls, root: Path, manifest: dict) -> "DemoPaths":
        return cls(root=root, llm=root / manifest["llm"], ssms=tuple(root / s for s in manifest["ssms"]),
                   prompts=root / manifest["prompts"])


@dataclass(frozen=True)
class Corpus:
    """The stdlib split: relative POSIX paths under `stdlib`."""

    stdlib: Path
    train: tuple[str, ...]
    heldout: tuple[str, ...]

    def read(self, rel: str) -> str:
        return (self.stdlib / rel).read_text(encoding="utf-8", errors="replace")


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


# ---- public entry points ---------------------------------------------------------------------


def default_cache_dir() -> Path:
    """Where the CLI caches demo models unless told otherwise."""
    return Path.home() / ".cache" / "specinfer"


def demo_dir_name(budget: DemoBudget, seed: int) -> str:
    """The default build keeps the plain name; any other budget/seed gets its own directory."""
    if budget == DemoBudget.full() and seed == 0:
        return DEFAULT_DEMO_DIR_NAME
    return f"{DEFAULT_DEMO_DIR_NAME}-{budget.fingerprint(seed)}"


def ensure_demo_models(
    cache_dir: Path, budget: DemoBudget = DemoBudget.full(), seed: int = 0, progress: bool = True,
    force: bool = False,
) -> DemoPaths:
    """Returns the cached demo models, building them first when absent, partial or `force`d.

    A build happens in a temporary sibling directory that is renamed into place only once its
    manifest is written, so a crashed or concurrent build never leaves a directory that passes
    for a finished one.
    """
    cache_dir = Path(cache_dir)
    root = cache_dir / demo_dir_name(budget, seed)
    if not force:
        found = load_demo_paths(root, budget, seed)
        if found is not None:
            return found
    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(cache_dir, root.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}{PARTIAL_MARK}{os.getpid()}-", dir=cache_dir))
    tmp.chmod(0o755)  # mkdtemp makes it private; the finished cache is an ordinary directory
    try:
        build_demo_models(tmp, budget, seed=seed, progress=progress)
        paths = _move_into_place(tmp, root, budget, seed, replace_complete=force)
        _log(progress, f"demo models: ready at {paths.root}")
        return paths
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_demo_paths(root: Path, budget: DemoBudget | None = None, seed: int | None = None) -> DemoPaths | None:
    """The paths of a complete build at `root` (of `budget` and `seed`, when given), else None."""
    manifest_path = Path(root) / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("format") != MANIFEST_FORMAT or not manifest.get("complete"):
            return None
        if budget is not None and manifest["budget"] != json.loads(json.dumps(asdict(budget))):
            return None
        if seed is not None and manifest["seed"] != seed:
            return None
        paths = DemoPaths.from_manifest(Path(root), manifest)
        files = [paths.prompts] + [Path(root) / f for f in manifest["files"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return paths if all(f.is_file() for f in files) else None


def build_demo_models(
    out_dir: Path, budget: DemoBudget = DemoBudget.full(), seed: int = 0, progress: bool = True,
) -> DemoPaths:
    """Builds tokenizer, LLM, SSMs and prompts into `out_dir`; writes the manifest last."""
    start = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST_NAME).unlink(missing_ok=True)
    corpus = stdlib_corpus()
    tokenizer, train_ids, eval_ids = prepare_data(corpus, budget, progress)
    with _restore_threads(), torch.random.fork_rng(devices=[]):
        tuner = ThreadTuner()
        _log(progress, f"demo models: training on {tuner.current} of {tuner.cpus} CPU threads (follows load)")
        vocab = tokenizer.get_vocab_size()
        llm, llm_result = train_llm(train_ids, vocab, budget, seed, progress, tuner)
        ssms, ssm_results = distill_ssms(llm, train_ids, vocab, budget, seed, progress, tuner)
        metrics = {**evaluate(llm, ssms, eval_ids, budget), "threads_used": sorted(set(tuner.used))}
    _log(progress, "demo models: " + _format_metrics(metrics))

    paths = DemoPaths(root=out_dir, llm=out_dir / "llm", ssms=tuple(out_dir / f"ssm-{i}" for i in range(len(ssms))),
                      prompts=out_dir / PROMPTS_NAME)
    save_model(llm, tokenizer, paths.llm, replace(llm_result, extra={**llm_result.extra, **metrics}))
    for i, (ssm, result) in enumerate(zip(ssms, ssm_results)):
        extra = {"distilled_from": "llm", "heldout_top1_agreement": metrics["ssm_top1_agreement"][i]}
        save_model(ssm, tokenizer, paths.ssms[i], replace(result, extra={**result.extra, **extra}))
    write_prompts(paths.prompts, heldout_prompts(corpus, budget, seed))
    _write_json(out_dir / HELDOUT_NAME, {"stdlib": str(corpus.stdlib), "python": sys.version.split()[0],
                                         "files": list(corpus.heldout)})
    minutes = (time.perf_counter() - start) / 60
    _write_manifest(out_dir, budget, seed, metrics, minutes)
    _log(progress, f"demo models: built in {minutes:.1f} min")
    return paths


def prepare_data(corpus: "Corpus", budget: DemoBudget, progress: bool):
    """Trains the tokenizer; returns it with the training and held-out evaluation token streams."""
    train_rels = corpus.train[: budget.max_train_files] if budget.max_train_files else corpus.train
    train_texts = [corpus.read(rel) for rel in train_rels]
    _log(progress, f"demo models: tokenizer on {len(train_rels)} stdlib files ({len(corpus.heldout)} held out)")
    tokenizer = train_tokenizer(train_texts, budget.vocab_size, progress)
    heldout_texts = [corpus.read(rel) for rel in corpus.heldout]
    return tokenizer, encode_stream(tokenizer, train_texts), encode_stream(tokenizer, _eval_texts(heldout_texts, budget))


# ---- corpus ----------------------------------------------------------------------------------


def stdlib_corpus(stdlib: Path | None = None) -> Corpus:
    """Every library `*.py` file of the running Python, split into training and held-out files."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    rels = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if _is_library_file(p.relative_to(root))
    )
    if not rels:
        raise RuntimeError(f"no Python sources found under {root}")
    return Corpus(stdlib=root, train=tuple(r for r in rels if not is_heldout(r)),
                  heldout=tuple(r for r in rels if is_heldout(r)))


def is_heldout(rel: str) -> bool:
    """Fixed, machine-independent choice of held-out files by hashing the relative path."""
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % HELDOUT_MODULUS == 0


def _is_library_file(rel: Path) -> bool:
    if set(rel.parts[:-1]) & EXCLUDED_DIR_NAMES:
        return False
    return not rel.name.startswith(EXCLUDED_FILE_PREFIXES)


def _eval_texts(heldout_texts: Sequence[str], budget: DemoBudget) -> list[str]:
    """Enough held-out text for `eval_windows` windows (code is about 3.6 characters per token)."""
    needed = 4 * budget.eval_windows * budget.seq_len
    texts, total = [], 0
    for text in heldout_texts:
        texts.append(text)
        total += len(text)
        if total >= needed:
            break
    return texts


# ---- tokenizer -------------------------------------------------------------------------------


def train_tokenizer(texts: Sequence[str], vocab_size: int, progress: bool = False):
    """Byte-level BPE in the reference models' format: specials 0-2, no BOS added on encode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

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


def save_tokenizer(tokenizer, model_dir: Path) -> None:
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = {
        "backend": "tokenizers",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "unk_token": SPECIAL_TOKENS[2],
        "model_max_length": 1000000000000000019884624838656,
        "tokenizer_class": "TokenizersBackend",
    }
    _write_json(model_dir / "tokenizer_config.json", config)


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
    from transformers import LlamaForCausalLM

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
    tuner: "ThreadTuner | None" = None,
):
    """Next-token training of the LLM on the training stream."""
    start = time.perf_counter()
    model = new_model(budget.llm_shape, vocab_size, seed)
    optimizers = make_optimizers(model, budget.llm_lr, budget.muon_lr)
    batches = sample_batches(stream, budget.batch_size, budget.seq_len, seed)
    ema = None
    with _bar(budget.llm_steps, "LLM", progress) as bar:
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
    tuner: "ThreadTuner | None" = None,
):
    """Trains every SSM to match the LLM's next-token distribution (forward KL).

    All SSMs learn from the same batches, so each LLM forward pass is paid once.
    """
    start = time.perf_counter()
    students = [new_model(budget.ssm_shape(i), vocab_size, seed + 1 + i) for i in range(budget.num_ssms)]
    optimizers = [make_optimizers(s, budget.ssm_lr, budget.muon_lr) for s in students]
    batches = sample_batches(stream, budget.batch_size, budget.seq_len, seed + 1000)
    emas: list[float | None] = [None] * len(students)
    with _bar(budget.ssm_steps, "SSM", progress) as bar:
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


# ---- writing ---------------------------------------------------------------------------------


def save_model(model, tokenizer, model_dir: Path, result: TrainResult) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    with _no_transformers_bars():
        model.save_pretrained(model_dir, safe_serialization=True)
    save_tokenizer(tokenizer, model_dir)
    _write_json(model_dir / TRAINING_NAME, result.to_json())


def heldout_prompts(corpus: Corpus, budget: DemoBudget, seed: int) -> list[str]:
    """`num_prompts` prompts of whole lines, starting at a line start, from the held-out files."""
    rng = random.Random(seed)
    lo, hi = budget.prompt_chars
    files = [io.StringIO(corpus.read(rel)).readlines() for rel in corpus.heldout]  # split at "\n" only
    files = [lines for lines in files if sum(map(len, lines)) >= lo]
    prompts: list[str] = []
    attempts = 0
    while len(prompts) < budget.num_prompts and attempts < 50 * budget.num_prompts:
        lines = files[attempts % len(files)]
        attempts += 1
        prompt = _prompt_from(lines, rng.randrange(len(lines)), rng.randint(lo, (lo + hi) // 2), hi)
        if prompt and prompt not in prompts:
            prompts.append(prompt)
    return prompts


def _prompt_from(lines: Sequence[str], first: int, lo: int, hi: int) -> str | None:
    """Lines from `first` until at least `lo` characters; None if that overshoots `hi`."""
    if not lines[first].strip():
        return None
    text = ""
    for line in lines[first:]:
        text += line
        if len(text) >= lo:
            return text if len(text) <= hi else None
    return None


def write_prompts(path: Path, prompts: Sequence[str]) -> None:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts), encoding="utf-8")


def _write_manifest(out_dir: Path, budget: DemoBudget, seed: int, metrics: dict, minutes: float) -> None:
    files = sorted(p.relative_to(out_dir).as_posix() for p in out_dir.rglob("*") if p.is_file())
    manifest = {
        "format": MANIFEST_FORMAT,
        "complete": True,
        "llm": "llm",
        "ssms": [f"ssm-{i}" for i in range(budget.num_ssms)],
        "prompts": PROMPTS_NAME,
        "heldout_files": HELDOUT_NAME,
        "seed": seed,
        "budget": asdict(budget),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "metrics": metrics,
        "build_minutes": round(minutes, 3),
        "files": files,
    }
    _write_json(out_dir / MANIFEST_NAME, manifest)


def _write_json(path: Path, obj: dict) -> None:
    """Atomic: a reader sees the old file, or none, or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# ---- cache bookkeeping -----------------------------------------------------------------------


def _move_into_place(tmp: Path, root: Path, budget: DemoBudget, seed: int, replace_complete: bool) -> DemoPaths:
    """Renames the finished build `tmp` to `root`, replacing an incomplete, stale or forced old one."""
    existing = load_demo_paths(root, budget, seed)
    if existing is not None and not replace_complete:
        return existing  # another process finished first
    if root.exists():
        trash = root.with_name(f".{root.name}{PARTIAL_MARK}{os.getpid()}-old-{time.time_ns()}")
        os.rename(root, trash)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.rename(tmp, root)
    except OSError:
        existing = load_demo_paths(root, budget, seed)  # lost a race to a concurrent build
        if existing is None:
            raise
        return existing
    paths = load_demo_paths(root)
    if paths is None:
        raise RuntimeError(f"demo model build at {root} is incomplete")
    return paths


def _remove_stale_partials(cache_dir: Path, name: str) -> None:
    """Deletes temporary build dirs of `name` whose building process is gone."""
    prefix = f".{name}{PARTIAL_MARK}"
    for path in cache_dir.glob(prefix + "*"):
        pid_text = path.name[len(prefix):].split("-", 1)[0]
        if not pid_text.isdigit() or not _pid_alive(int(pid_text)):
            shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- small helpers ---------------------------------------------------------------------------


@contextlib.contextmanager
def _restore_threads() -> Iterator[None]:
    """Restores torch's thread count on exit."""
    previous = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class ThreadTuner:
    """Keeps torch on as many threads as there are CPUs that other processes leave free.

    With one thread per core, a core shared with another busy process stalls every parallel
    region: on two cores a training step took 5x longer on 2 threads, 2x on 1. So the count is
    re-checked every `every` steps from /proc/stat (all CPU time, less this process's own). The
    thread count does not change the result: builds on 1 and 2 threads are bitwise identical.
    """

    def __init__(self, every: int = 20):
        self.every = every
        self.cpus = _usable_cpus()
        self.used: list[int] = []
        self._set(self._free(_busy_cpus()))
        self._last = _cpu_snapshot()

    @property
    def current(self) -> int:
        return self.used[-1]

    def step(self, step: int) -> None:
        if step == 0 or step % self.every:
            return
        snapshot = _cpu_snapshot()
        if snapshot is not None and self._last is not None:
            self._set(self._free(_others_busy(self._last, snapshot)))
        self._last = snapshot

    def _free(self, busy: float) -> int:
        return max(1, min(self.cpus, int(self.cpus - busy + 0.5)))

    def _set(self, count: int) -> None:
        if not self.used or count != self.used[-1]:
            torch.set_num_threads(count)
        self.used.append(count)


def _cpu_snapshot() -> tuple[int, int, int] | None:
    """(all CPU jiffies, idle jiffies, this process's jiffies) from /proc; None off Linux."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields), idle, int(own[11]) + int(own[12])  # utime + stime


def _others_busy(before: tuple[int, int, int], after: tuple[int, int, int]) -> float:
    """CPUs kept busy by other processes between two snapshots."""
    total, idle, own = (a - b for a, b in zip(after, before))
    if total <= 0:
        return 0.0
    return max(0.0, (total - idle - own) / total * (os.cpu_count() or 1))


def _busy_cpus(window_s: float = 0.3) -> float:
    """How many CPUs other processes use right now (we sleep meanwhile); 0 when unknown."""
    before = _cpu_snapshot()
    time.sleep(window_s)
    after = _cpu_snapshot()
    return 0.0 if before is None or after is None else _others_busy(before, after)


def _usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


@contextlib.contextmanager
def _no_transformers_bars() -> Iterator[None]:
    """Silences transformers' own progress bars (e.g. 'Writing model shards'), then restores them."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, leave=True, dynamic_ncols=True)


def _ema(previous: float | None, value: float, decay: float = 0.95) -> float:
    return value if previous is None else decay * previous + (1 - decay) * value


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _format_metrics(metrics: dict) -> str:
    agree = ", ".join(f"{a:.1%}" for a in metrics["ssm_top1_agreement"])
    return (f"held-out LLM loss {metrics['heldout_loss']:.3f}; SSM top-1 agreement with the LLM {agree} "
            f"(pool {metrics['ssm_pool_top1_agreement']:.1%})")


def _log(enabled: bool, message: str) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)
