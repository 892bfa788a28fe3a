"""Protobuf <-> domain types, at the service edge only (nothing past the edge sees *_pb2).

One function per message and direction. Unset protobuf fields mean "the default": `top_p` 0 is
1, `repetition_penalty` 0 is 1 (none), a shape with no widths is the server's default shape
(`TreeShape.is_default`), an unset constraint is free text. The domain types validate
themselves, so converting a message is validating it: a bad value raises `UserError` naming the
field (INVALID_ARGUMENT). Plain Python: the gateway
converts with these too. Token trees carry tensors and are converted in `specinfer.serving.trees`.
"""

from __future__ import annotations

from specinfer import limits
from specinfer.errors import UserError
from specinfer.logprobs import PROCESSED, RAW, TokenLogprob
from specinfer.serving.capacity import LoadPoint, VerifierLoad
from specinfer.params import Constraint, GenerationParams, SampleProgress, SamplingParams, TreeBudget, TreeShape
from specinfer.stats import GenerationStats, sum_from_mean
from specinfer.v1 import specinfer_pb2 as pb

_POLICY_NAMES = {pb.TREE_POLICY_MERGE: "merge", pb.TREE_POLICY_MIXED: "mixed"}
_POLICY_VALUES = {name: value for value, name in _POLICY_NAMES.items()}
_FINISH_VALUES = {"length": pb.FINISH_REASON_LENGTH, "stop": pb.FINISH_REASON_STOP,
                  "cancelled": pb.FINISH_REASON_CANCELLED}
_SPACE_VALUES = {RAW: pb.LOGPROB_SPACE_RAW, PROCESSED: pb.LOGPROB_SPACE_PROCESSED}
_SPACE_NAMES = {value: name for name, value in _SPACE_VALUES.items()}


def finish_to_proto(finish_reason: str) -> int:
    """The FinishReason enum for a finish_reason string ("" while running: unspecified)."""
    return _FINISH_VALUES.get(finish_reason, pb.FINISH_REASON_UNSPECIFIED)


def space_to_proto(space: str) -> int:
    return _SPACE_VALUES.get(space, pb.LOGPROB_SPACE_UNSPECIFIED)


def space_from_proto(value: int) -> str:
    return _SPACE_NAMES.get(value, "")


def logprobs_to_proto(logprobs) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_token_ids=[t for t, _ in lp.top],
                            top_logprobs=[v for _, v in lp.top]) for lp in logprobs]


def logprobs_from_proto(msgs) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(int(m.token_id), float(m.logprob),
                              tuple(zip((int(t) for t in m.top_token_ids), (float(v) for v in m.top_logprobs))))
                 for m in msgs)


def _optional_uint(msg, name: str) -> int | None:
    return int(getattr(msg, name)) if msg.HasField(name) else None


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.top_p else 1.0,
        top_k=int(msg.top_k),
        seed=int(msg.seed) if msg.HasField("seed") else None,
        frequency_penalty=float(msg.frequency_penalty),
        presence_penalty=float(msg.presence_penalty),
        repetition_penalty=float(msg.repetition_penalty) if msg.repetition_penalty else 1.0,
        min_p=float(msg.min_p),
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in msg.logit_bias.items())),  # a map has no order
    )


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                            frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
                            min_p=params.min_p, logit_bias=dict(params.logit_bias))
    if params.seed is not None:
        msg.seed = params.seed
    if params.repetition_penalty != 1.0:  # unset means 1: a message without penalties stays as it was
        msg.repetition_penalty = params.repetition_penalty
    return msg


