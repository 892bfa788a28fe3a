"""Every command-line option of the `specinfer` commands, and every setting more than one
service has: each declared once, here, as a `Flag` (`settings.py`): its name, how it parses, its
default (from `specinfer.limits`), its help and, beside it, its environment variable.

The commands (`specinfer generate`, `bench`, `up`, `client`, `demo-models`, the health probe) and
the services (their `config.py`) compose the declarations they need with `add_declared` /
`add_exclusive` or `add_flag`, and resolve them after parsing: the flag, else its variable, else
its default. An option whose name means different things to different programs (`--port` is each
service's own port, `--dtype` a speculator's SSMs' dtype) is still declared once: its one
declaration takes which program's variant (`of=`) and holds every variant's variable, default
and help. On/off settings take `--name`, `--no-name` or `--name on|off`.

Plain Python and light: the gateway imports this too (no torch, no engine at import time).
An option only one service has is declared in that service's `config.py`, and the pool's
training options in `specinfer.pool.commands`; `tests/test_flags.py` checks that no option is
declared twice and that nothing adds one to a parser but `settings.add_flag`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from specinfer.limits import (
    ATTENTION_BACKENDS, DEFAULT_ATTENTION, BENCH_CONCURRENCY_IN_PROCESS, BENCH_FIRST_PORT, BENCH_NOISY_PHASE_S, BENCH_NUM_PROMPTS,
    BENCH_NUM_SAMPLES, BENCH_PREFIX_GROUPS, BENCH_REQUESTS_PER_LEVEL, BENCH_ROUNDS, BENCH_ROUNDS_IN_PROCESS,
    BENCH_SHARED_PREFIX_TOKENS, BENCH_TEMPERATURES, BOOST_SEED, CLIENT_DEADLINE_S, DECODE_MODES, DEFAULT_DEADLINE_S,
    DEFAULT_DEVICE, DEFAULT_DTYPE, DEFAULT_FREQUENCY_PENALTY, DEFAULT_IS_PREFIX_CACHING,
    DEFAULT_KV_MEMORY_FRACTION_CPU, DEFAULT_KV_MEMORY_FRACTION_CUDA, DEFAULT_MAX_BATCH, DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_MAX_TREE_NODES, DEFAULT_MIN_P, DEFAULT_MIN_PATH_PROB, DEFAULT_NUM_SPECULATORS, DEFAULT_NUM_THREADS,
    DEFAULT_NUM_VERIFIERS, DEFAULT_PRESENCE_PENALTY, DEFAULT_REPETITION_PENALTY, DEFAULT_SSM_DTYPE,
    DEFAULT_TEMPERATURE, DEFAULT_TENSOR_PARALLEL, DEFAULT_TOP_K, DEFAULT_TOP_P, DEFAULT_TREE_SAMPLING,
    GATEWAY_PORT, HEALTHCHECK_TIMEOUT_S, HTTP_PORT, MAX_MESSAGE_BYTES, MAX_TREE_NODES, MIN_MESSAGE_BYTES,
    MODEL_DTYPES, OMP_WAIT_POLICIES, PAPER_TREE_WIDTH, SPECULATOR_PORT, SSM_DTYPES, STACK_METRICS_PORT,
    SUFFIX_CACHE_TOKENS, TREE_POLICIES, TREE_SAMPLINGS, UP_PROMPT_MAX_TOKENS, VERIFIER_PORT, RequestLimits,
    parse_kv_budget, parse_tree_width,
)
from specinfer.serving.settings import (
    LOCAL_HOST, LOG_LEVELS, MAX_PORT, Flag, add_declared, add_exclusive, add_flag, format_bytes, one_of, parse_bool,
    parse_bytes, resolve_declared,
)
from specinfer.util import CACHE_DIR_ENV

__all__ = ["Flag", "add_declared", "add_exclusive", "add_flag", "resolve_declared"]

NONE: tuple[str, ...] = ()  # no environment variable: a command-line-only option
DEMO_MODELS = "the built-in demo models"


def _variant(of: str, variants: dict[str, Any]) -> Any:
    if of not in variants:
        raise ValueError(f"no variant {of!r}: {', '.join(variants)}")
    return variants[of]


def _auto_switch(what: str) -> Callable[[str], bool | None]:
    """auto (None), on or off; the engine's parser, imported only when a value is parsed."""

    def parse(text: str) -> bool | None:
        from specinfer.engine.runtime.exec_config import parse_auto_switch  # the engine's: only when a value is parsed

        return parse_auto_switch(text, what)

    parse.__name__ = "auto|on|off"
    return parse


def _tree_width(text: str) -> tuple[int, ...]:
    return parse_tree_width(text)


_tree_width.__name__ = "tree width"


# ---- the models -------------------------------------------------------------------------------
def llm_flag(of: str = "command") -> Flag:
    """--llm: the LLM a command runs (`generate`, `bench`, `up`, `boost-tune`)."""
    help_text = _variant(of, {
        "command": f"LLM checkpoint directory or .gguf file (default: {DEMO_MODELS})",
        "boost-tune": "LLM checkpoint directory or .gguf file",
        "make-draft": "LLM checkpoint directory or .gguf file",
    })
    return Flag("--llm", NONE, Path, None, help_text, is_required=of in ("boost-tune", "make-draft"))


