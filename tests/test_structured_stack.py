"""Structured output and penalties through the whole stack (a speculator service, the verifier,
the gateway's gRPC and OpenAI APIs), with the official `openai` client: outputs are accepted by
their constraint, identical with and without speculation, and identical to the engine in process;
chat works on a base model through --chat-template; a bad schema is a 400 naming the field."""

from __future__ import annotations

import json
import re
import uuid

import openai
import pytest

from specinfer.engine.llm_engine import Engine, mode_params
from specinfer.engine.runtime.assemble import load_grammars
from specinfer.engine.runtime.runner import ModelRunner
from specinfer.params import Constraint, SamplingParams
from specinfer.tokenizer import TextTokenizer
from specinfer.v1 import specinfer_pb2 as pb
from test_stack_e2e import redis_url
from util import free_port, start_stack

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "num_args": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["name", "num_args"], "additionalProperties": False}
TEMPLATE = ("{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}# assistant: {% endif %}")


@pytest.fixture(scope="module")
def stack(eos_text_pair, tmp_path_factory):
    llm, ssm = eos_text_pair
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    gateway = {"redis_url": redis_url(), "key_prefix": f"specinfer-test-{uuid.uuid4().hex[:8]}:",
               "http_port": free_port(), "chat_template": template}
    with start_stack(llm, [ssm], speculator_step_timeout_s=2, gateway=gateway) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{stack.gateway.http_port}/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def in_process(eos_text_pair):
    llm_dir, _ = eos_text_pair
    llm = ModelRunner.from_dir(llm_dir, max_kv_tokens=8192)
    engine = Engine.from_runners(llm, grammars=load_grammars(llm_dir, llm.cfg))
    tokenizer = TextTokenizer.from_dir(llm_dir, llm.cfg.eos_token_ids)

    def generate(prompt: str, max_new: int, **params) -> str:
        r = engine.generate(tokenizer.encode(prompt), mode_params("incremental", max_new, **params))
        return tokenizer.decode([t for t in r.output_ids if t not in llm.cfg.eos_token_ids])

    return generate


JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "call", "schema": SCHEMA, "strict": True}}


@pytest.mark.parametrize("prompt", ['{"name": "', "def add(a, b):\n"])
def test_schema_valid_json_from_completions_the_same_speculated_or_not(stack, client, model, in_process, prompt):
    # The client's completions take no response_format argument: it goes in the body as it is.
    fast = client.completions.create(model=model, prompt=prompt, max_tokens=64, temperature=0,
                                     extra_body={"response_format": JSON_FORMAT})
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=64, temperature=0,
                                      extra_body={"response_format": JSON_FORMAT, "speculate": False})
    text = fast.choices[0].text
    assert text == plain.choices[0].text
    assert fast.choices[0].finish_reason == "stop"
    value = json.loads(text)
    assert set(value) == {"name", "num_args"} and 0 <= value["num_args"] <= 9 and len(value["name"]) <= 10
    assert text == in_process(prompt, 64, constraint=Constraint("json_schema", json.dumps(SCHEMA)))
    grpc_resp = stack.gateway_stub.Generate(pb.GenerateRequest(
        prompt=prompt, max_tokens=64, constraint=pb.Constraint(json_schema=json.dumps(SCHEMA))), timeout=60)
    assert grpc_resp.text == text
    assert fast.model_extra["metrics"]["tokens_per_step"] > 1.0  # forced keys and drafts were accepted


def test_schema_valid_json_from_chat_with_a_chat_template(client, model):
    messages = [{"role": "user", "content": "describe add"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0,
                                          response_format=JSON_FORMAT)
    value = json.loads(chat.choices[0].message.content)
    assert set(value) == {"name", "num_args"}
    obj = client.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_choice_and_regex_hold(client, model):
    choices = ["import os", "import sys", "def add(a, b):"]
    for prompt in ("import ", "def "):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                      extra_body={"structured_outputs": {"choice": choices}})
        assert r.choices[0].text in choices
        r = client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0.8, seed=3,
                                      extra_body={"structured_outputs": {"regex": r"[a-z]{2,6}\((a|b|, ){0,5}\)"}})
        assert re.fullmatch(r"[a-z]{2,6}\((a|b|, ){0,5}\)", r.choices[0].text), r.choices[0].text


def test_penalised_output_equals_in_process(client, model, in_process):
    r = client.completions.create(model=model, prompt="def add(", max_tokens=32, temperature=0,
                                  frequency_penalty=1.2, presence_penalty=0.6, logit_bias={"5": 3.0},
                                  extra_body={"repetition_penalty": 1.4})
    expected = in_process("def add(", 32, sampling=SamplingParams(frequency_penalty=1.2, presence_penalty=0.6,
                                                                   repetition_penalty=1.4, logit_bias={5: 3.0}))
    assert r.choices[0].text == expected
    assert expected != in_process("def add(", 32)  # the penalties did change the text


def test_a_bad_schema_is_400_naming_the_field(client, model):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 3}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="x", max_tokens=8, extra_body={"response_format": bad})
    assert "json_schema" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="x", max_tokens=8, logit_bias={"99999": 1.0})
    assert "logit_bias" in str(info.value)
    ok = client.completions.create(model=model, prompt="x", max_tokens=4, temperature=0)  # the stack is fine
    assert ok.usage.completion_tokens == 4
