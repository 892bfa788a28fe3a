"""Greedy output of a real model against transformers': plain decoding and the defaults.

The promise of speculative inference (SpecInfer, Section 4): verification keeps exactly what the
LLM itself would output. This decodes chat prompts with the engine, plainly and with the default
dynamic trees (the model-free drafts, and `--ssm` where given), and with transformers' own
`generate`, loading the model through transformers' own loaders (its GGUF loader for a `.gguf`
file: a dequantization independent of the engine's), all in float32, and reports every prompt.
One extra prompt is longer than the model's sliding window, where it has one.

    python scripts/check_transformers.py MODEL [--ssm DRAFT] [--num-prompts 8] [--max-new-tokens 48]

Prompts go through the model's chat template where it has one, else as plain text. Exits 1 when
an output differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROMPTS = ROOT / "specinfer" / "pool" / "data" / "heldout_chat_prompts.jsonl"


def load_transformers(model: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model.suffix == ".gguf":
        where, file = model.parent, dict(gguf_file=model.name)
        tok = AutoTokenizer.from_pretrained(where, **file)
        hf = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **file)
    else:
        tok = AutoTokenizer.from_pretrained(model)
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, use_safetensors=True)
    hf.eval()
    return tok, hf


def encode(tok, text: str) -> list[int]:
    if tok.chat_template:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tok(text)["input_ids"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="checkpoint directory or .gguf file")
    ap.add_argument("--ssm", type=Path, help="a draft for the defaults (default: the model-free drafts alone)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args()

    import torch

    from specinfer.engine.drafting.speculator import model_free_member
    from specinfer.engine.llm_engine import Engine, mode_params
    from specinfer.engine.runtime.runner import ModelRunner

    started = time.perf_counter()
    tok, hf = load_transformers(args.model)
    print(f"transformers: loaded in {time.perf_counter() - started:.0f}s", file=sys.stderr)
    texts = [json.loads(line)["messages"][0]["content"] for line in PROMPTS.read_text().splitlines()]
    prompts = [encode(tok, t) for t in texts[:args.num_prompts]]
    window = getattr(hf.config, "sliding_window", None)
    if window:
        facts = " ".join(f"Box {i} is {['red', 'blue', 'green'][i % 3]} and holds {i * 7 % 13} marbles."
                         for i in range(window // 10 + 10))
        prompts.append(encode(tok, facts + " Which box holds the most marbles?"))
    max_kv = max(len(p) for p in prompts) + args.max_new_tokens + 256

    def runner(path: Path) -> ModelRunner:
        return ModelRunner.from_dir(path, dtype="float32", max_kv_tokens=max_kv)

    plain = Engine.from_runners(runner(args.model))
    defaults = Engine.from_runners(runner(args.model), [runner(args.ssm)] if args.ssm else [],
                                   model_free=[model_free_member("lookup"), model_free_member("suffix")])
    rows, num_plain, num_defaults = [], 0, 0
    for ids in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=args.max_new_tokens, do_sample=False,
                              pad_token_id=hf.generation_config.pad_token_id or 0)
        want = out[0, len(ids):].tolist()
        got_plain = plain.generate(ids, mode_params("incremental", args.max_new_tokens)).output_ids
        result = defaults.generate(ids, mode_params("auto", args.max_new_tokens))
        num_plain += got_plain == want
        num_defaults += result.output_ids == want
        steps = max(1, len(result.accepted_per_step))
        rows.append(f"| {len(ids)} | {len(want)} | {got_plain == want} | {result.output_ids == want} | "
                    f"{len(result.output_ids) / steps:.2f} | {json.dumps(tok.decode(want)[:60])} |")
    print(f"# {args.model.name}: greedy, float32, against transformers' generate\n")
    print("| prompt tokens | new tokens | plain = transformers | defaults = transformers | tokens a step | "
          "output (start) |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nplain {num_plain}/{len(prompts)}, defaults {num_defaults}/{len(prompts)}"
          + (f"; sliding window {window}" if window else ""))
    return 0 if num_plain == num_defaults == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
