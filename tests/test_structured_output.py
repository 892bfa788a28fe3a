"""Structured output with the real grammar engine, in process: every kind of constraint gives
text it accepts, and the same output with and without speculation (greedy, and sampled with a
seed), alone and in a batch; what a constraint cannot be is refused alone."""

from __future__ import annotations

import json
import re

import pytest

from specinfer.engine.llm_engine import Engine, mode_params
from specinfer.engine.runtime.assemble import load_grammars
from specinfer.engine.runtime.runner import ModelRunner
from specinfer.engine.drafting.speculator import model_free_member
from specinfer.errors import UserError
from specinfer.params import Constraint, SamplingParams, TreeShape
from specinfer.tokenizer import TextTokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "is_async": {"type": "boolean"},
                                           "num_args": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["name", "is_async", "num_args"], "additionalProperties": False}
CHOICES = ("import os", "import sys", "def add(a, b):")
CONSTRAINTS = {
    "json_schema": Constraint("json_schema", json.dumps(SCHEMA)),
    "json_object": Constraint("json_object"),
    "regex": Constraint("regex", r"(def|class) [a-z_]{1,8}\((a|b|, )*\):"),
    "choice": Constraint("choice", choices=CHOICES),
    "grammar": Constraint("grammar", 'start: "x = " NUM (" + " NUM)*\nNUM: /[0-9]{1,3}/'),
}
PROMPTS = ["def add(", "import ", '{"name": "', "for x in range(3):\n    "]


def accepted(kind: str, text: str) -> bool:
    if kind == "json_schema":
        value = json.loads(text)
        return set(value) == {"name", "is_async", "num_args"} and isinstance(value["is_async"], bool)
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(CONSTRAINTS["regex"].spec, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"x = [0-9]{1,3}( \+ [0-9]{1,3})*", text) is not None


@pytest.fixture(scope="module")
def setup(eos_text_pair):
    llm_dir, ssm_dir = eos_text_pair
    llm = ModelRunner.from_dir(llm_dir, max_kv_tokens=16384)
    ssm = ModelRunner.from_dir(ssm_dir, max_kv_tokens=16384)
    tokenizer = TextTokenizer.from_dir(llm_dir, llm.cfg.eos_token_ids)
    engine = Engine.from_runners(llm, [ssm], model_free=[model_free_member("lookup"), model_free_member("suffix")],
                                 grammars=load_grammars(llm_dir, llm.cfg))
    return engine, tokenizer


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_constrained_greedy_is_accepted_and_the_same_speculated(setup, kind):
    engine, tokenizer = setup
    constraint = CONSTRAINTS[kind]
    num_finished = num_drafted = 0
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        plain = engine.generate(ids, mode_params("incremental", 96, constraint=constraint))
        for mode in ("tree", "auto"):
            r = engine.generate(ids, mode_params(mode, 96, TreeShape((2, 2, 1)), constraint=constraint))
            assert r.output_ids == plain.output_ids, (kind, prompt, mode)
            num_drafted += sum(r.accepted_per_step)
        if plain.finish_reason == "stop":
            num_finished += 1
            text = tokenizer.decode([t for t in plain.output_ids if t not in engine.verifier.runner.cfg.eos_token_ids])
            assert accepted(kind, text), (kind, text)
    assert num_finished >= 2  # most outputs completed their grammar within the budget
    assert num_drafted > 0
    assert engine.verifier.runner.allocator.num_used == 0


def test_constrained_batch_and_sampling_equal_their_plain_runs(setup):
    """Mixed constraints, penalties and free requests in one batch; sampled ones with a seed give
    exactly what sampling them alone, without speculation, gives."""
    engine, tokenizer = setup
    requests = []
    for i, (kind, constraint) in enumerate(list(CONSTRAINTS.items()) + [("free", None)]):
        sampling = SamplingParams(1.0, seed=i, presence_penalty=0.5) if i % 2 else SamplingParams()
        requests.append((tokenizer.encode(PROMPTS[i % len(PROMPTS)]), sampling, constraint))
    expected = [engine.generate(ids, mode_params("incremental", 64, sampling=s, constraint=c)).output_ids
                for ids, s, c in requests]
    batch = engine.generate_batch([engine.start(ids, mode_params("auto", 64, sampling=s, constraint=c))
                                   for ids, s, c in requests])
    assert [r.output_ids for r in batch] == expected


@pytest.mark.parametrize("constraint, message", [
    (Constraint("json_schema", '{"type": "object", "properties": 3}'), "json_schema: invalid schema"),
    (Constraint("regex", "(a"), "regex: "),
    (Constraint("grammar", "start: undefined_rule"), "grammar: "),
])
def test_a_bad_constraint_fails_alone(setup, constraint, message):
    engine, tokenizer = setup
    good = engine.start(tokenizer.encode("def add("), mode_params("auto", 16))
    with pytest.raises(UserError, match=re.escape(message)):
        engine.start(tokenizer.encode("def add("), mode_params("auto", 16, constraint=constraint))
    [result] = engine.generate_batch([good])
    assert len(result.output_ids) == 16
    assert engine.verifier.runner.allocator.num_used == 0
