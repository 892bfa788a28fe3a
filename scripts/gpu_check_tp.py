#!/usr/bin/env python3
"""The tensor-parallel step of the GPU check: the LLM sharded over every GPU of the machine.

    python scripts/gpu_check_tp.py OUT.md [--models DIR]   # all GPUs; skipped with fewer than two
    python scripts/gpu_check_tp.py OUT.md --tiny           # CPU, two gloo ranks, a tiny model

For each LLM (the reference LLM with --models, and a random-weight TinyLlama-1.1B-like model
written to a temporary checkpoint), greedy incremental decoding runs on one GPU and sharded
over N GPUs (the largest N that divides the model's KV heads and fits the machine), alternating
TP=1 and TP=N runs; the outputs must be equal token for token. Appends a table to OUT.md and
exits 1 if any output differs. Ranks > 0 are spawned processes (torch.multiprocessing).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def save_random_llama(path: Path, raw: dict, seed: int) -> Path:
    """A random-weight Llama checkpoint (config.json + model.safetensors) in the HF layout."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    hd, inter, vocab = raw["hidden_size"], raw["intermediate_size"], raw["vocab_size"]
    d = hd // raw["num_attention_heads"]
    q, kv = raw["num_attention_heads"] * d, raw["num_key_value_heads"] * d

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    w = {"model.embed_tokens.weight": rnd(vocab, hd), "model.norm.weight": torch.ones(hd, dtype=torch.bfloat16),
         "lm_head.weight": rnd(vocab, hd)}
    for i in range(raw["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": rnd(q, hd), p + "self_attn.k_proj.weight": rnd(kv, hd),
              p + "self_attn.v_proj.weight": rnd(kv, hd), p + "self_attn.o_proj.weight": rnd(hd, q),
              p + "mlp.gate_proj.weight": rnd(inter, hd), p + "mlp.up_proj.weight": rnd(inter, hd),
              p + "mlp.down_proj.weight": rnd(hd, inter),
              p + "input_layernorm.weight": torch.ones(hd, dtype=torch.bfloat16),
              p + "post_attention_layernorm.weight": torch.ones(hd, dtype=torch.bfloat16)}
    path.mkdir(parents=True, exist_ok=True)
    save_file(w, str(path / "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
           "hidden_act": "silu", "torch_dtype": "bfloat16", **raw}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def largest_size(num_kv_heads: int, num_heads: int, intermediate: int, limit: int) -> int:
    return max(n for n in range(1, limit + 1)
               if num_kv_heads % n == 0 and num_heads % n == 0 and intermediate % n == 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="markdown report to append to")
    ap.add_argument("--models", type=Path, help="folder with reference-llm (optional)")
    ap.add_argument("--tiny", action="store_true", help="CPU, two gloo ranks, a tiny random model")
    ap.add_argument("--new-tokens", type=int, default=0, help="tokens per run (default: 64, tiny: 16)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating TP=1 / TP=N runs per model")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

    import torch

    from specinfer.engine.models.config import ModelConfig
    from specinfer.engine.llm_engine import Engine, mode_params
    from specinfer.engine.runtime.assemble import load_runner
    from specinfer.engine.runtime.parallel import ParallelConfig
    from specinfer.engine.runtime.runner import ModelRunner

    lines = ["## 5. Tensor parallel: the LLM sharded over the machine's GPUs", ""]
    num_devices = 2 if args.tiny else torch.cuda.device_count()
    if num_devices < 2:
        lines += [f"Skipped: {num_devices} GPU (tensor parallelism needs at least two).", ""]
        _append(args.out, lines)
        return 0
    device, dtype = ("cpu", "float32") if args.tiny else ("cuda", "bfloat16")
    new_tokens = args.new_tokens or (16 if args.tiny else 64)
    if args.tiny:
        torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_tp."))
    models = []
    if args.models and (args.models / "reference-llm").is_dir():
        models.append(("reference LLM", args.models / "reference-llm"))
    raw = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128) if args.tiny else
           dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=32000))
    models.append(("random 1.1B" if not args.tiny else "random tiny", save_random_llama(tmp / "random", raw, 0)))
    rows, failures = [], []
    for name, path in models:
        cfg = ModelConfig.from_dir(path)
        size = largest_size(cfg.num_kv_heads, cfg.num_heads, cfg.intermediate_size, num_devices)
        if size < 2:
            rows.append([name, "-", "skipped: its KV heads do not split", "", "", ""])
            continue
        prompt = [(7 * i + 3) % cfg.vocab_size for i in range(48)]
        params = mode_params("incremental", new_tokens)
        single = Engine.from_runners(ModelRunner.from_dir(path, dtype=dtype, device=device, max_kv_tokens=2048))
        sharded_runner = load_runner(path, dtype=dtype, device=device, max_kv_tokens=2048,
                                     parallel=ParallelConfig.spawned(size))
        sharded = Engine.from_runners(sharded_runner)
        times = {1: [], size: []}
        outputs = {1: [], size: []}
        try:
            for engine in (single, sharded):  # warm-up
                engine.generate(prompt, mode_params("incremental", 4))
            for _ in range(args.rounds):
                for n, engine in ((1, single), (size, sharded)):
                    t = time.perf_counter()
                    r = engine.generate(prompt, params)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    times[n].append((time.perf_counter() - t) * 1e3 / max(1, len(r.output_ids)))
                    outputs[n].append(r.output_ids)
        finally:
            sharded_runner.close()
        same = all(o == outputs[1][0] for o in outputs[1] + outputs[size])
        if not same:
            failures.append(name)
        one, many = sorted(times[1])[len(times[1]) // 2], sorted(times[size])[len(times[size]) // 2]
        rows.append([name, size, f"{one:.2f}", f"{many:.2f}", f"{one / many:.2f}x", "yes" if same else "**NO**"])
    lines += [f"{'CPU (gloo)' if args.tiny else torch.cuda.get_device_name(0)} x {num_devices}; {dtype}; greedy "
              f"incremental, {new_tokens} new tokens, median of {args.rounds} alternating runs.", "",
              "| LLM | TP size N | ms / token, TP=1 | ms / token, TP=N | speedup | outputs equal |",
              "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    lines += ["", f"Failures: {', '.join(failures) if failures else 'none'}", ""]
    _append(args.out, lines)
    return 1 if failures else 0


def _append(out: str, lines: list[str]) -> None:
    with open(out, "a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