def ssm_flag(of: str = "command") -> Flag:
    """--ssm: the SSM pool, repeatable: checkpoints and the model-free members (lookup, suffix)."""
    env, parse, default, help_text = _variant(of, {
        "command": (NONE, Path, [], "SSM checkpoint directory or .gguf file, or a model-free speculator: lookup "
                    "(n-grams of the request's own context) or suffix (its context and recent outputs); repeatable. "
                    "Both model-free members join the pool unless one is named or --no-model-free is given; none: "
                    "no pool"),
        "verifier": ("SPECINFER_VERIFIER_SSMS", str, (), "speculate in this process (no speculator): an SSM "
                     "directory or .gguf file, lookup or suffix; repeatable, comma-separated in the variable; lookup "
                     "and suffix join the pool unless one is named (default without --speculator: them alone); "
                     "none: no speculation"),
        "speculator": ("SPECINFER_SSM_DIRS", Path, (), "SSM checkpoint directory or .gguf file, or a model-free "
                       "speculator (lookup, suffix) hosted next to the SSMs; repeatable; the variable is "
                       "comma-separated; lookup and suffix join the pool unless one is named"),
        "boost-tune": (NONE, Path, [], "SSM checkpoint directory or .gguf file (repeatable; pool order: SSM 1 "
                       "first); the tuned SSMs are written as checkpoint directories"),
    })
    return Flag("--ssm", env, parse, default, help_text, is_list=True, is_required=of == "boost-tune")


def model_free_flag(where: str = "the pool") -> Flag:
    return Flag("--model-free", "SPECINFER_MODEL_FREE", parse_bool, True,
                f"lookup and suffix join {where} (a pool naming either is taken as given)", is_switch=True)


def suffix_cache_tokens_flag() -> Flag:
    return Flag("--suffix-cache-tokens", "SPECINFER_SUFFIX_CACHE_TOKENS", int, SUFFIX_CACHE_TOKENS,
                "tokens of recent outputs the suffix member shares across requests (0: each request drafts from "
                "its own context)", low=0)


def ssm_dtype_flag() -> Flag:
    return Flag("--ssm-dtype", "SPECINFER_SSM_DTYPE", one_of(SSM_DTYPES), DEFAULT_SSM_DTYPE,
                "the SSMs' dtype: auto (the fastest on this machine, measured when they load) or a dtype")


def dtype_flag(of: str = "llm") -> Flag:
    """--dtype: the LLM's weights dtype; a speculator, which hosts SSMs only, takes --ssm-dtype's
    setting (its variable, values and default) under this name."""
    ssm = ssm_dtype_flag()
    env, parse, default, help_text = _variant(of, {
        "llm": ("SPECINFER_DTYPE", one_of(MODEL_DTYPES), DEFAULT_DTYPE, "the LLM's weights dtype"),
        "ssm": (ssm.env, ssm.parse, ssm.default, ssm.help),
    })
    return Flag("--dtype", env, parse, default, help_text)


def dtype_flags() -> list[Flag]:
    return [dtype_flag(), ssm_dtype_flag()]


def device_flag(of: str = "command") -> Flag:
    env, help_text = _variant(of, {
        "command": (NONE, "cpu, cuda, cuda:N or auto (default)"),
        "verifier": ("SPECINFER_LLM_DEVICE", "cpu, cuda, cuda:N or auto"),
        "speculator": ("SPECINFER_SSM_DEVICE", "cpu, cuda, cuda:N or auto"),
    })
    return Flag("--device", env, str, DEFAULT_DEVICE, help_text)


def cache_dir_flag(of: str = "service") -> Flag:
    """Where load-time measurements (the SSMs' dtype) and the demo models are cached; without it,
    $SPECINFER_CACHE_DIR, else ~/.cache/specinfer (`specinfer.util.default_cache_dir`)."""
    help_text = _variant(of, {
        "service": "where load-time measurements are cached; unwritable: measured at every start",
        "command": "where demo models are built and cached, and the SSMs' measured dtype",
    })
    return Flag("--cache-dir", CACHE_DIR_ENV, Path, None, help_text, shown_default="~/.cache/specinfer")


def tensor_parallel_flag(of: str = "command") -> Flag:
    env, help_text = _variant(of, {
        "command": (NONE, "shard the LLM over N processes on this host (GPUs with NCCL, else CPU with gloo)"),
        "up": (NONE, "shard the LLM over N verifier processes (GPUs with NCCL, else CPU with gloo)"),
        "verifier": ("SPECINFER_TENSOR_PARALLEL", "shard the LLM over this many ranks (GPUs); under torchrun, its "
                     "WORLD_SIZE"),
    })
    return Flag("--tensor-parallel", env, int, DEFAULT_TENSOR_PARALLEL, help_text, is_positive=True,
                metavar=None if env else "N")