def constraint_from_proto(msg: pb.Constraint) -> Constraint:
    """A set Constraint message; one that names no kind this server knows is refused, never
    taken for free text."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise UserError(f"constraint: set but names no kind (one of {', '.join(limits.CONSTRAINT_KINDS)})")
    if kind == "choice":
        return Constraint("choice", choices=tuple(msg.choice.choices))
    if kind == "json_object":
        return Constraint("json_object")
    return Constraint(kind, getattr(msg, kind))


def constraint_to_proto(constraint: Constraint) -> pb.Constraint:
    if constraint.kind == "choice":
        return pb.Constraint(choice=pb.ChoiceConstraint(choices=list(constraint.choices)))
    if constraint.kind == "json_object":
        return pb.Constraint(json_object=pb.JsonObjectConstraint())
    return pb.Constraint(**{constraint.kind: constraint.spec})


def _constraint_of(msg) -> Constraint | None:
    return constraint_from_proto(msg.constraint) if msg.HasField("constraint") else None


def shape_from_proto(msg: pb.TreeShape) -> TreeShape:
    """The requested shape; unset fields take the defaults, and no widths means the server's shape.
    The deprecated `proposal_top_k` is ignored: coupled children need no proposal distribution."""
    if not msg.widths:
        return TreeShape()
    return TreeShape(
        widths=tuple(int(w) for w in msg.widths),
        max_nodes=int(msg.max_nodes) or limits.DEFAULT_MAX_TREE_NODES,
        is_sampled=bool(msg.sampled),
        min_path_prob=float(msg.min_path_prob),
        policy=_POLICY_NAMES.get(msg.policy, "merge"),
    )


def shape_to_proto(shape: TreeShape) -> pb.TreeShape:
    if shape.is_default:
        return pb.TreeShape()
    return pb.TreeShape(widths=list(shape.widths), max_nodes=shape.max_nodes, sampled=shape.is_sampled,
                        min_path_prob=shape.min_path_prob, policy=_POLICY_VALUES[shape.policy])


def budget_from_proto(msg: pb.TreeBudget) -> TreeBudget:
    return TreeBudget(max_nodes=int(msg.max_nodes), max_depth=int(msg.max_depth), node_cost=float(msg.node_cost),
                      level_cost=float(msg.level_cost), ssm_cost=float(msg.ssm_cost))


def budget_to_proto(budget: TreeBudget) -> pb.TreeBudget:
    return pb.TreeBudget(max_nodes=budget.max_nodes, max_depth=budget.max_depth, node_cost=budget.node_cost,
                         level_cost=budget.level_cost, ssm_cost=budget.ssm_cost)


def params_from_verifier_request(msg: pb.VerifierGenerateRequest) -> GenerationParams:
    if msg.num_resumed_tokens > len(msg.prompt_ids):
        raise UserError(f"num_resumed_tokens: at most the prompt's {len(msg.prompt_ids)} tokens, "
                        f"got {msg.num_resumed_tokens}")
    return GenerationParams(
        max_new_tokens=int(msg.max_new_tokens), sampling=sampling_from_proto(msg.sampling),
        shape=shape_from_proto(msg.shape), is_speculative=bool(msg.speculate), ssm_names=tuple(msg.ssm_names),
        stop_token_ids=tuple(int(t) for t in msg.stop_token_ids), is_ignore_eos=bool(msg.ignore_eos),
        num_logprobs=_optional_uint(msg, "logprobs"), constraint=_constraint_of(msg),
        num_resumed_tokens=int(msg.num_resumed_tokens), num_samples=max(1, int(msg.num_samples)),
    )


def samples_from_verifier_request(msg: pb.VerifierGenerateRequest) -> tuple[SampleProgress, ...]:
    """The samples a call continues (empty: every sample from the prompt)."""
    if msg.samples and msg.num_samples <= 1:
        raise UserError("samples: only with num_samples > 1")
    return tuple(SampleProgress(int(s.index), tuple(int(t) for t in s.token_ids)) for s in msg.samples)


def verifier_request_to_proto(request_id: str, prompt_ids: tuple[int, ...] | list[int], params: GenerationParams,
                              session_id: str = "", samples: tuple[SampleProgress, ...] = ()
                              ) -> pb.VerifierGenerateRequest:
    """One verifier call; with `params.num_samples` > 1, every sample of the request (or those in
    `samples`, each from its tokens so far)."""
    msg = pb.VerifierGenerateRequest(
        request_id=request_id, prompt_ids=list(prompt_ids), max_new_tokens=params.max_new_tokens,
        sampling=sampling_to_proto(params.sampling), speculate=params.is_speculative,
        shape=shape_to_proto(params.shape), stop_token_ids=list(params.stop_token_ids), session_id=session_id,
        ignore_eos=params.is_ignore_eos, ssm_names=list(params.ssm_names),
        num_resumed_tokens=params.num_resumed_tokens,
    )
    if params.num_samples > 1:
        msg.num_samples = params.num_samples
        msg.samples.extend(pb.SampleProgress(index=s.index, token_ids=list(s.token_ids)) for s in samples)
    if params.num_logprobs is not None:
        msg.logprobs = params.num_logprobs
    if params.constraint is not None:
        msg.constraint.CopyFrom(constraint_to_proto(params.constraint))
    return msg


def params_from_generate_request(msg: pb.GenerateRequest) -> GenerationParams:
    """A client's GenerateRequest (the gateway's edge); max_new_tokens 0 = the gateway's default."""
    return GenerationParams(
        max_new_tokens=int(msg.max_tokens) if msg.HasField("max_tokens") else 0,
        sampling=sampling_from_proto(msg.sampling), shape=shape_from_proto(msg.shape),
        is_speculative=msg.speculate if msg.HasField("speculate") else True, ssm_names=tuple(msg.ssm_names),
        stop=tuple(msg.stop), is_ignore_eos=bool(msg.ignore_eos),
        stop_token_ids=tuple(int(t) for t in msg.stop_token_ids), num_logprobs=_optional_uint(msg, "logprobs"),
        num_samples=int(msg.n) if msg.HasField("n") else 1, constraint=_constraint_of(msg),
    )


