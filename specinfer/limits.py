"""Every limit and default, in one place, with one validation function per message.

The token-tree defaults are SpecInfer's (Section 3.1: the expansion config <1,1,3,1,1,1,1,1>).
A limit here has one value wherever a message enters: the gateway, the verifier, the speculators
and the command line all check against these. Plain Python: the gateway imports this too.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from specinfer.errors import UserError

# ---- token trees (SpecInfer Section 3.1) -----------------------------------------------------
PAPER_TREE_WIDTH = (1, 1, 3, 1, 1, 1, 1, 1)  # the paper's expansion config <k1, ..., km>
DEFAULT_MAX_TREE_NODES = 64
TREE_POLICIES = ("merge", "mixed")
MAX_TREE_DEPTH = 16
MAX_TREE_WIDTH = 64  # children per node at one level
MAX_TREE_NODES = 1024

# ---- dynamic token trees (specinfer/engine/drafting/dynamic.py): the default for requests naming no widths
DYNAMIC_MAX_NODES = 32  # nodes beyond the root of one step's tree (each is a token in the LLM's pass)
DYNAMIC_MAX_DEPTH = 16  # levels of one step's tree
DYNAMIC_EXPAND_TOP_K = 4  # children an SSM proposes at each node it expands
DYNAMIC_EXPAND_WIDTH = 4  # nodes of one level an SSM expands (the most valuable ones)

# ---- model-free pool members (specinfer/engine/drafting/lookup.py, suffix.py) --------------------------
MODEL_FREE_NAMES = ("lookup", "suffix")  # pool names that need no checkpoint
MODEL_FREE_MAX_DEPTH = 16  # draft depth of a model-free tree (within what the request has left)
MODEL_FREE_MAX_NODES = 24  # nodes of one model-free tree (each is a token in the LLM's pass)
LOOKUP_MAX_NGRAM = 4  # the longest context suffix prompt lookup matches
LOOKUP_MIN_NGRAM = 1
LOOKUP_MAX_PATHS = 2  # distinct continuations drafted
SUFFIX_MAX_PATTERN = 8  # the longest context suffix the suffix speculator matches
SUFFIX_CACHE_TOKENS = 16384  # recent outputs shared across requests
SUFFIX_MIN_PROB = 0.1  # a branch's empirical probability below this is not drafted
SUFFIX_DEPTH_PER_MATCH = 2.0  # draft depth per matched token (adaptive depth)
SUFFIX_MAX_SOURCES = 32  # continuations counted per source (the context, the cache, a draft's answers)
SUFFIX_SEED_TOKENS = 65536  # of a draft's stored answers, the most the suffix member reads

# ---- model dtypes (specinfer/engine/runtime/dtype_choice.py) -------------------------------------------
MODEL_DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_DTYPE = "float32"  # the LLM's (and a runner's) dtype when none is given
AUTO_DTYPE = "auto"  # the SSMs' dtype: the fastest on this machine, measured once when they load
# SSMs only, on a CPU with the matrix kernel: float32 arithmetic over the matrices as 8-bit codes with a
# float32 scale a block of 32 (GGUF's Q8_0 layout), a quarter of float32's bytes a pass.
Q8_DTYPE = "q8_0"
SSM_DTYPES = (AUTO_DTYPE, *MODEL_DTYPES, Q8_DTYPE)
DEFAULT_SSM_DTYPE = AUTO_DTYPE  # SSMs only propose: their dtype never changes the output
ATTENTION_BACKENDS = ("auto", "triton", "sdpa")  # engine.runtime.exec_config.ExecConfig.attention
DEFAULT_ATTENTION = "auto"  # Triton on CUDA when importable, else SDPA

# ---- sampling --------------------------------------------------------------------------------
# Below this temperature decoding is greedy: the warped distribution is the argmax there anyway,
# and dividing logits by a far smaller temperature overflows to inf/NaN probabilities.
MIN_SAMPLING_TEMPERATURE = 1e-5
MAX_PENALTY = 2.0  # |frequency_penalty| and |presence_penalty| (OpenAI's range)
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 100.0  # |bias| of one token (OpenAI's range)
MAX_LOGIT_BIAS_TOKENS = 1024

# Structured output: what a request may ask, and what compiling it may cost.
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_CONSTRAINT_CHARS = 65536  # a schema, regex or grammar as text
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 4096  # one choice
DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S = 10.0  # longer, and the request fails (the compile is abandoned)
DEFAULT_GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept per verifier
DEFAULT_MAX_FORCED_TOKENS = 16  # tokens a grammar forces that one step drafts for free

# ---- the load-aware policy's calibration (specinfer/engine/runtime/calibration.py) -------------
CALIBRATION_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # tokens per timed LLM pass
CALIBRATION_CONTEXT = 256  # committed tokens the timed passes attend to
CALIBRATION_TOKENS = CALIBRATION_CONTEXT + CALIBRATION_SIZES[-1]  # the KV slots calibration needs

# ---- serving capacity: the scheduler, the verifier and the speculators ----------------------
DEFAULT_KV_TOKENS = 65536  # a speculator's KV-cache budget in tokens (its SSMs are small)
# The verifier's default KV cache (specinfer/engine/runtime/memory.py): this share of the memory free
# once the weights are loaded, within what --max-batch requests of the longest allowed length use.
DEFAULT_KV_MEMORY_FRACTION_CUDA = 0.9  # the device is there for the model (vLLM's --gpu-memory-utilization)
DEFAULT_KV_MEMORY_FRACTION_CPU = 0.01  # the machine shares its RAM; decoding speed bounds a CPU's batch
DEFAULT_RUNNER_KV_TOKENS = 8192  # a runner loaded in process (the CLI, tools) when its caller names no budget
DEFAULT_MAX_BATCH = 256  # requests in one forward pass
# Speculators draft a greedy request's next tree while its tree is verified: None = where the SSMs
# run on an accelerator (on a CPU the drafts ahead compete with the LLM's pass for cores).
DEFAULT_PIPELINE: bool | None = None
DEFAULT_TOKEN_BUDGET = 512  # tokens per LLM pass: trees first, then prompt chunks
DEFAULT_MAX_WAITING = 64  # requests queued for KV memory before RESOURCE_EXHAUSTED
DEFAULT_ADMISSION_TIMEOUT_S = 30.0  # longest wait for KV memory
DEFAULT_MAX_SESSIONS = 64  # sessions whose cached KV blocks the verifier can release by name
DEFAULT_IS_PREFIX_CACHING = True  # full committed KV blocks are shared by every request with the same prefix
DEFAULT_DEADLINE_S = 300.0  # a request's deadline when its caller sets none
PREFIX_GROUP_WAIT_S = 2.0  # longest a sample waits for another to read the prompt they share

# ---- where the services listen, and how long the gateway keeps state -------------------------
GATEWAY_PORT = 50051
HTTP_PORT = 8000  # the gateway's OpenAI-compatible HTTP API
VERIFIER_PORT = 50052
SPECULATOR_PORT = 50053  # the first speculator's; the next ones follow
DEFAULT_REQUEST_TTL_S = 24 * 3600  # a request's state in the store
DEFAULT_SESSION_TTL_S = 24 * 3600  # a session's

# ---- gateway admission (services/gateway/admission.py) ----------------------------------------
DEFAULT_MAX_CONCURRENT_REQUESTS = 64  # hard cap on requests running through one gateway
DEFAULT_MIN_RUNNING = 1  # the measured limit never goes below this
DEFAULT_INITIAL_RUNNING = 1  # the limit before anything is measured (it rises by probing)
# An admitted request's latency stays within (latency factor + queue factor) x its unloaded one:
# running, each token takes at most the latency factor times as long as alone; it waits in the
# queue at most the queue factor times its unloaded run (a longer predicted wait is refused at once).
DEFAULT_ADMISSION_LATENCY_FACTOR = 1.5  # admit while time per output token <= this x the unloaded one
DEFAULT_ADMISSION_QUEUE_FACTOR = 0.25  # queue while the predicted wait <= this x the unloaded run
DEFAULT_MAX_QUEUED_REQUESTS = 64  # requests waiting for a slot before RESOURCE_EXHAUSTED
DEFAULT_ADMISSION_QUEUE_TIMEOUT_S = 5.0  # longest wait for a slot, whatever the prediction
ADMISSION_MIN_QUEUE_WAIT_S = 0.1  # a request may always wait this long (the queue factor of a short one is less)
PACE_WINDOW = 32  # the present time per token: the median of this many recent samples
VERIFIER_LOAD_POLL_S = 0.5  # how often a gateway asks each serving verifier what it serves (Verifier.Info)
ADMISSION_SAMPLE_WINDOW = 256  # the most recent step samples the latency fit uses
ADMISSION_SAMPLE_MAX_AGE_S = 60.0  # ... none older than this (a shared machine's load changes)
ADMISSION_MIN_SAMPLES = 16  # samples before the latency fit is trusted
ADMISSION_MIN_POINT_SAMPLES = 8  # a verifier's reported load level counts in the fit with this many samples
ADMISSION_MIN_LOAD_VARIANCE = 0.05  # the load must have varied this much for a fit
ADMISSION_SAMPLES_PER_PROBE = 32  # new samples between two probing raises of the limit
ADMISSION_PROBE_DELAY_S = 1.0  # refusals raise the limit only this long after the first (not within one burst)

# ---- draining on SIGTERM (specinfer/serving/drain.py) --------------------------------------------
# --grace-s: the whole time a service has between SIGTERM and a kill (compose's stop_grace_period
# and Kubernetes' terminationGracePeriodSeconds are set from the same value). A drain lasts until
# the requests in flight are done, and at most the grace less the handover margin: what is still
# running then is handed over. One predicted (tokens left at the measured speed) to need more than
# DRAIN_HOPELESS_FACTOR times that is handed over at once; the plan adds a safety factor and slack.
DEFAULT_GRACE_S = 30.0
DRAIN_SAFETY_FACTOR = 1.5
DRAIN_SLACK_S = 1.0
DRAIN_HOPELESS_FACTOR = 2.0
DRAIN_HANDOVER_S = 2.0  # the end of the grace kept for handing over what is left, and exiting
DRAIN_HANDOVER_SHARE = 0.2  # ... at most this share of a short grace
DRAIN_POLL_S = 0.1  # how often a drain checks whether its requests are done
LAUNCHER_GRACE_S = 15.0  # `specinfer up` on Ctrl-C / SIGTERM: its services' grace, and how long it waits for them
DRAFT_WATCH_INTERVAL_S = 5.0  # `specinfer up`: how often it looks whether the demo draft's background build has ended
# Other processes' CPU use, in cores on average (specinfer/cpu_load.py): at least this much during a
# start-up measurement makes it a busy one (not cached); while the demo draft builds in the
# background beside `specinfer up`, this much stops the build until they are done (see below)
OTHER_WORK_CORES = 0.5
DRAFT_YIELD_INTERVAL_S = 0.25  # how often `specinfer up` samples the CPUs for its background draft build
DRAFT_RESUME_AFTER = 4  # ... and how many quiet samples in a row resume a stopped build (one second)
PARENT_WATCH_S = 1.0  # how often a service started with --parent-pid checks that its parent still runs

# ---- routing over several verifiers (services/gateway/routing.py, verifier_pool.py) --------------
DEFAULT_KV_BLOCK_SIZE = 16  # tokens per KV block: the verifiers' paged cache, and the gateway's prefix hashes
# A request goes to the verifier that holds the longest leading run of its prompt's blocks, unless
# that verifier is busier than the least loaded one by more than BALANCE_ABS in-flight requests
# and more than BALANCE_RATIO times as busy (then the least loaded takes it, as SGLang's router).
DEFAULT_ROUTING_BALANCE_ABS = 8
DEFAULT_ROUTING_BALANCE_RATIO = 1.5
DEFAULT_ROUTING_INDEX_BLOCKS = 65536  # block hashes remembered per verifier (least recently sent go first)
DEFAULT_ROUTING_MAX_AFFINITIES = 65536  # sessions and sample groups whose verifier is remembered
DEFAULT_DNS_REFRESH_S = 5.0  # how often a dns:/// verifier address is resolved again
HEALTH_POLL_S = 0.2  # how often each verifier's health is checked: membership follows SERVING
HEALTH_TIMEOUT_S = 1.0  # one health check
ROUTE_WAIT_S = 1.0  # longest a request waits for a verifier to serve before it fails (resumable)
MAX_VERIFIER_ATTEMPTS = 8  # verifier calls one request makes before it gives up (stays resumable)

# ---- messages on the wire: every server and every channel a service opens ------------------
# The largest legitimate message is a whole response with logprobs (Gateway.Generate,
# Verifier.Generate): at the default request limits (512 tokens, n = MAX_SAMPLES = 16, sample 0
# repeated at the top) and MAX_LOGPROBS alternatives, each token's logprobs take <= 153 bytes (a
# token id <= 3 bytes for vocabularies < 2**21, a logprob 4), so with ~4 bytes of text per token
# the response is 1.42 MB, under 4 MiB (4.19 MB). A token tree (Speculator -> Verifier) is just
# tokens and parents: at most MAX_TREE_NODES nodes, 5.0 KB. A tree over the bound fails only that
# speculator's stream (the request goes on without it). Prompts are smaller: 2048 prompt tokens
# are ~6 KB of ids (Verifier.Generate, Speculate's start) and tens of KB of text (Gateway.Generate).
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20  # gRPC's own default too
MIN_MESSAGE_BYTES = 64 << 10  # a floor that still fits the largest token tree and long prompts
MAX_MESSAGE_BYTES = (2 << 30) - 1  # gRPC's channel arguments are 32-bit ints
MAX_METADATA_BYTES = 16 << 10  # request and response headers (trace context, status details)
MAX_STATUS_DETAILS_CHARS = 1024  # an error's message is cut to this, so its trailer always fits

# ---- reconnecting to a peer that restarted: every channel a service opens ---------------------
# gRPC's own backoff grows to 120 s, so a peer back after a long outage went unused for minutes.
# gRPC adds +-20% jitter: with a 500 ms cap a peer serving again is found within ~0.6 s.
INITIAL_RECONNECT_BACKOFF_MS = 100
MAX_RECONNECT_BACKOFF_MS = 500
MIN_CONNECT_TIMEOUT_MS = 1000  # one connection attempt (gRPC's `min_reconnect_backoff_ms`)
SPECULATOR_INFO_RETRY_S = 1.0  # a speculator that could not say which SSMs it hosts is asked again after this

# ---- waiting for a speculator's tree (services/verifier/speculators.py) -----------------------
# A step waits for a speculator's tree until it is due: SPECULATOR_DEADLINE_FACTOR times what the
# speculator usually takes (the SPECULATOR_LATENCY_PERCENTILE of its last SPECULATOR_LATENCY_WINDOW
# answer latencies, message to answer), plus SPECULATOR_DEADLINE_FLOOR_S for scheduling jitter,
# and never longer than the verifier's step timeout (--speculator-step-timeout-s). The 90th
# percentile of 32 ignores the 4 slowest answers: the one answer a stall delays cannot raise the
# deadline, while a speculator that became slower for good raises it within a few steps. The
# first answer of a stream prefills the SSMs on the whole prompt: it gets the step timeout.
SPECULATOR_LATENCY_WINDOW = 32
SPECULATOR_LATENCY_PERCENTILE = 0.9
SPECULATOR_DEADLINE_FACTOR = 2.0
SPECULATOR_DEADLINE_FLOOR_S = 0.03

# ---- requests --------------------------------------------------------------------------------
DEFAULT_MAX_NEW_TOKENS = 128  # when a request does not say
MAX_STOP_SEQUENCES = 8
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 16  # stop token ids per request (besides the model's EOS tokens)
MAX_LOGPROBS = 20  # alternatives returned per generated token (OpenAI's top_logprobs bound)
MAX_SAMPLES = 16  # samples (n) of one prompt in one request
_ID = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


@dataclass(frozen=True)
class RequestLimits:
    """The per-request limits a deployment may tighten or widen (gateway flags)."""

    max_prompt_tokens: int = 2048  # session history included
    max_new_tokens: int = 512  # generated tokens per request
    default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS  # used when a request says 0
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    max_stop_sequences: int = MAX_STOP_SEQUENCES
    max_stop_chars: int = MAX_STOP_CHARS
    max_tree_depth: int = MAX_TREE_DEPTH
    max_tree_width: int = MAX_TREE_WIDTH
    max_tree_nodes: int = MAX_TREE_NODES

    def __post_init__(self):
        for name in ("max_prompt_tokens", "max_new_tokens", "default_max_new_tokens", "max_concurrent_requests",
                     "max_tree_depth"):
            if getattr(self, name) <= 0:
                raise UserError(f"{name} must be > 0, got {getattr(self, name)}")
        for name, hard in (("max_tree_depth", MAX_TREE_DEPTH), ("max_tree_width", MAX_TREE_WIDTH),
                           ("max_tree_nodes", MAX_TREE_NODES), ("max_stop_sequences", MAX_STOP_SEQUENCES),
                           ("max_stop_chars", MAX_STOP_CHARS)):
            if getattr(self, name) > hard:
                raise UserError(f"{name} must be <= {hard}, got {getattr(self, name)}")


# ---- one check per message -------------------------------------------------------------------
def check_id(value: str, name: str = "request_id") -> None:
    if not _ID.match(value):
        raise UserError(f"{name}: must be 1-128 characters of [A-Za-z0-9_.:-], got {value!r}")


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    """SamplingParams: temperature >= 0 and finite, top_p in (0, 1], top_k >= 0."""
    if not isinstance(temperature, (int, float)) or math.isnan(temperature) or temperature < 0:
        raise UserError(f"sampling.temperature: must be a number >= 0, got {temperature}")
    if math.isinf(temperature):
        raise UserError(f"sampling.temperature: must be finite, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise UserError(f"sampling.top_p: must be in (0, 1] (0 = unset = 1), got {top_p}")
    if top_k < 0:
        raise UserError(f"sampling.top_k: must be >= 0 (0 = no filter), got {top_k}")


def check_penalties(frequency_penalty: float, presence_penalty: float, repetition_penalty: float, min_p: float,
                    logit_bias: tuple[tuple[int, float], ...]) -> None:
    """SamplingParams' logits processors: OpenAI's penalties in [-2, 2], transformers' repetition
    penalty in (0, 10], min_p in [0, 1], logit_bias of at most MAX_LOGIT_BIAS_TOKENS tokens, each
    in [-100, 100] (the vocabulary is checked where it is known, by the verifier)."""
    for name, value in (("frequency_penalty", frequency_penalty), ("presence_penalty", presence_penalty)):
        if not isinstance(value, (int, float)) or not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise UserError(f"sampling.{name}: must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
    if not isinstance(repetition_penalty, (int, float)) or not 0.0 < repetition_penalty <= MAX_REPETITION_PENALTY:
        raise UserError(f"sampling.repetition_penalty: must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = none), "
                        f"got {repetition_penalty}")
    if not isinstance(min_p, (int, float)) or not 0.0 <= min_p <= 1.0:
        raise UserError(f"sampling.min_p: must be in [0, 1], got {min_p}")
    if len(logit_bias) > MAX_LOGIT_BIAS_TOKENS:
        raise UserError(f"sampling.logit_bias: at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(logit_bias)}")
    seen = set()
    for token_id, bias in logit_bias:
        if not isinstance(token_id, int) or token_id < 0:
            raise UserError(f"sampling.logit_bias: token ids must be integers >= 0, got {token_id!r}")
        if token_id in seen:
            raise UserError(f"sampling.logit_bias: token {token_id} is given twice")
        seen.add(token_id)
        if not isinstance(bias, (int, float)) or math.isnan(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise UserError(f"sampling.logit_bias: the bias of token {token_id} must be in "
                            f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}")


def check_logit_bias_vocab(logit_bias: tuple[tuple[int, float], ...], vocab_size: int) -> None:
    for token_id, _ in logit_bias:
        if token_id >= vocab_size:
            raise UserError(f"sampling.logit_bias: token {token_id} is outside the vocabulary (size {vocab_size})")


def check_constraint(kind: str, spec: str, choices: tuple[str, ...]) -> None:
    """Constraint: a known kind, a spec (schema, regex or grammar text) within MAX_CONSTRAINT_CHARS,
    and for `choice` 1..MAX_CHOICES non-empty choices of at most MAX_CHOICE_CHARS each."""
    if kind not in CONSTRAINT_KINDS:
        raise UserError(f"constraint: kind must be one of {', '.join(CONSTRAINT_KINDS)}, got {kind!r}")
    if len(spec) > MAX_CONSTRAINT_CHARS:
        raise UserError(f"{kind}: at most {MAX_CONSTRAINT_CHARS} characters, got {len(spec)}")
    if kind == "choice":
        if not 1 <= len(choices) <= MAX_CHOICES:
            raise UserError(f"choice: between 1 and {MAX_CHOICES} choices, got {len(choices)}")
        for c in choices:
            if not isinstance(c, str) or not c:
                raise UserError("choice: every choice must be a non-empty string")
            if len(c) > MAX_CHOICE_CHARS:
                raise UserError(f"choice: a choice has at most {MAX_CHOICE_CHARS} characters, got {len(c)}")
    elif choices:
        raise UserError(f"{kind}: takes no choices")
    elif kind != "json_object" and not spec.strip():
        raise UserError(f"{kind}: must not be empty")


def check_shape(widths: tuple[int, ...], max_nodes: int, min_path_prob: float, policy: str) -> None:
    """TreeShape: widths in [1, MAX_TREE_WIDTH], at most MAX_TREE_DEPTH levels, 1..MAX_TREE_NODES nodes."""
    if any(w < 1 for w in widths):
        raise UserError(f"shape.widths: every width must be >= 1, got {list(widths)}")
    if any(w > MAX_TREE_WIDTH for w in widths):
        raise UserError(f"shape.widths: every width must be <= {MAX_TREE_WIDTH}, got {list(widths)}")
    if len(widths) > MAX_TREE_DEPTH:
        raise UserError(f"shape.widths: tree deeper than {MAX_TREE_DEPTH} levels ({len(widths)})")
    if not 1 <= max_nodes <= MAX_TREE_NODES:
        raise UserError(f"shape.max_nodes: must be in [1, {MAX_TREE_NODES}], got {max_nodes}")
    if not 0.0 <= min_path_prob < 1.0:
        raise UserError(f"shape.min_path_prob: must be in [0, 1), got {min_path_prob}")
    if policy not in TREE_POLICIES:
        raise UserError(f"shape.policy: unknown tree policy {policy!r}: choose one of {', '.join(TREE_POLICIES)}")


def check_budget(max_nodes: int, max_depth: int, node_cost: float, level_cost: float, ssm_cost: float = 0.0) -> None:
    """TreeBudget: 0..MAX_TREE_NODES - 1 nodes beyond the root, 0..MAX_TREE_DEPTH levels, costs >= 0."""
    if not 0 <= max_nodes < MAX_TREE_NODES:
        raise UserError(f"budget.max_nodes: must be in [0, {MAX_TREE_NODES - 1}], got {max_nodes}")
    if not 0 <= max_depth <= MAX_TREE_DEPTH:
        raise UserError(f"budget.max_depth: must be in [0, {MAX_TREE_DEPTH}], got {max_depth}")
    for name, value in (("node_cost", node_cost), ("level_cost", level_cost), ("ssm_cost", ssm_cost)):
        if not isinstance(value, (int, float)) or math.isnan(value) or not 0.0 <= value < math.inf:
            raise UserError(f"budget.{name}: must be a finite number >= 0, got {value}")


def parse_tree_width(text: str) -> tuple[int, ...]:
    """Parses '1,1,3,1' into a width vector; raises UserError on anything malformed."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        widths = tuple(int(p) for p in parts)
    except ValueError:
        raise UserError(f"malformed tree width {text!r}: expected comma-separated positive integers like 1,1,3,1") from None
    if not widths or any(w < 1 for w in widths):
        raise UserError(f"malformed tree width {text!r}: every width must be a positive integer")
    if len(widths) > MAX_TREE_DEPTH:
        raise UserError(f"tree width {text!r} is deeper than {MAX_TREE_DEPTH} levels")
    if any(w > MAX_TREE_WIDTH for w in widths):
        raise UserError(f"tree width {text!r}: every width must be <= {MAX_TREE_WIDTH}")
    return widths


