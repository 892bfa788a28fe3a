"""What a request asks for, as one set of types on every hop: gateway, verifier, speculators, CLI.

`SamplingParams` defines the LLM distribution that stochastic verification preserves (SpecInfer
Section 4.3); `TreeShape` is the expansion config of a token tree (Section 3.1); `TreeBudget` is
what one step's dynamic token tree may cost; `GenerationParams` is a whole request. Protobuf is
converted to these once, at each service's edge (`specinfer.serving.convert`); everything past
the edge passes them down as they are.
Each type validates itself on construction against `specinfer.limits`. Plain Python: no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from specinfer import limits
from specinfer.errors import UserError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (or below limits.MIN_SAMPLING_TEMPERATURE) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k filter
    seed: int | None = None
    # Logits processors (`specinfer.engine.verification.processors`), applied at every tree node to the logits
    # of that node's own context, in greedy and sampled modes alike:
    frequency_penalty: float = 0.0  # OpenAI's: minus penalty x count of each token in the output
    presence_penalty: float = 0.0  # OpenAI's: minus penalty for each token the output holds
    repetition_penalty: float = 1.0  # transformers': over prompt and output; 1 = none
    min_p: float = 0.0  # sampled only: drop tokens below min_p x the most likely one's probability
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)

    def __post_init__(self):
        limits.check_sampling(self.temperature, self.top_p, self.top_k)
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        limits.check_penalties(self.frequency_penalty, self.presence_penalty, self.repetition_penalty, self.min_p,
                               self.logit_bias)

    @property
    def has_penalties(self) -> bool:
        """Any processor whose effect depends on the tokens before a node."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)

    @property
    def has_processors(self) -> bool:
        return self.has_penalties or bool(self.logit_bias) or (self.min_p > 0.0 and not self.is_greedy)

    @property
    def is_greedy(self) -> bool:
        """Temperature 0, or one so small (< MIN_SAMPLING_TEMPERATURE) that sampling is argmax."""
        return self.temperature < limits.MIN_SAMPLING_TEMPERATURE


def _bias_pairs(logit_bias) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs from pairs or a {token id: bias} mapping; malformed input is a UserError."""
    items = logit_bias.items() if isinstance(logit_bias, dict) else logit_bias
    try:
        return tuple((t if isinstance(t, int) else int(t), float(b)) for t, b in items)
    except (TypeError, ValueError) as exc:
        raise UserError(f"sampling.logit_bias: must map token ids to numbers ({exc})") from None


@dataclass(frozen=True)
class TreeShape:
    """How to expand a token tree. Empty `widths` means "the server's default shape" (load-aware
    where the server has a policy): a request that names no widths leaves the whole shape to it."""

    widths: tuple[int, ...] = ()
    max_nodes: int = limits.DEFAULT_MAX_TREE_NODES
    # Stochastic mode: children coupled with the LLM's sample (the Gumbel-top-k of the SSM's
    # distribution with the request's noise; True) or the SSM's top-k (False).
    is_sampled: bool = True
    # Dynamic pruning: a node joins the tree only if the SSM's probability of its whole path
    # (the product along it) is at least this; 0 keeps every node the widths allow.
    min_path_prob: float = 0.0
    # Several SSMs: "merge" expands the full widths in every SSM and merges the trees; "mixed"
    # expands them in the request's first SSM only and adds every other SSM's top-1 path.
    policy: str = "merge"

    def __post_init__(self):
        limits.check_shape(self.widths, self.max_nodes, self.min_path_prob, self.policy)

    @property
    def is_default(self) -> bool:
        return not self.widths

    def clipped(self, max_depth: int) -> "TreeShape":
        return replace(self, widths=self.widths[: max(0, max_depth)])

    def for_ssm(self, is_primary: bool) -> "TreeShape":
        """The shape one SSM of the request's pool expands under this policy."""
        if self.policy == "merge" or is_primary:
            return self
        return replace(self, widths=(1,) * len(self.widths))