def max_batch_flag(of: str) -> Flag:
    help_text = _variant(of, {"verifier": "requests per forward pass", "speculator": "requests per SSM forward pass"})
    return Flag("--max-batch", "SPECINFER_MAX_BATCH", int, DEFAULT_MAX_BATCH, help_text, is_positive=True)


def attention_flag() -> Flag:
    return Flag("--attention", "SPECINFER_ATTENTION", one_of(ATTENTION_BACKENDS), DEFAULT_ATTENTION,
                "attention backend: triton (one fused tree-attention launch per layer over the paged KV cache), "
                "sdpa (torch per request with a dense mask), or auto: triton on CUDA when importable, else sdpa")


def cuda_graphs_flag() -> Flag:
    return Flag("--cuda-graphs", "SPECINFER_CUDA_GRAPHS", _auto_switch("CUDA graphs"), None,
                "replay captured decode/verify steps: auto (on with CUDA and the Triton backend), on or off",
                shown_default="auto", is_switch=True)


def offload_flag() -> Flag:
    return Flag("--offload", "SPECINFER_OFFLOAD", parse_bool, False,
                "keep the LLM's layer weights in pinned host memory, streamed to the GPU per layer", is_switch=True)


def exec_flags(llm: bool) -> list[Flag]:
    """How the models execute (engine.config.ExecConfig); `llm` adds offloading, which only the LLM has."""
    return [attention_flag(), cuda_graphs_flag()] + ([offload_flag()] if llm else [])


def prefix_caching_flag() -> Flag:
    return Flag("--prefix-caching", "SPECINFER_PREFIX_CACHING", parse_bool, DEFAULT_IS_PREFIX_CACHING,
                "share the KV of full prompt blocks across requests with the same prefix (off: only within a "
                "session or one request's samples)", is_switch=True)


def kv_budget_flag() -> Flag:
    return Flag("--kv-budget", ("SPECINFER_KV_BUDGET", "SPECINFER_KV_TOKENS"), parse_kv_budget, (0, 0),
                "the LLM's KV cache: tokens (65536), bytes (2GiB, 512MB), or auto: --kv-memory-fraction of the "
                "memory free once the weights are loaded, at most what --max-batch requests of the longest allowed "
                "length use", shown_default="auto")


def kv_memory_fraction_flag() -> Flag:
    return Flag("--kv-memory-fraction", "SPECINFER_KV_MEMORY_FRACTION", float, None,
                "with --kv-budget auto: the share of the memory free once the weights are loaded (host RAM, or the "
                "GPU's) that the KV cache takes, as vLLM's --gpu-memory-utilization",
                shown_default=f"{DEFAULT_KV_MEMORY_FRACTION_CUDA:g} on CUDA, {DEFAULT_KV_MEMORY_FRACTION_CPU:g} on CPU",
                is_positive=True, high=1.0)


def kv_flags() -> list[Flag]:
    """The LLM's KV-cache size (`engine.runtime.memory.plan_kv`)."""
    return [kv_budget_flag(), kv_memory_fraction_flag()]


# ---- token trees and decoding -----------------------------------------------------------------
def tree_width_flag(of: str = "command") -> Flag:
    """--tree-width: children per level of the static token tree (the paper's expansion config)."""
    env, parse, default, help_text = _variant(of, {
        "command": (NONE, str, ",".join(map(str, PAPER_TREE_WIDTH)), "the static expansion of tree and sequence "
                    "modes: children per level, e.g. 1,1,3,1 (default: the paper's)"),
        "up": (NONE, str, ",".join(map(str, PAPER_TREE_WIDTH)), None),
        "verifier": ("SPECINFER_TREE_WIDTH", parse_tree_width, PAPER_TREE_WIDTH,
                     "default token-tree shape: children per level"),
        "client": (NONE, _tree_width, None, "children per level, e.g. 1,1,3"),
    })
    return Flag("--tree-width", env, parse, default, help_text or "")


def max_tree_nodes_flag(of: str = "command") -> Flag:
    env, help_text = _variant(of, {"command": (NONE, "cap on a static tree's nodes per step"),
                                   "verifier": ("SPECINFER_MAX_TREE_NODES", "token-tree nodes per step")})
    return Flag("--max-tree-nodes", env, int, DEFAULT_MAX_TREE_NODES, help_text, low=1, high=MAX_TREE_NODES)


def spec_flags() -> list[Flag]:
    """How `generate` and `bench` speculate: the static tree, pruning, prefix caching."""
    return [tree_width_flag(), max_tree_nodes_flag(),
            Flag("--min-path-prob", NONE, float, DEFAULT_MIN_PATH_PROB,
                 "prune tree branches whose SSM path probability is below this (0 = off)"),
            prefix_caching_flag()]


def model_flags() -> list[Flag]:
    """The models `generate` and `bench` run, and how."""
    return [llm_flag(), ssm_flag(), model_free_flag("the SSM pool"), *dtype_flags(), device_flag(),
            cache_dir_flag("command"), tensor_parallel_flag(), *exec_flags(llm=True)]


