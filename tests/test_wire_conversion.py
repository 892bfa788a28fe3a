"""Protobuf <-> domain conversion of the sampling surface and structured output: penalties, min_p,
logit_bias, constraints and resumed tokens survive every hop (client -> gateway -> store ->
verifier), unset fields read as the defaults, and a bad value is a UserError naming its field."""

from __future__ import annotations

import json
import math

import pytest

from specinfer.errors import UserError
from specinfer.params import Constraint, GenerationParams, SamplingParams, TreeShape
from specinfer.serving import convert
from specinfer.v1 import specinfer_pb2 as pb

# values exact in float32, as the wire carries them
SAMPLING = SamplingParams(temperature=0.75, top_p=0.875, top_k=5, seed=3, frequency_penalty=0.5, presence_penalty=-1.0,
                          repetition_penalty=1.25, min_p=0.125, logit_bias=((3, -100.0), (17, 2.5)))
CONSTRAINTS = [Constraint("json_schema", '{"type":"object","properties":{"a":{"type":"integer"}}}'),
               Constraint("json_object"), Constraint("regex", r"[0-9]{3}-[a-z]+"),
               Constraint("choice", choices=("yes", "no", "maybe")), Constraint("grammar", 'root ::= "a" | "b"')]


def test_sampling_round_trips_with_every_processor():
    assert convert.sampling_from_proto(convert.sampling_to_proto(SAMPLING)) == SAMPLING
    msg = convert.sampling_to_proto(SAMPLING)
    assert dict(msg.logit_bias) == {3: -100.0, 17: 2.5} and msg.repetition_penalty == pytest.approx(1.25)


def test_unset_sampling_fields_are_the_defaults():
    """An older client's message: no penalties, repetition_penalty 0 = 1 (none), no bias."""
    params = convert.sampling_from_proto(pb.SamplingParams(temperature=0.5))
    assert params == SamplingParams(temperature=0.5) and not params.has_processors
    assert convert.sampling_to_proto(SamplingParams()) == pb.SamplingParams(top_p=1.0)  # nothing new is set


def test_logit_bias_from_a_map_is_in_token_order():
    msg = pb.SamplingParams(logit_bias={40: 1.0, 2: -1.0, 7: 0.5})
    assert convert.sampling_from_proto(msg).logit_bias == ((2, -1.0), (7, 0.5), (40, 1.0))


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=[c.kind for c in CONSTRAINTS])
def test_constraints_round_trip(constraint):
    msg = convert.constraint_to_proto(constraint)
    assert msg.WhichOneof("kind") == constraint.kind
    assert convert.constraint_from_proto(pb.Constraint.FromString(msg.SerializeToString())) == constraint


def test_verifier_request_carries_the_constraint_and_the_resumed_tokens():
    params = GenerationParams(max_new_tokens=9, sampling=SAMPLING, shape=TreeShape((1, 2)), constraint=CONSTRAINTS[0],
                              num_resumed_tokens=4, num_logprobs=2)
    msg = convert.verifier_request_to_proto("r1", [5, 6, 7, 8, 9], params)
    assert msg.num_resumed_tokens == 4 and msg.constraint.json_schema == CONSTRAINTS[0].spec
    back = convert.params_from_verifier_request(pb.VerifierGenerateRequest.FromString(msg.SerializeToString()))
    assert back == params
    fresh = convert.verifier_request_to_proto("r2", [1], GenerationParams(max_new_tokens=2))
    assert not fresh.HasField("constraint") and fresh.num_resumed_tokens == 0
    assert convert.params_from_verifier_request(fresh).constraint is None


def test_generate_request_carries_penalties_and_constraint():
    msg = pb.GenerateRequest(prompt="x", sampling=convert.sampling_to_proto(SAMPLING),
                             constraint=pb.Constraint(choice=pb.ChoiceConstraint(choices=["a", "b"])))
    params = convert.params_from_generate_request(pb.GenerateRequest.FromString(msg.SerializeToString()))
    assert params.sampling == SAMPLING and params.constraint == Constraint("choice", choices=("a", "b"))
    assert convert.params_from_generate_request(pb.GenerateRequest(prompt="x")).constraint is None