@dataclass(frozen=True)
class TreeBudget:
    """One step's dynamic token tree, as the verifier asks its drafts for it (the default for
    requests that name no widths). The drafts grow the tree node by node, each candidate valued
    by its estimated chance of being accepted, and keep the nodes that raise the step's expected
    rate (1 + expected accepted tokens) / (1 + node_cost * nodes + ssm_cost + level_cost * SSM
    levels): the costs are shares of a step without a tree that one more node in the LLM's pass,
    running the SSMs at all, and one more SSM level would add, priced by the verifier's cost
    model for the current batch and device."""

    max_nodes: int = limits.DYNAMIC_MAX_NODES  # nodes beyond the root
    max_depth: int = limits.DYNAMIC_MAX_DEPTH
    node_cost: float = 0.02
    level_cost: float = 0.05
    ssm_cost: float = 0.0

    def __post_init__(self):
        limits.check_budget(self.max_nodes, self.max_depth, self.node_cost, self.level_cost, self.ssm_cost)

    def clipped(self, max_depth: int) -> "TreeBudget":
        return replace(self, max_depth=max(0, min(self.max_depth, max_depth)))


@dataclass(frozen=True)
class Constraint:
    """Structured output: every token a request outputs keeps its text a prefix of some string the
    constraint accepts, and the request ends only where the text is accepted whole. `spec` is a
    JSON Schema (json_schema), a regular expression (regex) or an EBNF grammar (grammar);
    json_object takes any JSON object; choice one of `choices`, verbatim."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.choices, tuple):
            object.__setattr__(self, "choices", tuple(self.choices))
        limits.check_constraint(self.kind, self.spec, self.choices)

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (its cache key)."""
        return self.kind, self.spec, self.choices


