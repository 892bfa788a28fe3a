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

Training is by step counts, with seeded data order, so a build does not depend on wall-clock time;
only the CPU threads it runs on, which follow the machine's load, can change the last bits of the
weights.

This module is the entry point (`ensure_demo_models`); the parts live beside it: `demo_budget`
(shapes and budgets), `demo_corpus` (stdlib split and prompts), `demo_training` (tokenizer,
training, distillation, evaluation), `demo_cache` (directory names, manifest, moving a build into
place) and `thread_tuner`.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from specinfer.pool.demo_budget import DemoBudget
from specinfer.pool.demo_cache import (
    DEFAULT_DEMO_DIR_NAME, HELDOUT_NAME, MANIFEST_NAME, PARTIAL_MARK, PROMPTS_NAME, TRAINING_NAME, DemoPaths,
    demo_dir_name, load_demo_paths, move_into_place, new_partial_dir, write_manifest,
)
from specinfer.pool.demo_corpus import Corpus, eval_texts, heldout_prompts, is_heldout, stdlib_corpus, write_prompts
from specinfer.pool.demo_training import (
    TrainResult, add_chat_template, distill_ssms, encode_stream, evaluate, format_metrics, save_tokenizer, train_llm,
    train_tokenizer,
)
from specinfer.pool.thread_tuner import ThreadTuner, restore_threads
from specinfer.util import quiet_transformers, write_json

__all__ = [
    "DEFAULT_DEMO_DIR_NAME", "HELDOUT_NAME", "MANIFEST_NAME", "PARTIAL_MARK", "PROMPTS_NAME", "TRAINING_NAME",
    "DemoBudget", "DemoPaths", "ThreadTuner", "build_demo_models", "demo_dir_name", "ensure_demo_models",
    "heldout_prompts", "is_heldout", "load_demo_paths", "stdlib_corpus",
]


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
            add_chat_template(found.llm)
            return found
    tmp = new_partial_dir(cache_dir, root.name)
    try:
        build_demo_models(tmp, budget, seed=seed, progress=progress)
        paths = move_into_place(tmp, root, budget, seed, replace_complete=force)
        _log(progress, f"demo models: ready at {paths.root}")
        return paths
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


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
    with restore_threads(), torch.random.fork_rng(devices=[]):
        tuner = ThreadTuner()
        _log(progress, f"demo models: training on {tuner.current} of {tuner.cpus} CPU threads (follows load)")
        vocab = tokenizer.get_vocab_size()
        llm, llm_result = train_llm(train_ids, vocab, budget, seed, progress, tuner)
        ssms, ssm_results = distill_ssms(llm, train_ids, vocab, budget, seed, progress, tuner)
        metrics = {**evaluate(llm, ssms, eval_ids, budget), "threads_used": sorted(set(tuner.used))}
    _log(progress, "demo models: " + format_metrics(metrics))

    paths = DemoPaths(root=out_dir, llm=out_dir / "llm", ssms=tuple(out_dir / f"ssm-{i}" for i in range(len(ssms))),
                      prompts=out_dir / PROMPTS_NAME)
    save_model(llm, tokenizer, paths.llm, replace(llm_result, extra={**llm_result.extra, **metrics}))
    for i, (ssm, result) in enumerate(zip(ssms, ssm_results)):
        extra = {"distilled_from": "llm", "heldout_top1_agreement": metrics["ssm_top1_agreement"][i]}
        save_model(ssm, tokenizer, paths.ssms[i], replace(result, extra={**result.extra, **extra}))
    write_prompts(paths.prompts, heldout_prompts(corpus, budget, seed))
    write_json(out_dir / HELDOUT_NAME, {"stdlib": str(corpus.stdlib), "python": sys.version.split()[0],
                                        "files": list(corpus.heldout)})
    minutes = (time.perf_counter() - start) / 60
    write_manifest(out_dir, budget, seed, metrics, minutes)
    _log(progress, f"demo models: built in {minutes:.1f} min")
    return paths


def prepare_data(corpus: Corpus, budget: DemoBudget, progress: bool):
    """Trains the tokenizer; returns it with the training and held-out evaluation token streams."""
    train_rels = corpus.train[: budget.max_train_files] if budget.max_train_files else corpus.train
    train_texts = [corpus.read(rel) for rel in train_rels]
    _log(progress, f"demo models: tokenizer on {len(train_rels)} stdlib files ({len(corpus.heldout)} held out)")
    tokenizer = train_tokenizer(train_texts, budget.vocab_size, progress)
    heldout_texts = [corpus.read(rel) for rel in corpus.heldout]
    return tokenizer, encode_stream(tokenizer, train_texts), encode_stream(tokenizer, eval_texts(heldout_texts, budget))


def save_model(model, tokenizer, model_dir: Path, result: TrainResult) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    with quiet_transformers():
        model.save_pretrained(model_dir, safe_serialization=True)
    save_tokenizer(tokenizer, model_dir)
    write_json(model_dir / TRAINING_NAME, result.to_json())


def _log(enabled: bool, message: str) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)