# ---- a request --------------------------------------------------------------------------------
def prompt_flag(of: str = "generate") -> Flag:
    help_text = _variant(of, {
        "generate": "prompt text",
        "client": None,
        "up": "send this prompt through the gateway once the stack is up, as a chat message in the model's chat "
              "template; its text is printed as it comes, then one line of statistics",
    })
    return Flag("--prompt", NONE, str, None, help_text or "", is_required=of == "client")


def prompts_flag(of: str = "generate") -> Flag:
    help_text = _variant(of, {"generate": 'JSONL file with one {"prompt": "..."} per line',
                              "bench": "JSONL prompts (default: the demo models' held-out prompts)"})
    return Flag("--prompts", NONE, Path, None, help_text)


def max_new_tokens_flag() -> Flag:
    return Flag("--max-new-tokens", NONE, int, DEFAULT_MAX_NEW_TOKENS, "")


def max_tokens_flag(of: str) -> Flag:
    """--max-tokens: a service's limit on generated tokens per request, or what one request asks for."""
    limits = RequestLimits()
    env, default, help_text, is_positive = _variant(of, {
        "gateway": ("SPECINFER_MAX_TOKENS", limits.max_new_tokens, "generated tokens per request", True),
        "verifier": ("SPECINFER_MAX_TOKENS", limits.max_new_tokens, "generated tokens per request (as at the "
                     "gateway)", True),
        "client": (NONE, None, "tokens to generate (default: the gateway's)", False),
        "up": (NONE, UP_PROMPT_MAX_TOKENS, "", False),
    })
    return Flag("--max-tokens", env, int, default, help_text, is_positive=is_positive)


def max_prompt_tokens_flag(of: str) -> Flag:
    help_text = _variant(of, {"gateway": "prompt tokens, session history included",
                              "verifier": "prompt tokens per request, session history included (as at the gateway)"})
    return Flag("--max-prompt-tokens", "SPECINFER_MAX_PROMPT_TOKENS", int, RequestLimits().max_prompt_tokens,
                help_text, is_positive=True)


def default_deadline_flag(of: str) -> Flag:
    help_text = _variant(of, {"gateway": "when the client sets none", "verifier": "when the caller sets no deadline"})
    return Flag("--default-deadline-s", "SPECINFER_DEFAULT_DEADLINE_S", float, DEFAULT_DEADLINE_S, help_text,
                is_positive=True)


def temperature_flag(of: str = "generate", default: float = DEFAULT_TEMPERATURE) -> Flag:
    """--temperature: a request's sampling temperature; `boost-tune`'s sampled continuations' (its
    default: `default`)."""
    help_text = _variant(of, {
        "generate": "0 = greedy (default)",
        "bench": "in process: sample every arm at this temperature (seeded per prompt; transformers' arms are left "
                 "out); 0 = greedy (default)",
        "client": "",
        "boost-tune": "for the sampled continuations",
    })
    return Flag("--temperature", NONE, float, default if of == "boost-tune" else DEFAULT_TEMPERATURE, help_text)


def sampling_flags(of: str = "generate") -> list[Flag]:
    """Temperature, top-p, top-k and the seed of `generate` and `client generate`."""
    return [temperature_flag(of), Flag("--top-p", NONE, float, DEFAULT_TOP_P, ""),
            Flag("--top-k", NONE, int, DEFAULT_TOP_K, ""), seed_flag()]


def seed_flag(of: str = "request") -> Flag:
    default = _variant(of, {"request": None, "boost-tune": BOOST_SEED, "make-draft": BOOST_SEED})
    return Flag("--seed", NONE, int, default, "")


def logprobs_flag(of: str) -> Flag:
    help_text = _variant(of, {"client": "return each token's logprob and this many alternatives (0-20)",
                              "bench": "add a tree arm that returns logprobs with this many alternatives"})
    return Flag("--logprobs", NONE, int, None, help_text)


def processor_flags() -> list[Flag]:
    """The logits processors: penalties and min_p."""
    return [
        Flag("--frequency-penalty", NONE, float, DEFAULT_FREQUENCY_PENALTY,
             "OpenAI's, in [-2, 2]: lowers a token's logit by this times its count in the output"),
        Flag("--presence-penalty", NONE, float, DEFAULT_PRESENCE_PENALTY,
             "OpenAI's, in [-2, 2]: lowers the logit of every token the output holds by this"),
        Flag("--repetition-penalty", NONE, float, DEFAULT_REPETITION_PENALTY,
             "transformers', in (0, 10]: over the prompt and the output; 1 = none (default)"),
        Flag("--min-p", NONE, float, DEFAULT_MIN_P,
             "sampled only, in [0, 1]: drops tokens less likely than this times the likeliest one"),
    ]


