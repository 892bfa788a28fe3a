"""Request parameters as domain dataclasses, and their validation at the gateway.

Everything is checked here, before anything goes downstream: a bad field raises `UserError`
(gRPC INVALID_ARGUMENT) whose message starts with the field's name. The tree shape is the
per-request override of SpecInfer's token-tree expansion config (Section 3.1).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

from services.gateway.config import GatewayLimits
from specinfer.errors import UserError

_REQUEST_ID = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    seed: int | None = None


@dataclass(frozen=True)
class TreeSpec:
    widths: tuple[int, ...] = ()  # empty = the verifier's default shape
    max_nodes: int = 0  # 0 = server default
    is_sampled: bool = False
    proposal_top_k: int = 0
    policy: int = 0  # specinfer.v1.TreePolicy; 0 = the server default
    min_path_prob: float = 0.0
    ssm_names: tuple[str, ...] = ()  # the SSM pool; empty = all


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 0  # 0 = the gateway's default
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    stop: tuple[str, ...] = ()
    is_speculative: bool = True
    tree: TreeSpec = field(default_factory=TreeSpec)
    is_ignore_eos: bool = False

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "GenerationParams":
        tree = d.get("tree") or {}
        return cls(
            max_tokens=int(d.get("max_tokens", 0)), sampling=SamplingSpec(**(d.get("sampling") or {})),
            stop=tuple(d.get("stop") or ()), is_speculative=bool(d.get("is_speculative", True)),
            tree=TreeSpec(**{**tree, "widths": tuple(tree.get("widths") or ()),
                             "ssm_names": tuple(tree.get("ssm_names") or ())}),
            is_ignore_eos=bool(d.get("is_ignore_eos", False)),
        )


@dataclass(frozen=True)
class NewRequest:
    """A client's GenerateRequest, converted from protobuf at the edge."""

    prompt: str
    params: GenerationParams
    session_id: str = ""
    request_id: str = ""  # empty = server-assigned


def check_request_id(request_id: str, name: str = "request_id") -> None:
    if not _REQUEST_ID.match(request_id):
        raise UserError(f"{name}: must be 1-128 characters of [A-Za-z0-9_.:-], got {request_id!r}")


def _check_sampling(s: SamplingSpec) -> None:
    if math.isnan(s.temperature) or s.temperature < 0:
        raise UserError(f"sampling.temperature: must be >= 0 and not NaN, got {s.temperature}")
    if math.isinf(s.temperature):
        raise UserError(f"sampling.temperature: must be finite, got {s.temperature}")
    if not (0.0 < s.top_p <= 1.0):
        raise UserError(f"sampling.top_p: must be in (0, 1] (0 = unset = 1), got {s.top_p}")
    if s.top_k < 0:
        raise UserError(f"sampling.top_k: must be >= 0 (0 = no filter), got {s.top_k}")


def _check_stop(stop: tuple[str, ...], limits: GatewayLimits) -> None:
    if len(stop) > limits.max_stop_sequences:
        raise UserError(f"stop: at most {limits.max_stop_sequences} stop sequences, got {len(stop)}")
    for i, s in enumerate(stop):
        if not s:
            raise UserError(f"stop[{i}]: stop sequences must be non-empty")
        if len(s) > limits.max_stop_chars:
            raise UserError(f"stop[{i}]: longer than {limits.max_stop_chars} characters")


def _check_tree(t: TreeSpec, limits: GatewayLimits) -> None:
    if any(w < 1 for w in t.widths):
        raise UserError(f"shape.widths: every width must be >= 1, got {list(t.widths)}")
    if any(w > limits.max_tree_width for w in t.widths):
        raise UserError(f"shape.widths: every width must be <= {limits.max_tree_width}, got {list(t.widths)}")
    if not 0.0 <= t.min_path_prob < 1.0:
        raise UserError(f"shape.min_path_prob: must be in [0, 1), got {t.min_path_prob}")
    if any(not name for name in t.ssm_names):
        raise UserError("ssm_names: names must be non-empty")
    if len(t.widths) > limits.max_tree_depth:
        raise UserError(f"shape.widths: tree deeper than {limits.max_tree_depth} levels ({len(t.widths)})")
    if t.max_nodes > limits.max_tree_nodes:
        raise UserError(f"shape.max_nodes: at most {limits.max_tree_nodes}, got {t.max_nodes}")


def validate_request(req: NewRequest, limits: GatewayLimits) -> NewRequest:
    """Checks every field that needs no tokenizer or store; returns it with max_tokens resolved."""
    if req.request_id:
        check_request_id(req.request_id)
    if req.session_id:
        check_request_id(req.session_id, "session_id")
    if not req.prompt:
        raise UserError("prompt: must be non-empty")
    p = req.params
    if p.max_tokens < 0:
        raise UserError(f"max_tokens: must be >= 0 (0 = server default), got {p.max_tokens}")
    if p.max_tokens > limits.max_tokens:
        raise UserError(f"max_tokens: at most {limits.max_tokens}, got {p.max_tokens}")
    _check_sampling(p.sampling)
    _check_stop(p.stop, limits)
    _check_tree(p.tree, limits)
    max_tokens = p.max_tokens or min(limits.default_max_tokens, limits.max_tokens)
    return NewRequest(req.prompt, GenerationParams(max_tokens, p.sampling, p.stop, p.is_speculative, p.tree,
                                                   p.is_ignore_eos), req.session_id, req.request_id)


def check_prompt_length(num_prompt_tokens: int, num_history_tokens: int, limits: GatewayLimits) -> None:
    total = num_prompt_tokens + num_history_tokens
    if num_prompt_tokens == 0:
        raise UserError("prompt: tokenizes to no tokens")
    if total > limits.max_prompt_tokens:
        where = f" ({num_history_tokens} of them session history)" if num_history_tokens else ""
        raise UserError(f"prompt: {total} tokens{where}, more than max_prompt_tokens={limits.max_prompt_tokens}")