@dataclass(frozen=True)
class GenerationParams:
    """One generation request's knobs (the prompt travels beside it, as text or token ids)."""

    max_new_tokens: int = 0  # 0 = the server's default
    sampling: SamplingParams = field(default_factory=SamplingParams)
    shape: TreeShape = field(default_factory=TreeShape)
    is_speculative: bool = True  # False: plain incremental decoding
    ssm_names: tuple[str, ...] = ()  # the SSM pool to speculate with; empty = all
    stop: tuple[str, ...] = ()  # stop strings, applied to the text
    stop_token_ids: tuple[int, ...] = ()  # end generation besides the model's end-of-sequence tokens
    is_ignore_eos: bool = False  # EOS does not end generation (stop_token_ids still do)
    num_logprobs: int | None = None  # return logprobs with this many alternatives; None = none
    num_samples: int = 1  # n: independent samples of the prompt
    constraint: Constraint | None = None  # structured output; None = free text
    # The prompt's last n tokens are this request's own earlier output (a resumed request): the
    # penalties count them as output, and a constraint has already matched them.
    num_resumed_tokens: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise UserError(f"max_tokens: must be >= 0 (0 = server default), got {self.max_new_tokens}")
        if any(not name for name in self.ssm_names):
            raise UserError("ssm_names: names must be non-empty")
        limits.check_outputs(self.stop_token_ids, self.num_logprobs, self.num_samples)
        if self.num_resumed_tokens < 0:
            raise UserError(f"num_resumed_tokens: must be >= 0, got {self.num_resumed_tokens}")

    def stop_tokens(self, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
        """The token ids that end generation: the request's, and EOS unless it is ignored."""
        return frozenset(self.stop_token_ids) | frozenset(() if self.is_ignore_eos else eos_token_ids)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "GenerationParams":
        if "tree" in d or "max_tokens" in d:
            d = _from_earlier_json(d)
        # A shape stored by an earlier version may name fields since removed: they are dropped.
        shape = {k: v for k, v in (d.get("shape") or {}).items() if k in _SHAPE_FIELDS}
        return cls(
            max_new_tokens=int(d.get("max_new_tokens", 0)),
            sampling=SamplingParams(**(d.get("sampling") or {})),
            shape=TreeShape(**{**shape, "widths": tuple(shape.get("widths") or ())}),
            is_speculative=bool(d.get("is_speculative", True)),
            ssm_names=tuple(d.get("ssm_names") or ()),
            stop=tuple(d.get("stop") or ()),
            stop_token_ids=tuple(d.get("stop_token_ids") or ()),
            is_ignore_eos=bool(d.get("is_ignore_eos", False)),
            num_logprobs=d.get("num_logprobs"),
            num_samples=int(d.get("num_samples", 1)),
            constraint=Constraint(**d["constraint"]) if d.get("constraint") else None,
            num_resumed_tokens=int(d.get("num_resumed_tokens", 0)),
        )

    def checked(self, request_limits: limits.RequestLimits) -> "GenerationParams":
        """Validated against a deployment's limits, with max_new_tokens resolved."""
        if self.max_new_tokens > request_limits.max_new_tokens:
            raise UserError(f"max_tokens: at most {request_limits.max_new_tokens}, got {self.max_new_tokens}")
        limits.check_stop(self.stop, request_limits)
        widths = self.shape.widths
        if len(widths) > request_limits.max_tree_depth:
            raise UserError(f"shape.widths: tree deeper than {request_limits.max_tree_depth} levels ({len(widths)})")
        if any(w > request_limits.max_tree_width for w in widths):
            raise UserError(f"shape.widths: every width must be <= {request_limits.max_tree_width}, got {list(widths)}")
        if self.shape.max_nodes > request_limits.max_tree_nodes:
            raise UserError(f"shape.max_nodes: at most {request_limits.max_tree_nodes}, got {self.shape.max_nodes}")
        max_new = self.max_new_tokens or min(request_limits.default_max_new_tokens, request_limits.max_new_tokens)
        return replace(self, max_new_tokens=max_new)


_SHAPE_FIELDS = frozenset(f.name for f in fields(TreeShape))


def _from_earlier_json(d: dict) -> dict:
    """A stored request written by an earlier gateway ("max_tokens", and a "tree" whose unset
    fields were 0), so requests in flight during an upgrade still resume."""
    tree = d.get("tree") or {}
    shape = {}
    if tree.get("widths"):
        shape = {"widths": tree["widths"], "max_nodes": tree.get("max_nodes") or limits.DEFAULT_MAX_TREE_NODES,
                 "is_sampled": bool(tree.get("is_sampled")),
                 "min_path_prob": float(tree.get("min_path_prob") or 0.0),
                 "policy": {2: "mixed"}.get(tree.get("policy"), "merge")}
    return {"max_new_tokens": d.get("max_tokens", 0), "sampling": d.get("sampling"), "shape": shape,
            "is_speculative": d.get("is_speculative", True), "ssm_names": tree.get("ssm_names") or (),
            "stop": d.get("stop") or (), "is_ignore_eos": d.get("is_ignore_eos", False)}


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request with n > 1 samples: sample 0 keeps the request's
    seed (so n = 1 and sample 0 agree); sample i adds i times the 64-bit golden ratio, mod 2**63,
    which spreads the samples' seeds over the whole seed space. The only derivation of a
    sample's seed: the engine seeds the samples of one call with it (`sample_params`), and the
    gateway records each sample's seed with it, so a sample resumed alone continues as it began."""
    return seed if index == 0 else (seed + index * 0x9E3779B97F4A7C15) % (1 << 63)


def sample_params(params: GenerationParams, index: int) -> GenerationParams:
    """Sample `index` of an n > 1 request as a request of its own: one sample, seeded with
    `sample_seed` (a request without a seed stays without one)."""
    seed = params.sampling.seed
    return replace(params, num_samples=1,
                   sampling=replace(params.sampling, seed=None if seed is None else sample_seed(seed, index)))


@dataclass(frozen=True)
class SampleProgress:
    """One sample of an n > 1 request and the tokens it has generated so far (a call continuing
    the request after its first call failed part way)."""

    index: int
    token_ids: tuple[int, ...] = ()