_BYTE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_kv_budget(text: str) -> tuple[int, int]:
    """'65536' or '65536 tokens' -> (tokens, 0); '2GiB', '512MB', '1e9B' -> (0, bytes); 'auto' ->
    (0, 0), sized from the free memory (`engine.runtime.memory`)."""
    raw = str(text).strip().lower().replace(" ", "")
    if raw == "auto":
        return 0, 0
    if raw.endswith("tokens"):
        raw = raw[: -len("tokens")]
    unit = next((u for u in sorted(_BYTE_UNITS, key=len, reverse=True) if raw.endswith(u)), None)
    number = raw[: -len(unit)] if unit else raw
    try:
        value = float(number)
    except ValueError:
        raise UserError(f"KV budget {text!r}: use a token count (65536), bytes (2GiB, 512MB) or auto") from None
    if not value > 0 or math.isinf(value):
        raise UserError(f"KV budget {text!r} must be positive")
    return (0, int(value * _BYTE_UNITS[unit])) if unit else (int(value), 0)


parse_kv_budget.__name__ = "KV budget"


def check_stop(stop: tuple[str, ...], limits: RequestLimits) -> None:
    if len(stop) > limits.max_stop_sequences:
        raise UserError(f"stop: at most {limits.max_stop_sequences} stop sequences, got {len(stop)}")
    for i, s in enumerate(stop):
        if not s:
            raise UserError(f"stop[{i}]: stop sequences must be non-empty")
        if len(s) > limits.max_stop_chars:
            raise UserError(f"stop[{i}]: longer than {limits.max_stop_chars} characters")