def constraint_flags() -> list[Flag]:
    """Structured output: one of --json-schema, --regex, --choice (repeatable) or --grammar (`add_exclusive`)."""
    return [
        Flag("--json-schema", NONE, Path, None, "structured output: JSON valid under the JSON Schema in FILE",
             metavar="FILE"),
        Flag("--regex", NONE, str, None, "structured output: text the regular expression matches whole"),
        Flag("--choice", NONE, str, None, "structured output: exactly one of these strings (repeatable)",
             is_list=True),
        Flag("--grammar", NONE, Path, None, "structured output: a sentence of the grammar in FILE (Lark, or GBNF)",
             metavar="FILE"),
    ]


def output_flag(of: str) -> Flag:
    help_text = _variant(of, {"generate": "write JSONL results here (default: stdout)",
                              "bench": "also write the JSON result here"})
    return Flag("--output", NONE, Path, None, help_text)


def json_flag(of: str) -> Flag:
    help_text = _variant(of, {
        "client": "machine output: with --stream one JSON object per piece (without --stream JSON is the default)",
        "up": "print the reply to --prompt as one JSON object instead",
    })
    return Flag("--json", NONE, parse_bool, False, help_text, is_toggle=True)


def generate_flags() -> list[Flag]:
    """`specinfer generate`'s own options (besides `model_flags`, `spec_flags` and the request's)."""
    return [
        max_new_tokens_flag(),
        Flag("--mode", NONE, str, None,
             "default: auto with a pool, else incremental. auto: dynamic trees, each step's grown from the drafts' "
             "calibrated chances of acceptance and sized by the load-aware policy (or none where speculation does "
             "not pay); tree: the static expansion --tree-width; sequence: a chain", choices=DECODE_MODES),
    ]


def generate_request_flags() -> list[Flag]:
    return [*sampling_flags("generate"),
            Flag("--tree-sampling", NONE, str, DEFAULT_TREE_SAMPLING,
                 "how stochastic mode picks tree children: coupled with the LLM's sample, or the SSM's top-k",
                 choices=TREE_SAMPLINGS)]


# ---- stacks: `specinfer up` and `bench --concurrency` -----------------------------------------
def co_located_flag(of: str) -> Flag:
    help_text = _variant(of, {
        "up": "the verifier hosts the SSMs itself (the default: --num-speculators 0)",
        "bench": "with --concurrency: the verifier hosts the SSMs itself (the default: --num-speculators 0)",
    })
    return Flag("--co-located", NONE, parse_bool, False, help_text, is_toggle=True)


def num_speculators_flag(of: str) -> Flag:
    help_text = _variant(of, {
        "up": "speculator processes hosting the SSMs; 0 (the default) = the verifier hosts them itself: one host, "
              "no process hop per step",
        "bench": "with --concurrency: speculator processes hosting the SSMs; 0 = the verifier hosts them, as "
                 "`specinfer up` does by default",
    })
    return Flag("--num-speculators", NONE, int, DEFAULT_NUM_SPECULATORS, help_text)


def num_verifiers_flag(of: str) -> Flag:
    help_text = _variant(of, {
        "up": "verifier processes, each holding the whole LLM (and its own pool), on consecutive ports from "
              "--verifier-port; the gateway sends each request to the one that already holds its prompt's prefix, "
              "balanced by load, and moves running requests off one that stops",
        "bench": "with --shared-prefix-tokens and --concurrency: verifier processes the gateway routes between",
    })
    return Flag("--num-verifiers", NONE, int, DEFAULT_NUM_VERIFIERS, help_text, metavar="N" if of == "up" else None)


def host_flag(of: str) -> Flag:
    env = _variant(of, {"gateway": "SPECINFER_GATEWAY_HOST", "verifier": "SPECINFER_VERIFIER_HOST",
                        "speculator": "SPECINFER_SPECULATOR_HOST"})
    return Flag("--host", env, str, LOCAL_HOST, "bind address")


def port_flag(of: str) -> Flag:
    """--port: a service's gRPC port, or the first port of the stack `bench --concurrency` starts."""
    env, default, help_text = _variant(of, {
        "gateway": ("SPECINFER_GATEWAY_PORT", GATEWAY_PORT, "gRPC port"),
        "verifier": ("SPECINFER_VERIFIER_PORT", VERIFIER_PORT, "gRPC port"),
        "speculator": ("SPECINFER_SPECULATOR_PORT", SPECULATOR_PORT, "gRPC port"),
        "bench": (NONE, BENCH_FIRST_PORT, "with --concurrency: first port of the stack"),
    })
    return Flag("--port", env, int, default, help_text, low=0, high=MAX_PORT)


def http_port_flag(of: str) -> Flag:
    env, default, help_text = _variant(of, {
        "gateway": ("SPECINFER_HTTP_PORT", 0, f"OpenAI-compatible HTTP API port; 0 = off (specinfer up, compose and "
                    f"Kubernetes use {HTTP_PORT})"),
        "up": (NONE, HTTP_PORT, "OpenAI-compatible HTTP API; 0 = off"),
    })
    return Flag("--http-port", env, int, default, help_text, low=0, high=MAX_PORT)


