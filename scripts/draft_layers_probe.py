"""Which of the LLM's layers should a draft keep, at what learning rate, on how much data? One set
of teacher data, several cuts, the same steps.

`specinfer make-draft` cuts a draft from the LLM's own layers (SpecInfer, arXiv 2305.09781,
Section 3: SSMs as pruned variants of the LLM) and distils it on the LLM's answers. This script
trains several cuts on the teacher data of one build, for the same number of steps, and reports
each one's held-out top-1 agreement and greedy chain acceptance by depth (with the reduced head
the draft will propose with) and its training step's cost.

    python scripts/draft_layers_probe.py --llm LLM --work COPY_OF_A_BUILD_WORK_DIR \
        --layers 2 0,29 0,1,29 --steps 60 [--lr 5e-3] [--batches N]

The work directory is a copy of a `make-draft` build's hidden work directory, taken once its
teacher data is complete (`data.done` exists).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from safetensors.torch import load_file

from specinfer.engine.models.config import ModelConfig
from specinfer.pool.boost_data import BoostData
from specinfer.pool.boost_tune import Trainer, agreement, load_model
from specinfer.pool.make_draft import (
    acceptance_by_depth, concat_batches, distill_config, draft_vocabulary, freeze_vocabulary, rate,
)
from specinfer.pool.make_ssm import make_ssm
from specinfer.pool.tuning_config import DraftConfig


def probe(llm: Path, layers: str, train: BoostData, evals: BoostData, steps: int, cfg: DraftConfig) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cut = make_ssm(llm, Path(tmp) / "cut", layers)
        model = load_model(cut, "cpu")
        freeze_vocabulary(model)
        vocab = draft_vocabulary(train, cfg.vocab, ModelConfig.from_dir(cut))
        before = agreement(model, evals, 8, "cpu", False, "before", vocab)
        trainer = Trainer(model, distill_config(cfg, steps, checkpoint_every=10 ** 9), 0, "cpu")
        started = time.perf_counter()
        trainer.fit(train, train.mask.clone(), Path(tmp) / "ckpt", True, None)
        train_s = time.perf_counter() - started
        after = agreement(model, evals, 8, "cpu", False, "after", vocab)
        return {
            "layers": layers, "steps": steps, "lr": cfg.lr, "step_s": round(train_s / max(1, steps), 3),
            "agreement_before": round(rate(before, evals.mask), 4),
            "agreement_after": round(rate(after, evals.mask), 4),
            "acceptance_by_depth_after": acceptance_by_depth(after, evals.mask, 4),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llm", required=True, type=Path)
    parser.add_argument("--work", required=True, type=Path, help="a copy of a make-draft work directory")
    parser.add_argument("--layers", nargs="+", default=["2", "0,29", "0,1,29"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batches", type=int, default=0, help="train on the first N batches of teacher data (0: all)")
    parser.add_argument("--lr", type=float, help="the learning rate (default: the build's)")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()
    cfg = replace(DraftConfig(), **json.loads((args.work / "run.json").read_text())["settings"])
    if args.lr:
        cfg = replace(cfg, lr=args.lr)
    batches = sorted((args.work / "data").glob("batch-*.safetensors"))
    train = concat_batches(batches[:args.batches or len(batches)], "train")
    evals = BoostData.from_tensors(load_file(str(args.work / "data" / "eval.safetensors")), "eval")
    print(f"teacher data: {len(train)} answers, {train.num_positions} positions, {evals.num_positions} held out")
    results = []
    for layers in args.layers:
        result = probe(args.llm, layers, train, evals, args.steps, cfg)
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