def check_outputs(stop_token_ids: tuple[int, ...], num_logprobs: int | None, num_samples: int) -> None:
    """What a request asks back: stop token ids, logprob alternatives (None = no logprobs), samples."""
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise UserError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_token_ids)}")
    if any(t < 0 for t in stop_token_ids):
        raise UserError(f"stop_token_ids: ids must be >= 0, got {list(stop_token_ids)}")
    if num_logprobs is not None and not 0 <= num_logprobs <= MAX_LOGPROBS:
        raise UserError(f"logprobs: must be in [0, {MAX_LOGPROBS}], got {num_logprobs}")
    if not 1 <= num_samples <= MAX_SAMPLES:
        raise UserError(f"n: must be in [1, {MAX_SAMPLES}], got {num_samples}")


def check_stop_token_ids(stop_token_ids: tuple[int, ...], vocab_size: int) -> None:
    if any(t >= vocab_size for t in stop_token_ids):
        raise UserError(f"stop_token_ids: ids must be inside the vocabulary [0, {vocab_size}), "
                        f"got {list(stop_token_ids)}")


def check_prompt_ids(prompt_ids: list[int] | tuple[int, ...], max_new_tokens: int, vocab_size: int,
                     max_context: int) -> None:
    """A tokenized request the LLM can serve: non-empty, inside the vocabulary, inside the context."""
    if not prompt_ids:
        raise UserError("prompt is empty")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise UserError(f"prompt token ids must be inside the vocabulary [0, {vocab_size})")
    if len(prompt_ids) + max_new_tokens > max_context:
        raise UserError(
            f"prompt ({len(prompt_ids)} tokens) plus max new tokens ({max_new_tokens}) exceeds "
            f"the model context of {max_context} tokens"
        )