def metrics_port_flag(of: str, default: int = 0) -> Flag:
    """--metrics-port: a service's Prometheus /metrics port, or the first of a stack's."""
    env, default, help_text = _variant(of, {
        "service": ("SPECINFER_METRICS_PORT", default, "Prometheus /metrics port; 0 = off"),
        "up": (NONE, STACK_METRICS_PORT, "gateway /metrics port; the others follow it"),
    })
    return Flag("--metrics-port", env, int, default, help_text, low=0, high=MAX_PORT)


def redis_url_flag() -> Flag:
    return Flag("--redis-url", "SPECINFER_REDIS_URL", str, None, "redis://host:port/db; unset = in-memory store")


def chat_template_flag() -> Flag:
    return Flag("--chat-template", "SPECINFER_CHAT_TEMPLATE", Path, None,
                "a Jinja chat template file for /v1/chat/completions, overriding the checkpoint's (a base model "
                "without one can then serve chat)", metavar="FILE")


def up_flags() -> list[Flag]:
    """`specinfer up`: the stack's processes and ports, and the prompt it may answer."""
    return [
        llm_flag(), ssm_flag(), model_free_flag("the SSM pool"), co_located_flag("up"), cache_dir_flag("command"),
        num_speculators_flag("up"),
        Flag("--gateway-port", NONE, int, GATEWAY_PORT, ""),
        http_port_flag("up"), chat_template_flag(), num_verifiers_flag("up"),
        Flag("--verifier-port", NONE, int, VERIFIER_PORT, "first verifier's port"),
        Flag("--speculator-port", NONE, int, SPECULATOR_PORT, "first speculator's port"),
        redis_url_flag(), *dtype_flags(), tree_width_flag("up"), tensor_parallel_flag("up"), metrics_port_flag("up"),
        prefix_caching_flag(), *exec_flags(llm=True), *kv_flags(), otlp_endpoint_flag(),
        prompt_flag("up"),
        Flag("--raw", NONE, parse_bool, False, "send --prompt as plain completion text instead of a chat message",
             is_toggle=True),
        json_flag("up"), max_tokens_flag("up"),
        Flag("--once", NONE, parse_bool, False, "exit after answering --prompt", is_toggle=True),
    ]


def num_prompts_flag(of: str, default: int = BENCH_NUM_PROMPTS) -> Flag:
    """--num-prompts: `bench` uses only the first N; `boost-tune` trains on N (its default: `default`)."""
    help_text = _variant(of, {"bench": "use only the first N prompts (0 = all)", "boost-tune": "training prompts"})
    return Flag("--num-prompts", NONE, int, default if of == "boost-tune" else BENCH_NUM_PROMPTS, help_text)


def bench_flags() -> list[Flag]:
    """`specinfer bench`'s prompts and how it speculates (besides `model_flags` and the request's)."""
    return [
        prompts_flag("bench"), max_new_tokens_flag(), *spec_flags(), num_prompts_flag("bench"),
        Flag("--no-transformers", NONE, parse_bool, False, "skip transformers' assisted generation", is_toggle=True),
        temperature_flag("bench"),
    ]


def bench_arm_flags() -> list[Flag]:
    threads = "with --concurrency: torch threads (0 = default)"
    return [
        logprobs_flag("bench"),
        Flag("--samples", NONE, int, BENCH_NUM_SAMPLES,
             "N > 1 adds two tree arms of N samples per prompt: sharing the prompt's KV, and not"),
        output_flag("bench"),
        Flag("--shared-prefix-tokens", NONE, int, BENCH_SHARED_PREFIX_TOKENS,
             "benchmark prefix caching instead: every prompt starts with one shared prefix of about this many "
             "tokens; in process, time to first token cold against cached, and throughput with caching on against "
             "off; with --concurrency, through the stack: how often the gateway sends a request where its prefix is "
             "cached"),
        num_verifiers_flag("bench"),
        Flag("--prefix-groups", NONE, int, BENCH_PREFIX_GROUPS,
             "with --shared-prefix-tokens and --concurrency: distinct shared prefixes, their requests interleaved"),
        Flag("--concurrency-in-process", NONE, int, BENCH_CONCURRENCY_IN_PROCESS,
             "with --shared-prefix-tokens: requests that arrive together in the throughput arms"),
        Flag("--rounds-in-process", NONE, int, BENCH_ROUNDS_IN_PROCESS,
             "with --shared-prefix-tokens: interleaved rounds of the throughput arms"),
        Flag("--concurrency", NONE, str, None, "e.g. 1,2,4,8,16: benchmark the services under load instead"),
        Flag("--requests-per-level", NONE, int, BENCH_REQUESTS_PER_LEVEL, "with --concurrency: requests per arm"),
        Flag("--rounds", NONE, int, BENCH_ROUNDS,
             "with --concurrency: interleave the arms in this many rounds per level (noisy machines)"),
        Flag("--temperatures", NONE, str, BENCH_TEMPERATURES, "with --concurrency: comma-separated temperatures"),
        co_located_flag("bench"), num_speculators_flag("bench"),
        Flag("--noisy-phase-s", NONE, float, BENCH_NOISY_PHASE_S,
             "with --concurrency: first busy every CPU for this long while load-aware requests run, then measure "
             "(the policy starts from verdicts made under other load)"),
        Flag("--compare-pipeline", NONE, parse_bool, False,
             "with --concurrency: add arms whose speculator drafts ahead, against one that does not (two "
             "speculator processes)", is_toggle=True),
        Flag("--adaptive-admission", NONE, parse_bool, False,
             "with --concurrency: keep the gateway's measured admission limit (one limit for all arms, so one arm's "
             "latencies set the next arm's); default: a fixed limit, so the arms compare decoding alone",
             is_toggle=True),
        Flag("--shared-suffix-cache", NONE, parse_bool, False,
             "with --concurrency: keep the suffix member's cache of recent outputs shared across requests (off by "
             "default here: every arm and round sends the same prompts, so it would draft each output from an "
             "earlier arm's)", is_toggle=True),
        port_flag("bench"),
        Flag("--verifier-threads", NONE, int, DEFAULT_NUM_THREADS, threads),
        Flag("--speculator-threads", NONE, int, DEFAULT_NUM_THREADS, threads),
        Flag("--omp-wait-policy", NONE, str, None, "with --concurrency: OpenMP idle waits", choices=OMP_WAIT_POLICIES),
        *kv_flags(),  # with --concurrency: the stack's verifiers' (in process, the cache fits the prompts)
    ]