def stats_to_proto(stats: GenerationStats) -> pb.GenerationStats:
    """The sums, and for older readers the figures derived from them (unset where not measured)."""
    msg = pb.GenerationStats(prompt_tokens=stats.prompt_tokens, output_tokens=stats.output_tokens,
                             llm_steps=stats.llm_steps, tokens_per_step=stats.tokens_per_step,
                             latency_s=stats.latency_s, fell_back=stats.fell_back,
                             cached_prompt_tokens=stats.cached_prompt_tokens)
    for name in ("num_accepted", "num_tree_nodes", "mean_accepted", "mean_tree_nodes", "acceptance_rate"):
        value = getattr(stats, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def stats_from_proto(msg: pb.GenerationStats) -> GenerationStats:
    """The sums where the sender carried them, else (an older sender) its means over the steps."""
    steps = int(msg.llm_steps)

    def total(name: str, mean: str) -> float | None:
        if msg.HasField(name):
            return float(getattr(msg, name))
        return sum_from_mean(getattr(msg, mean) if msg.HasField(mean) else None, steps)

    return GenerationStats(
        prompt_tokens=int(msg.prompt_tokens), output_tokens=int(msg.output_tokens), llm_steps=steps,
        latency_s=float(msg.latency_s), fell_back=bool(msg.fell_back),
        num_accepted=total("num_accepted", "mean_accepted"),
        num_tree_nodes=total("num_tree_nodes", "mean_tree_nodes"),
        cached_prompt_tokens=int(msg.cached_prompt_tokens),
    )


def load_to_proto(load: VerifierLoad) -> pb.VerifierLoad:
    return pb.VerifierLoad(max_batch=load.max_batch, num_running=load.num_running, num_waiting=load.num_waiting,
                           kv_free_tokens=load.kv_free_tokens, draining=load.is_draining,
                           token_times=[pb.LoadPoint(num_running=p.num_running, token_s=p.token_s,
                                                     num_samples=p.num_samples) for p in load.points])


def load_from_proto(msg: pb.VerifierLoad, kv_capacity_tokens: int = 0) -> VerifierLoad:
    """A verifier's report; a point that is not a measurement (no samples, no load, a time that is
    not a positive number) is dropped."""
    points = tuple(LoadPoint(p.num_running, p.token_s, p.num_samples) for p in msg.token_times
                   if p.num_running > 0 and p.num_samples > 0 and 0 < p.token_s < float("inf"))
    return VerifierLoad(msg.max_batch, msg.num_running, msg.num_waiting, kv_capacity_tokens, msg.kv_free_tokens,
                        points, msg.draining)