def check_prompt_length(num_prompt_tokens: int, num_history_tokens: int, limits: RequestLimits) -> None:
    total = num_prompt_tokens + num_history_tokens
    if num_prompt_tokens == 0:
        raise UserError("prompt: tokenizes to no tokens")
    if total > limits.max_prompt_tokens:
        where = f" ({num_history_tokens} of them session history)" if num_history_tokens else ""
        raise UserError(f"prompt: {total} tokens{where}, more than max_prompt_tokens={limits.max_prompt_tokens}")


# ---- sizes checked before any work: text before it is tokenized, names before they are looked up
# A text's length bounds its token count from below: every token of a byte-level BPE or a
# byte-fallback SentencePiece vocabulary covers at least one byte, and a character is at least
# one byte, so a text of n tokens averaging at most B bytes each has at most n * B characters.
# Real text averages 3-5 bytes per token (English ~4, CJK ~2-3, indented code ~4-6); a text whose
# tokens average over 32 bytes is made almost only of a vocabulary's longest pieces (long runs of
# one repeated character). So max_prompt_tokens * 32 characters refuses no real prompt that fits
# max_prompt_tokens, and refuses a 20 MB paste in O(1), before the tokenizer spends seconds and
# gigabytes on it.
MAX_BYTES_PER_TOKEN = 32
MAX_SSM_NAMES = 16  # SSMs named by one request
MAX_NAME_CHARS = 128  # one SSM name