def demo_models_flags() -> list[Flag]:
    return [cache_dir_flag("command"),
            Flag("--tiny", NONE, parse_bool, False, "instead, a tiny LLM and SSMs trained here from Python's "
                 "standard library (no download; for tests)", is_toggle=True),
            Flag("--force", NONE, parse_bool, False, "rebuild even if cached", is_toggle=True),
            Flag("--background", NONE, parse_bool, False, "build as `specinfer up` does beside a running stack: "
                 "a running `specinfer up` stops the build while it (or other work) wants the CPUs, and "
                 "the time stopped does not count against the build's budget", is_toggle=True)]


# ---- `specinfer client` and the health probe --------------------------------------------------
def timeout_flag(of: str) -> Flag:
    default, help_text = _variant(of, {
        "client": (CLIENT_DEADLINE_S, f"deadline in seconds (default {CLIENT_DEADLINE_S:g})"),
        "healthcheck": (HEALTHCHECK_TIMEOUT_S, f"seconds to wait for the answer (default {HEALTHCHECK_TIMEOUT_S:g})"),
    })
    return Flag("--timeout", NONE, float, default, help_text)


def client_flags(default_target: str, token_env: str) -> list[Flag]:
    """What every `specinfer client` command takes: the gateway, the deadline, the bearer token."""
    return [
        Flag("--target", "SPECINFER_GATEWAY_TARGET", str, default_target, "gateway host:port"),
        timeout_flag("client"),
        Flag("--token", token_env, str, None, "the gateway's bearer token; TLS: env SPECINFER_TLS_CA (and "
             "SPECINFER_TLS_CLIENT_CERT/_KEY for mTLS)"),
    ]


def client_generate_flags() -> list[Flag]:
    """`specinfer client generate`'s request options (besides the processors and the constraint)."""
    return [
        prompt_flag("client"), max_tokens_flag("client"), *sampling_flags("client"),
        Flag("--stop", NONE, str, [], "stop sequences", nargs="+"),
        Flag("--stop-token-id", NONE, int, [], "a token id that ends generation, besides EOS (repeatable)",
             is_list=True),
        logprobs_flag("client"),
        Flag("--n", NONE, int, None, "independent samples of the prompt (default 1)", short="-n"),
    ]


def client_shape_flags() -> list[Flag]:
    return [
        Flag("--no-speculate", NONE, parse_bool, False, "plain incremental decoding", is_toggle=True),
        tree_width_flag("client"),
        Flag("--ssm-name", NONE, str, [], "SSM pool member to use (repeatable)", is_list=True),
        Flag("--tree-policy", NONE, str, None, "how the pool's trees combine", choices=TREE_POLICIES),
        Flag("--session", NONE, str, "", "session id to continue"),
        Flag("--request-id", NONE, str, "", ""),
        Flag("--stream", NONE, parse_bool, False,
             "print the text as it comes, then one line of statistics (JSON lines with --json)", is_toggle=True),
        json_flag("client"),
    ]


def request_id_argument() -> Flag:
    return Flag("request_id", NONE, str, None, "")


def quiet_flag(of: str) -> Flag:
    help_text = _variant(of, {"healthcheck": "print nothing", "boost-tune": "no progress bars",
                              "make-draft": "no progress"})
    return Flag("--quiet", NONE, parse_bool, False, help_text, is_toggle=True,
                short="-q" if of == "healthcheck" else None)