@pytest.mark.parametrize("sampling, field", [
    (pb.SamplingParams(frequency_penalty=2.5), "sampling.frequency_penalty"),
    (pb.SamplingParams(presence_penalty=-3), "sampling.presence_penalty"),
    (pb.SamplingParams(presence_penalty=math.nan), "sampling.presence_penalty"),
    (pb.SamplingParams(repetition_penalty=-1), "sampling.repetition_penalty"),
    (pb.SamplingParams(repetition_penalty=11), "sampling.repetition_penalty"),
    (pb.SamplingParams(min_p=1.5), "sampling.min_p"),
    (pb.SamplingParams(logit_bias={5: 101.0}), "sampling.logit_bias"),
    (pb.SamplingParams(logit_bias={5: math.nan}), "sampling.logit_bias"),
    (pb.SamplingParams(logit_bias={i: 1.0 for i in range(2000)}), "sampling.logit_bias"),
])
def test_bad_sampling_values_name_their_field(sampling, field):
    with pytest.raises(UserError, match=f"^{field}"):
        convert.params_from_generate_request(pb.GenerateRequest(prompt="x", sampling=sampling))
    with pytest.raises(UserError, match=f"^{field}"):
        convert.params_from_verifier_request(pb.VerifierGenerateRequest(prompt_ids=[1], max_new_tokens=1,
                                                                        sampling=sampling))


@pytest.mark.parametrize("constraint, field", [
    (pb.Constraint(), "constraint"),  # set, but no kind (or one this server does not know)
    (pb.Constraint(regex=""), "regex"),
    (pb.Constraint(grammar="  "), "grammar"),
    (pb.Constraint(json_schema="x" * 70000), "json_schema"),
    (pb.Constraint(choice=pb.ChoiceConstraint()), "choice"),
    (pb.Constraint(choice=pb.ChoiceConstraint(choices=["a", ""])), "choice"),
])
def test_bad_constraints_name_their_field(constraint, field):
    with pytest.raises(UserError, match=f"^{field}"):
        convert.params_from_generate_request(pb.GenerateRequest(prompt="x", constraint=constraint))
    with pytest.raises(UserError, match=f"^{field}"):
        convert.params_from_verifier_request(pb.VerifierGenerateRequest(prompt_ids=[1], max_new_tokens=1,
                                                                        constraint=constraint))


def test_resumed_tokens_past_the_prompt_are_refused():
    msg = pb.VerifierGenerateRequest(prompt_ids=[1, 2, 3], max_new_tokens=2, num_resumed_tokens=4)
    with pytest.raises(UserError, match="^num_resumed_tokens"):
        convert.params_from_verifier_request(msg)
    assert convert.params_from_verifier_request(
        pb.VerifierGenerateRequest(prompt_ids=[1, 2, 3], max_new_tokens=2, num_resumed_tokens=3)).num_resumed_tokens == 3


@pytest.mark.parametrize("constraint", [None, *CONSTRAINTS], ids=["none"] + [c.kind for c in CONSTRAINTS])
def test_stored_params_round_trip_through_json_text(constraint):
    """The gateway stores GenerationParams.to_json() as JSON text (Redis) and reads it back to
    resume a request; a retry compares what it reads with what the client sends again."""
    params = GenerationParams(max_new_tokens=12, sampling=SAMPLING, constraint=constraint, num_resumed_tokens=2)
    assert GenerationParams.from_json(json.loads(json.dumps(params.to_json()))) == params


def test_stats_carry_sums_and_still_fill_the_means():
    from specinfer.stats import GenerationStats

    stats = GenerationStats(prompt_tokens=9, output_tokens=20, llm_steps=7, latency_s=0.5, num_accepted=13.0,
                            num_tree_nodes=31.0, cached_prompt_tokens=4)
    msg = convert.stats_to_proto(stats)
    assert (msg.num_accepted, msg.num_tree_nodes) == (13.0, 31.0)
    assert msg.mean_accepted == pytest.approx(13 / 7) and msg.acceptance_rate == pytest.approx(13 / 24)
    back = convert.stats_from_proto(pb.GenerationStats.FromString(msg.SerializeToString()))
    assert back.num_accepted == 13.0 and back.num_tree_nodes == 31.0 and back.llm_steps == 7
    unmeasured = convert.stats_from_proto(convert.stats_to_proto(GenerationStats(llm_steps=3)))
    assert unmeasured.num_accepted is None and unmeasured.acceptance_rate is None


def test_stats_from_an_older_sender_read_its_means():
    old = pb.GenerationStats(llm_steps=4, mean_accepted=2.0, mean_tree_nodes=5.0, acceptance_rate=0.5)
    stats = convert.stats_from_proto(old)
    assert (stats.num_accepted, stats.num_tree_nodes, stats.acceptance_rate) == (8.0, 20.0, 0.5)