def max_prompt_chars(request_limits: RequestLimits) -> int:
    """The most characters a text within `max_prompt_tokens` tokens can have."""
    return request_limits.max_prompt_tokens * MAX_BYTES_PER_TOKEN


def check_text_size(text: str, name: str, request_limits: RequestLimits) -> None:
    """A prompt or session prefix, by length alone (O(1)): before it is tokenized."""
    bound = max_prompt_chars(request_limits)
    if len(text) > bound:
        raise UserError(f"{name}: {len(text)} characters, more than any text of max_prompt_tokens="
                        f"{request_limits.max_prompt_tokens} tokens can have ({bound})")


def check_ssm_names(ssm_names: tuple[str, ...]) -> None:
    if len(ssm_names) > MAX_SSM_NAMES:
        raise UserError(f"ssm_names: at most {MAX_SSM_NAMES} names, got {len(ssm_names)}")
    for i, name in enumerate(ssm_names):
        if not name or len(name) > MAX_NAME_CHARS:
            raise UserError(f"ssm_names[{i}]: must be 1-{MAX_NAME_CHARS} characters, got {len(name)}")


def check_verifier_request(num_prompt_tokens: int, max_new_tokens: int, ssm_names: tuple[str, ...],
                           request_limits: RequestLimits) -> None:
    """The sizes of a Verifier.Generate request, whoever sends it. A continued request carries the
    tokens generated so far in its prompt (and asks for that many fewer), so its prompt may reach
    max_prompt_tokens + max_new_tokens, but prompt plus new tokens never more."""
    if max_new_tokens > request_limits.max_new_tokens:
        raise UserError(f"max_new_tokens: at most {request_limits.max_new_tokens}, got {max_new_tokens}")
    total = request_limits.max_prompt_tokens + request_limits.max_new_tokens
    if num_prompt_tokens + max_new_tokens > total:
        raise UserError(f"prompt_ids: {num_prompt_tokens} tokens plus max_new_tokens={max_new_tokens} exceed "
                        f"max_prompt_tokens + max_new_tokens = {total}")
    check_ssm_names(ssm_names)