def out_flag(of: str) -> Flag:
    help_text = _variant(of, {"make-ssm": "output checkpoint directory", "boost-tune": "output directory",
                              "make-draft": "the draft's checkpoint directory (then: --ssm OUT)"})
    return Flag("--out", NONE, Path, None, help_text, is_required=True)


def healthcheck_flags() -> list[Flag]:
    return [
        Flag("target", NONE, str, None, "HOST:PORT of the gRPC server, e.g. 127.0.0.1:50051"),
        Flag("service", NONE, str, "", 'service name, e.g. specinfer.v1.Gateway (default "": the whole server)',
             nargs="?"),
        timeout_flag("healthcheck"), quiet_flag("healthcheck"),
    ]


# ---- what every service has -------------------------------------------------------------------
def otlp_endpoint_flag(default: str | None = None) -> Flag:
    """Where traces go: every service's, and `specinfer up`'s for its stack."""
    return Flag("--otlp-endpoint", "SPECINFER_OTLP_ENDPOINT", str, default, "OTLP/gRPC trace endpoint; unset = off")


def common_flags(defaults: dict[str, Any], has_threads: bool = True) -> list[Flag]:
    """The settings every service has: tracing, metrics, logs, draining, the message size bound
    (and torch threads for the model services). `defaults` maps the config's field names to
    their defaults."""
    flags = [
        otlp_endpoint_flag(defaults["otlp_endpoint"]),
        metrics_port_flag("service", defaults["metrics_port"]),
        Flag("--log-level", "SPECINFER_LOG_LEVEL", one_of(LOG_LEVELS), defaults["log_level"], ", ".join(LOG_LEVELS)),
        Flag("--instance-id", "SPECINFER_INSTANCE_ID", str, defaults.get("instance_id", ""),
             "a name for this process: its health service also answers SERVING for specinfer.instance.<id>, so "
             "whoever started it can tell it from another process on its port; unset = none"),
        Flag("--parent-pid", "SPECINFER_PARENT_PID", int, defaults.get("parent_pid", 0),
             "the process that supervises this one: once it is gone (re-parented), this one drains and exits "
             "as on SIGTERM, so that it never outlives its launcher (`specinfer up` sets it); 0 = none", low=0),
        Flag("--grace-s", "SPECINFER_GRACE_S", float, defaults["grace_s"],
             "the most a drain on SIGTERM takes: requests in flight get the time their tokens left need at the "
             "measured speed, within this; one that cannot finish is handed over (set the orchestrator's grace "
             "period, e.g. terminationGracePeriodSeconds, to the same value)", low=0),
        Flag("--max-message-bytes", "SPECINFER_MAX_MESSAGE_BYTES", parse_bytes, defaults["max_message_bytes"],
             "largest gRPC message received or sent, by this server and the channels it opens (4MiB, 512KiB)",
             low=MIN_MESSAGE_BYTES, high=MAX_MESSAGE_BYTES, shown_default=format_bytes(defaults["max_message_bytes"])),
    ]
    if has_threads:
        flags.append(Flag("--threads", "SPECINFER_THREADS", int, defaults["num_threads"],
                          "torch intra-op threads (0 = torch's default)", low=0))
    return flags


def security_flags(token_file_env: str = "SPECINFER_AUTH_TOKEN_FILE", token_env: str = "SPECINFER_AUTH_TOKEN",
                   outbound_token_env: str | None = None, has_channels: bool = True) -> list[Flag]:
    """A service's authentication and TLS settings (read by `specinfer.serving.security`): the
    bearer token callers must send, its TLS certificate (and client CA for mTLS), and, for a
    service that calls another, the CA its channels trust and its client certificate.
    `outbound_token_env`: the file variable of the token it sends (--internal-token-file), when
    that is not the one it checks."""
    flags = [
        Flag("--auth-token-file", token_file_env, Path, None,
             f"file holding the bearer token every call but health checks must send (or the token itself in "
             f"{token_env}); unset = no authentication"),
        Flag("--tls-cert", "SPECINFER_TLS_CERT", Path, None, "PEM server certificate: serve TLS"),
        Flag("--tls-key", "SPECINFER_TLS_KEY", Path, None, "PEM private key of --tls-cert"),
        Flag("--tls-client-ca", "SPECINFER_TLS_CLIENT_CA", Path, None,
             "PEM CA: require client certificates signed by it (mTLS)"),
    ]
    if outbound_token_env is not None:
        flags.append(Flag("--internal-token-file", outbound_token_env, Path, None,
                          "file holding the internal bearer token sent downstream (or the token itself in "
                          f"{outbound_token_env.removesuffix('_FILE')})"))
    if has_channels:
        flags += [
            Flag("--tls-ca", "SPECINFER_TLS_CA", Path, None, "PEM CA that outbound channels trust: use TLS"),
            Flag("--tls-client-cert", "SPECINFER_TLS_CLIENT_CERT", Path, None,
                 "PEM client certificate outbound channels present (mTLS)"),
            Flag("--tls-client-key", "SPECINFER_TLS_CLIENT_KEY", Path, None, "PEM private key of --tls-client-cert"),
        ]
    return flags