# ---- the command line's defaults (`specinfer generate`, `bench`, `up`, `client`, the pool's commands) ----
DEFAULT_DEVICE = "auto"  # cpu, cuda, cuda:N or auto
DEFAULT_TENSOR_PARALLEL = 1  # processes the LLM is sharded over
DEFAULT_NUM_THREADS = 0  # torch intra-op threads; 0 = torch's default
DECODE_MODES = ("incremental", "sequence", "tree", "auto")
TREE_SAMPLINGS = ("sampled", "topk")  # how stochastic mode picks tree children
DEFAULT_TREE_SAMPLING = "sampled"
DEFAULT_MIN_PATH_PROB = 0.0  # 0 = no branch pruned
DEFAULT_TEMPERATURE = 0.0  # greedy
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0  # no top-k filter
DEFAULT_FREQUENCY_PENALTY = 0.0
DEFAULT_PRESENCE_PENALTY = 0.0
DEFAULT_REPETITION_PENALTY = 1.0  # none
DEFAULT_MIN_P = 0.0
DEFAULT_NUM_VERIFIERS = 1  # verifier processes of a stack
DEFAULT_NUM_SPECULATORS = 0  # speculator processes of a stack; 0 = the verifier hosts the SSMs itself
STACK_METRICS_PORT = 0  # `specinfer up`: the gateway's /metrics port, the others following; 0 = off
UP_PROMPT_MAX_TOKENS = 64  # `specinfer up --prompt`: tokens the reply may have
CLIENT_DEADLINE_S = 300.0  # `specinfer client`: every call's deadline
HEALTHCHECK_TIMEOUT_S = 3.0  # a health probe's wait for the answer
BENCH_NUM_PROMPTS = 0  # 0 = every prompt
BENCH_NUM_SAMPLES = 1  # > 1 adds the n-samples arms
BENCH_SHARED_PREFIX_TOKENS = 0  # 0 = no prefix-caching benchmark
BENCH_PREFIX_GROUPS = 2
BENCH_CONCURRENCY_IN_PROCESS = 16
BENCH_ROUNDS_IN_PROCESS = 3
BENCH_REQUESTS_PER_LEVEL = 16
BENCH_ROUNDS = 1
BENCH_TEMPERATURES = "0,1"
BENCH_NOISY_PHASE_S = 0.0  # 0 = no busy phase first
BENCH_FIRST_PORT = 50151  # the first port of a benchmarked stack (away from a running one's)
OMP_WAIT_POLICIES = ("ACTIVE", "PASSIVE")
DEFAULT_MLP_KEEP = 1.0  # `make-ssm`: share of MLP channels kept (1 = no pruning)
BOOST_KL_TOP_K = 20  # `boost-tune`: LLM probabilities kept per position for the KL term
BOOST_SEED = 0
