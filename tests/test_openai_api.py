"""The OpenAI-compatible HTTP API, driven by the official `openai` client against a real stack
(gateway -> verifier -> speculator over gRPC on localhost, with a real Redis).

Checks that it answers what the gRPC API answers (greedy output token for token), that plain
and streamed responses agree, that chat renders the checkpoint's template, stops, seeds, the
400s of bad input, 404 of an unknown model, 413 of an oversize body, the bearer token, and that
a client leaving a stream frees the verifier exactly as a gRPC client leaving does.
Against a fake verifier: structured output (`response_format`, vLLM's `structured_outputs` and
`guided_*`), penalties, min_p and logit_bias reach the verifier as the client sent them, their
bad values are 400s naming the field, the verifier's own refusals are 400s, and a chat template
file (`--chat-template`) lets a base model serve chat.
"""

from __future__ import annotations

import http.client
import json
import shutil
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import openai
import pytest

from fake_verifier import FakeVerifier, cycle_successor, start_fake_verifier
from specinfer.params import Constraint, GenerationParams, SamplingParams
from specinfer.pool.demo_training import DEMO_CHAT_TEMPLATE
from specinfer.tokenizer import TextTokenizer
from specinfer.v1 import specinfer_pb2 as pb
from test_stack_e2e import redis_url
from util import add_tokenizer, free_port, start_stack, wait_until

WIDTHS = (1, 2, 1, 1)
TOKEN = "test-client-token"


@pytest.fixture(scope="module")
def chat_model(text_pair, tmp_path_factory):
    """The LLM's tokenizer files, with the demo chat template (the gateway loads only these)."""
    llm, _ = text_pair
    out = tmp_path_factory.mktemp("chat") / "llm"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(llm / name, out / name)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": DEMO_CHAT_TEMPLATE}))
    return out


@pytest.fixture(scope="module")
def stack(text_pair, chat_model):
    llm, ssm = text_pair
    gateway = {"redis_url": redis_url(), "key_prefix": f"specinfer-test-{uuid.uuid4().hex[:8]}:",
               "http_port": free_port(), "model_dir": chat_model}
    with start_stack(llm, [ssm], tree_width=WIDTHS, speculator_step_timeout_s=2, is_load_aware=False,
                     gateway=gateway) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{stack.gateway.http_port}/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def extra_gateway(model_dir, verifier_addr: str, **cfg):
    from services.gateway.config import GatewayConfig
    from services.gateway.server import serve
    from specinfer.serving.metrics import new_registry
    from specinfer.serving.tracing import setup_tracing

    cfg = GatewayConfig(**{"port": 0, "http_port": free_port(), "verifier_addr": verifier_addr, "model_dir": model_dir,
                           "grace_s": 0, **cfg})
    return serve(cfg, setup_tracing("specinfer-gateway", None), new_registry())


@pytest.fixture(scope="module")
def guarded(text_pair, stack):
    """A second gateway over the same verifier: a client token required, one request at a time
    (no queue), and a model directory without a chat template."""
    from services.gateway.admission import AdmissionConfig
    from specinfer.limits import RequestLimits
    from specinfer.serving.security import ServerSecurity

    server = extra_gateway(text_pair[0], f"127.0.0.1:{stack.verifier.port}", server_security=ServerSecurity(TOKEN),
                           limits=RequestLimits(max_concurrent_requests=1),
                           admission=AdmissionConfig(min_running=1, latency_factor=0, max_queued=0))
    yield server
    server.stop(0)


def request(port: int, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, headers=headers or {},
                                 method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


# ---- answers ------------------------------------------------------------------------------------
def test_models_lists_the_served_model(client, chat_model):
    assert [m.id for m in client.models.list().data] == [chat_model.name]


@pytest.mark.parametrize("prompt", ["def add(a, b", "import os\n"])
def test_greedy_completion_equals_the_grpc_api(stack, client, model, prompt):
    grpc_resp = stack.gateway_stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=24), timeout=60)
    resp = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
    assert resp.choices[0].text == grpc_resp.text and resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == len(grpc_resp.token_ids) == 24
    assert resp.usage.prompt_tokens == grpc_resp.stats.prompt_tokens
    metrics = resp.model_extra["metrics"]
    assert metrics["llm_steps"] == grpc_resp.stats.llm_steps and metrics["tokens_per_step"] > 1.0


def test_a_prompt_served_from_the_prefix_cache_reports_it_and_answers_as_cold(stack, client, model):
    system = f"# {uuid.uuid4().hex}\n" + "import os\nimport sys\n" * 20  # nobody has sent this prefix yet
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "def add(a, b):"}]
    cold = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    warm = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens >= 0.8 * warm.usage.prompt_tokens
    assert warm.choices[0].message.content == cold.choices[0].message.content
    other = [messages[0], {"role": "user", "content": "for x in range(3):"}]  # the same system prompt
    metrics = stack.verifier_servicer.engine.scheduler.metrics  # the verifier's Prometheus counters
    hits_before = metrics.prefix_cache_hits._value.get()
    shared = client.chat.completions.create(model=model, messages=other, max_tokens=4, temperature=0)
    assert shared.usage.prompt_tokens_details.cached_tokens >= 0.8 * shared.usage.prompt_tokens
    assert metrics.prefix_cache_hits._value.get() - hits_before == shared.usage.prompt_tokens_details.cached_tokens
    assert metrics.prefix_cache_queries._value.get() >= metrics.prefix_cache_hits._value.get()


def test_streamed_completion_adds_up_to_the_plain_one(client, model):
    plain = client.completions.create(model=model, prompt="for x in", max_tokens=30, temperature=0)
    chunks = list(client.completions.create(model=model, prompt="for x in", max_tokens=30, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) > 2 and "".join(texts) == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_renders_the_template_plain_and_streamed(client, model):
    messages = [{"role": "system", "content": "python"}, {"role": "user", "content": "add two numbers"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0)
    # what the demo template renders, sent as a plain prompt, gives the same greedy continuation
    prompt = "# system: python\n# user: add two numbers\n# assistant:"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0)
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.choices[0].message.role == "assistant" and chat.object == "chat.completion"
    stream = list(client.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == plain.choices[0].text
    assert stream[-1].choices[0].finish_reason == "length"


def test_stop_string_ends_the_text_before_it(client, model):
    full = client.completions.create(model=model, prompt="import os\n", max_tokens=40, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    resp = client.completions.create(model=model, prompt="import os\n", max_tokens=40, temperature=0, stop=[stop])
    assert resp.choices[0].text == text[:text.index(stop)] and resp.choices[0].finish_reason == "stop"


def test_stop_token_ids_end_the_text_before_the_token(stack, client, model, chat_model):
    tokenizer = TextTokenizer.from_dir(chat_model)
    ids = list(stack.gateway_stub.Generate(pb.GenerateRequest(prompt="import os\n", max_tokens=30), timeout=60).token_ids)
    stop_id = next(t for i, t in enumerate(ids) if i >= 3 and t not in ids[:i])
    resp = client.completions.create(model=model, prompt="import os\n", max_tokens=30, temperature=0,
                                     extra_body={"stop_token_ids": [stop_id]})
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].text == tokenizer.decode(ids[:ids.index(stop_id)])


def test_seed_reproduces_a_sample(client, model):
    def sample(seed):
        return client.completions.create(model=model, prompt="def add(", max_tokens=24, temperature=1.0,
                                         seed=seed).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1  # the seed is used, not ignored


def test_extra_body_fields_reach_the_core(stack, client, model):
    off = client.completions.create(model=model, prompt="import sys", max_tokens=20, temperature=0,
                                    extra_body={"speculate": False})
    on = client.completions.create(model=model, prompt="import sys", max_tokens=20, temperature=0,
                                   extra_body={"tree_width": [1, 1, 2]})
    assert off.choices[0].text == on.choices[0].text
    assert off.model_extra["metrics"]["tokens_per_step"] == pytest.approx(1.0)
    assert on.model_extra["metrics"]["tokens_per_step"] > 1.0


# ---- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"prompt": ""}, "prompt"),
    ({"stop": ["x"] * 20}, "stop"),
    ({"max_tokens": 100000}, "max_tokens"),
    ({"extra_body": {"no_such_field": 1}}, "no_such_field"),
    ({"extra_body": {"max_tokens": "5"}}, "max_tokens"),
    ({"extra_body": {"tree_width": "1,x"}}, None),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"n": 17}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"extra_body": {"stop_token_ids": [-1]}}, "stop_token_ids"),
])
def test_bad_input_is_400_naming_the_field(client, model, kwargs, param):
    args = {"model": model, "prompt": "import os", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**args)
    assert err.value.status_code == 400
    body = err.value.body
    assert body["type"] == "invalid_request_error" and body["message"]
    if param is not None:
        assert body["message"].startswith(param) or (body["param"] or "").startswith(param), body


def test_malformed_json_and_unknown_model(stack, client):
    status, body = request(stack.gateway.http_port, "/v1/completions", b'{"model": "x", "prompt": ',
                        {"Content-Type": "application/json"})
    assert status == 400 and "Invalid JSON" in json.loads(body)["error"]["message"]
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="import os", max_tokens=4)
    assert err.value.body["code"] == "model_not_found"


def test_oversize_body_is_413_before_it_is_read(stack):
    conn = http.client.HTTPConnection("127.0.0.1", stack.gateway.http_port, timeout=10)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(stack.gateway.core.cfg.max_message_bytes + 1))
    conn.endheaders()  # no body sent: the answer comes from the declared length alone
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "body_too_large"
    conn.close()


def test_token_required_and_chat_without_template_is_400(guarded):
    port = guarded.http_port
    assert request(port, "/health")[0] == 200  # open
    assert request(port, "/v1/models")[0] == 401
    assert request(port, "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0, timeout=60) as c:
        model = c.models.list().data[0].id
        assert c.completions.create(model=model, prompt="import os", max_tokens=4, temperature=0).choices[0].text
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert "no chat template" in err.value.body["message"]


def test_overload_is_429(guarded):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{guarded.http_port}/v1", api_key=TOKEN, max_retries=0,
                       timeout=60) as c:
        model = c.models.list().data[0].id
        stream = c.completions.create(model=model, prompt="import os", max_tokens=500, stream=True,
                                      extra_body={"speculate": False})
        next(iter(stream))  # the one slot is taken
        with pytest.raises(openai.RateLimitError) as err:
            c.completions.create(model=model, prompt="import os", max_tokens=2)
        stream.close()
    assert err.value.status_code == 429 and err.value.body["type"] == "rate_limit_error"
    assert int(err.value.response.headers["retry-after"]) >= 1  # when to come back, in whole seconds


def test_verifier_down_is_503(text_pair):
    server = extra_gateway(text_pair[0], f"127.0.0.1:{free_port()}")  # nothing listens there
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0,
                           timeout=60) as c:
            with pytest.raises(openai.InternalServerError) as err:
                c.completions.create(model=text_pair[0].name, prompt="import os", max_tokens=2)
    finally:
        server.stop(0)
    assert err.value.status_code == 503 and err.value.body["type"] == "service_unavailable"


def test_tls_when_the_gateway_serves_tls(text_pair, stack, tmp_path):
    import ssl

    from specinfer.serving.security import ServerSecurity
    from test_security import _certs

    certs = _certs(tmp_path)
    server = extra_gateway(text_pair[0], f"127.0.0.1:{stack.verifier.port}",
                           server_security=ServerSecurity(tls_cert=certs["server"], tls_key=certs["server_key"]))
    try:
        context = ssl.create_default_context(cafile=str(certs["ca"]))
        with urllib.request.urlopen(f"https://127.0.0.1:{server.http_port}/health", context=context, timeout=10) as r:
            assert r.status == 200
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/health", timeout=10).read()
    finally:
        server.stop(0)


@pytest.mark.parametrize("kwargs", [{"echo": True}, {"suffix": "x"}, {"best_of": 3},
                                    {"prompt": ["a", "b"]}, {"stream_options": {"include_usage": True}}])
def test_openai_fields_we_do_not_implement_are_400_not_ignored(client, model, kwargs):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**{"model": model, "prompt": "import os", "max_tokens": 4, **kwargs})
    assert err.value.body["message"].startswith(("echo", "suffix", "best_of", "prompt", "stream_options"))


# ---- the client leaving, health, metrics ----------------------------------------------------------
def test_disconnect_mid_stream_frees_the_verifier(stack, client, model):
    llm_alloc = stack.verifier_servicer.engine.verifier.runner.allocator
    stream = client.completions.create(model=model, prompt="for x in", max_tokens=500, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    request_id = next(iter(stream)).id.removeprefix("cmpl-")
    stream.close()  # the client goes away mid-stream
    core = stack.gateway.core
    assert wait_until(lambda: llm_alloc.num_used == 0 and core.registry.get(request_id) is None, timeout=3.0)
    record = core.get_request(request_id)
    assert record.status == "interrupted" and len(record.generated_ids) < 500


def test_disconnect_while_waiting_for_a_whole_response_frees_the_verifier(stack, client, model, executor):
    core = stack.gateway.core
    # 500 plain tokens of the tiny model take about 0.5 s on a quiet machine: the client gives up well before.
    reply = executor.submit(client.with_options(timeout=0.2).completions.create, model=model, prompt="import os",
                            max_tokens=500, temperature=0, extra_body={"speculate": False})
    assert wait_until(lambda: core.registry.all(), timeout=5.0)
    request_id = core.registry.all()[0].request_id
    with pytest.raises(openai.APITimeoutError):
        reply.result(timeout=30)  # the client gives up and disconnects
    assert wait_until(lambda: core.registry.get(request_id) is None, timeout=3.0)
    record = core.get_request(request_id)
    assert record.status == "interrupted" and len(record.generated_ids) < 500


def test_draining_stops_http_with_grpc(text_pair, stack, executor):
    """SIGTERM's drain: the HTTP API stops taking requests as the gRPC API's drain begins, not
    after it, while a gRPC request in flight runs on to its end."""
    from specinfer.v1 import specinfer_pb2_grpc as pb_grpc

    server = extra_gateway(text_pair[0], f"127.0.0.1:{stack.verifier.port}", grace_s=10.0)
    port = server.http_port
    stub = pb_grpc.GatewayStub(stack.channel(server.port))
    stream = stub.GenerateStream(pb.GenerateRequest(prompt="import os", max_tokens=500, speculate=False), timeout=60)
    next(stream)
    assert request(port, "/health")[0] == 200
    stopping = executor.submit(server.stop)

    def is_refused() -> bool:
        try:
            return request(port, "/health")[0] != 200
        except (urllib.error.URLError, ConnectionError):
            return True

    assert wait_until(is_refused, timeout=30)
    assert server.core.registry.all(), "the gRPC request should still be running"  # refused before the drain ended
    assert sum(len(c.token_ids) for c in stream) > 0 and stopping.result(timeout=30) is None


def test_health_and_metrics(stack, client, model):
    port = stack.gateway.http_port
    status, body = request(port, "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    client.completions.create(model=model, prompt="import os", max_tokens=2, temperature=0)
    status, body = request(port, "/metrics")
    text = body.decode()
    assert status == 200 and 'specinfer_gateway_requests_total{code="OK",method="HTTP /v1/completions"}' in text
    assert "specinfer_gateway_output_tokens" in text


# ---- logprobs and n ----------------------------------------------------------------------------
def test_greedy_logprobs_are_the_grpc_apis_and_pick_the_argmax(stack, client, model, chat_model):
    tokenizer = TextTokenizer.from_dir(chat_model)
    grpc_resp = stack.gateway_stub.Generate(pb.GenerateRequest(prompt="def add(", max_tokens=12, logprobs=3),
                                            timeout=60)
    resp = client.completions.create(model=model, prompt="def add(", max_tokens=12, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([t.logprob for t in grpc_resp.logprobs], abs=1e-6)
    assert lp.tokens == [tokenizer.decode([t]) for t in grpc_resp.token_ids]
    for chosen, top, expected in zip(lp.token_logprobs, lp.top_logprobs, grpc_resp.logprobs):
        # one entry per distinct token text (of alternatives that decode alike, the most likely),
        # most likely first, as OpenAI and vLLM list them
        by_text: dict = {}
        for t, v in zip(expected.top_token_ids, expected.top_logprobs):
            by_text.setdefault(tokenizer.decode([t]), v)
        assert list(top.items()) == [(k, pytest.approx(v, abs=1e-6)) for k, v in by_text.items()]
        assert list(top.values()) == sorted(top.values(), reverse=True) and len(top) > 1
        assert chosen == pytest.approx(max(top.values()), abs=1e-6)  # greedy: the argmax
    assert lp.text_offset[0] == 0 and lp.model_extra["logprob_space"] == "raw"
    streamed = list(client.completions.create(model=model, prompt="def add(", max_tokens=12, temperature=0,
                                              logprobs=3, stream=True))
    assert [v for c in streamed if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs] == \
        pytest.approx(lp.token_logprobs, abs=1e-6)


def test_chat_logprobs_one_per_token(client, model):
    resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "sum"}], max_tokens=8,
                                          temperature=0.8, seed=3, logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 8
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)  # most likely first
    assert resp.choices[0].logprobs.model_extra["logprob_space"] == "processed"


def test_n_samples_are_choices_and_sample_0_is_the_single_request(client, model):
    args = {"model": model, "prompt": "import", "max_tokens": 16, "temperature": 1.0, "seed": 11}
    single = client.completions.create(**args)
    both = client.completions.create(n=2, **args)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == single.choices[0].text
    assert both.usage.completion_tokens == 32 and both.usage.prompt_tokens == single.usage.prompt_tokens
    streamed = list(client.completions.create(n=2, stream=True, **args))
    for i in (0, 1):
        assert "".join(c.choices[0].text for c in streamed if c.choices[0].index == i) == both.choices[i].text
    assert len({c.id for c in streamed}) == 1 and both.id.count(".") == 0
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], n=2,
                                          max_tokens=8, temperature=1.0, seed=2)
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 16


def test_the_benchmarks_http_arm_answers_what_grpc_answers(stack, model):
    from specinfer.cli.bench_serving import measure_http_overhead
    from specinfer.client import GatewayClient

    with GatewayClient(f"127.0.0.1:{stack.gateway.port}", timeout_s=60) as grpc_client:
        out = measure_http_overhead(grpc_client, f"http://127.0.0.1:{stack.gateway.http_port}", model,
                                    ["import os", "def add("], WIDTHS, 8)
    assert out["greedy_equal"] and out["num_prompts"] == 2 and out["grpc_ms_per_token"] > 0 < out["http_ms_per_token"]

# ---- configuration ------------------------------------------------------------------------------
def test_http_port_flag_env_and_default(tmp_path):
    from services.gateway.config import config_from_args
    from specinfer.errors import UserError

    args = ["--model-dir", str(tmp_path)]
    assert config_from_args(args, {}).http_port == 0  # a bare gateway serves gRPC only
    assert config_from_args(args, {"SPECINFER_HTTP_PORT": "8001"}).http_port == 8001
    assert config_from_args(args + ["--http-port", "9000"], {"SPECINFER_HTTP_PORT": "8001"}).http_port == 9000
    with pytest.raises(UserError, match="SPECINFER_HTTP_PORT"):
        config_from_args(args, {"SPECINFER_HTTP_PORT": "70000"})


def test_specinfer_up_serves_http_on_8000_unless_turned_off(monkeypatch):
    from specinfer.cli.launcher import Stack, StackConfig

    spawned = {}
    monkeypatch.setattr(Stack, "_spawn", lambda self, name, module, args, port, env: spawned.update({name: env}))
    Stack(StackConfig(llm=Path("/m/llm"), ssms=(Path("/m/a"),))).start()
    assert spawned["gateway"]["SPECINFER_HTTP_PORT"] == "8000"
    Stack(StackConfig(llm=Path("/m/llm"), ssms=(Path("/m/a"),), http_port=0)).start()
    assert spawned["gateway"]["SPECINFER_HTTP_PORT"] == "0"


# ---- chat templates -----------------------------------------------------------------------------
def test_chat_template_is_rendered_in_a_sandbox(tmp_path):
    from specinfer.chat_template import ChatRenderer, ChatTemplate
    from specinfer.errors import UserError

    def renderer(template):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>"}))
        return ChatRenderer(ChatTemplate.from_dir(tmp_path))

    messages = [{"role": "user", "content": "hi"}]
    assert renderer(DEMO_CHAT_TEMPLATE).render(messages) == "# user: hi\n# assistant:"
    assert renderer("{{ bos_token }}{{ messages[0].content }}").render(messages) == "<s>hi"
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"  # reaching Python's classes: refused
    with pytest.raises(UserError, match="refused"):
        renderer(escape).render(messages)
    with pytest.raises(UserError, match="refused them: no system"):
        renderer("{% if messages[0].role != 'system' %}{{ raise_exception('no system') }}{% endif %}").render(messages)
    with pytest.raises(UserError, match="does not compile"):
        renderer("{% for %}").render(messages)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert ChatTemplate.from_dir(tmp_path) is None


def test_demo_models_get_the_chat_template_and_keep_their_own(tmp_path):
    from specinfer.chat_template import ChatTemplate
    from specinfer.pool.demo_training import add_chat_template

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    add_chat_template(tmp_path)  # a cache built before demo models had a template
    assert ChatTemplate.from_dir(tmp_path).source == DEMO_CHAT_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    add_chat_template(tmp_path)
    assert ChatTemplate.from_dir(tmp_path).source == "{{ messages }}"


# ---- structured output and the sampling surface, against a fake verifier --------------------------
BASE_CORPUS = ["yes no maybe. ", "the answer is 42. ", "hello world, hello gateway. "] * 30
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    """A base model's tokenizer files: no chat template of its own."""
    out = tmp_path_factory.mktemp("base") / "base-llm"
    out.mkdir()
    add_tokenizer(out, 300, BASE_CORPUS)
    return out


@pytest.fixture(scope="module")
def fake_server(base_model):
    tokenizer = TextTokenizer.from_dir(base_model)
    fake = FakeVerifier(cycle_successor(list(dict.fromkeys(tokenizer.encode(" yes no maybe")))))
    server = start_fake_verifier(fake)
    yield fake, server
    server.stop(0)


@pytest.fixture
def fake(fake_server) -> FakeVerifier:
    fake_server[0].reset()
    return fake_server[0]


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(DEMO_CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def fake_gateway(base_model, fake_server, template_file):
    server = extra_gateway(base_model, f"127.0.0.1:{fake_server[1].port}", chat_template=template_file)
    yield server
    server.stop(0)


@pytest.fixture(scope="module")
def fake_client(fake_gateway):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{fake_gateway.http_port}/v1", api_key="unused", max_retries=0,
                       timeout=30) as c:
        yield c


def completion_kwargs(kwargs: dict) -> dict:
    """The `openai` client's completions.create has no response_format: it goes in the extra body."""
    if "response_format" not in kwargs:
        return kwargs
    rest = {k: v for k, v in kwargs.items() if k != "response_format"}
    return {**rest, "extra_body": {**kwargs.get("extra_body", {}), "response_format": kwargs["response_format"]}}


def stored_params(gateway, response_id: str) -> GenerationParams:
    """The domain parameters the gateway recorded for a request (what it resumes with)."""
    record = gateway.core.get_request(response_id.split("-", 1)[1])
    return GenerationParams.from_json(record.params)


def test_the_openai_client_reaches_the_domain_params(fake_gateway, fake_client, fake):
    messages = [{"role": "user", "content": "yes or no?"}]
    resp = fake_client.chat.completions.create(
        model="base-llm", messages=messages, max_tokens=4, temperature=0.5, seed=3, presence_penalty=0.5,
        frequency_penalty=-0.25, logit_bias={"5": -100, "7": 2.5},
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}},
        extra_body={"repetition_penalty": 1.25, "min_p": 0.125})
    assert resp.choices[0].message.content
    params = stored_params(fake_gateway, resp.id)
    assert params.sampling == SamplingParams(temperature=0.5, seed=3, presence_penalty=0.5, frequency_penalty=-0.25,
                                             repetition_penalty=1.25, min_p=0.125,
                                             logit_bias=((5, -100.0), (7, 2.5)))
    assert params.constraint.kind == "json_schema" and json.loads(params.constraint.spec) == SCHEMA
    req = fake.calls[0].request  # and the verifier got them as they are
    assert req.sampling.presence_penalty == 0.5 and req.sampling.frequency_penalty == -0.25
    assert req.sampling.repetition_penalty == 1.25 and req.sampling.min_p == 0.125
    assert dict(req.sampling.logit_bias) == {5: -100.0, 7: 2.5}
    assert json.loads(req.constraint.json_schema) == SCHEMA and req.num_resumed_tokens == 0

    resp = fake_client.chat.completions.create(model="base-llm", messages=messages, max_tokens=4,
                                               extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert stored_params(fake_gateway, resp.id).constraint == Constraint("choice", choices=("yes", "no"))
    assert list(fake.calls[1].request.constraint.choice.choices) == ["yes", "no"]
    fake_client.chat.completions.create(model="base-llm", messages=messages, max_tokens=4)
    assert not fake.calls[2].request.HasField("constraint") and not fake.calls[2].request.sampling.logit_bias


@pytest.mark.parametrize("kwargs, kind, spec", [
    ({"response_format": {"type": "json_object"}}, "json_object", None),
    ({"response_format": {"type": "text"}}, None, None),
    ({"extra_body": {"structured_outputs": {"json": SCHEMA}}}, "json_schema", SCHEMA),
    ({"extra_body": {"structured_outputs": {"json": json.dumps(SCHEMA)}}}, "json_schema", SCHEMA),
    ({"extra_body": {"structured_outputs": {"regex": "[0-9]{3}"}}}, "regex", "[0-9]{3}"),
    ({"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}}, "choice", ["yes", "no"]),
    ({"extra_body": {"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}}, "grammar", 'root ::= "yes" | "no"'),
    ({"extra_body": {"structured_outputs": {"json_object": True}}}, "json_object", None),
    ({"extra_body": {"guided_json": SCHEMA}}, "json_schema", SCHEMA),
    ({"extra_body": {"guided_regex": "a+"}}, "regex", "a+"),
    ({"extra_body": {"guided_choice": ["a", "b"]}}, "choice", ["a", "b"]),
    ({"extra_body": {"guided_grammar": 'root ::= "a"'}}, "grammar", 'root ::= "a"'),
])
def test_every_way_to_ask_for_structured_output(fake_client, fake, kwargs, kind, spec):
    fake_client.completions.create(model="base-llm", prompt="the answer is", max_tokens=3, **completion_kwargs(kwargs))
    fake_client.chat.completions.create(model="base-llm", messages=[{"role": "user", "content": "the answer?"}],
                                        max_tokens=3, **kwargs)
    assert fake.calls[0].request.constraint == fake.calls[1].request.constraint
    req = fake.calls[0].request
    assert req.constraint.WhichOneof("kind") == kind
    if kind == "json_schema":
        assert json.loads(req.constraint.json_schema) == spec
    elif kind == "choice":
        assert list(req.constraint.choice.choices) == spec
    elif spec is not None:
        assert getattr(req.constraint, kind) == spec


@pytest.mark.parametrize("kwargs, param", [
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"repetition_penalty": 11}}, "repetition_penalty"),
    ({"extra_body": {"min_p": 1.5}}, "min_p"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 300}}, "logit_bias"),
    ({"logit_bias": {"99999999999": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(1100)}}, "logit_bias"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
     "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex"),
    ({"extra_body": {"structured_outputs": {}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"json": "{not json"}}}, "structured_outputs.json"),
    ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice"),
    ({"extra_body": {"structured_outputs": {"grammar": " "}}}, "structured_outputs.grammar"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "backend": "x"}}}, "structured_outputs.backend"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, "guided_choice"),
])
def test_bad_sampling_and_structured_fields_are_400_naming_the_field(fake_client, fake, kwargs, param):
    calls = (lambda: fake_client.completions.create(model="base-llm", prompt="x", max_tokens=2,
                                                    **completion_kwargs(kwargs)),
             lambda: fake_client.chat.completions.create(model="base-llm", messages=[{"role": "user", "content": "x"}],
                                                         max_tokens=2, **kwargs))
    for create in calls:
        with pytest.raises(openai.BadRequestError) as err:
            create()
        body = err.value.body
        assert err.value.status_code == 400 and body["type"] == "invalid_request_error"
        assert body["param"] == param and body["message"].startswith(param), body
    assert fake.calls == []  # refused before anything went downstream


def test_what_only_the_verifier_can_check_is_400_too(fake_client, fake):
    """A schema that does not compile, a token outside the vocabulary: the verifier refuses them
    (INVALID_ARGUMENT), and the client gets OpenAI's 400, plain or streamed."""
    fake.refuse = lambda req: ("json_schema: does not compile: unknown type 'nope'" if req.HasField("constraint")
                               else "sampling.logit_bias: token 400 is outside the vocabulary (size 300)")
    bad_schema = {"response_format": {"type": "json_schema",
                                      "json_schema": {"name": "x", "schema": {"type": "nope"}}}}
    for kwargs, param in ((bad_schema, "json_schema"), ({"logit_bias": {"400": 1}}, "logit_bias")):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as err:
                out = fake_client.completions.create(model="base-llm", prompt="x", max_tokens=2, stream=stream,
                                                     **completion_kwargs(kwargs))
                list(out) if stream else None
            body = err.value.body
            assert body["type"] == "invalid_request_error" and body["param"] == param, body
            assert body["message"].startswith("verifier: ")


def test_a_chat_template_file_lets_a_base_model_serve_chat(fake_gateway, fake_client, fake, base_model):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "yes?"}]
    chat = fake_client.chat.completions.create(model="base-llm", messages=messages, max_tokens=4, temperature=0)
    rendered = "# system: be brief\n# user: yes?\n# assistant:"  # what the file's template renders
    plain = fake_client.completions.create(model="base-llm", prompt=rendered, max_tokens=4, temperature=0)
    assert chat.choices[0].message.content == plain.choices[0].text
    assert list(fake.calls[0].request.prompt_ids) == list(fake.calls[1].request.prompt_ids)
    assert fake_gateway.core.cfg.chat_template is not None


def test_chat_template_flag_env_and_bad_files(base_model, template_file, tmp_path, capsys):
    from services.gateway.config import config_from_args
    from services.gateway.server import main
    from specinfer.errors import UserError

    args = ["--model-dir", str(base_model)]
    assert config_from_args(args, {}).chat_template is None
    assert config_from_args(args, {"SPECINFER_CHAT_TEMPLATE": str(template_file)}).chat_template == template_file
    assert config_from_args(args + ["--chat-template", str(template_file)], {}).chat_template == template_file
    (tmp_path / "broken.jinja").write_text("{% for %}")
    (tmp_path / "empty.jinja").write_text("  \n")
    (tmp_path / "binary.jinja").write_bytes(b"\xff\xfe{{")
    for path, reason in ((tmp_path / "missing.jinja", "cannot read"), (tmp_path, "cannot read"),
                         (tmp_path / "binary.jinja", "cannot read"), (tmp_path / "broken.jinja", "does not compile"),
                         (tmp_path / "empty.jinja", "is empty")):
        with pytest.raises(UserError, match=f"^--chat-template .*{reason}"):
            config_from_args(args + ["--chat-template", str(path)], {})
        with pytest.raises(UserError, match="SPECINFER_CHAT_TEMPLATE"):
            config_from_args(args, {"SPECINFER_CHAT_TEMPLATE": str(path)})
    capsys.readouterr()
    assert main(args + ["--chat-template", str(tmp_path / "missing.jinja")]) == 2  # the service exits at once
    err = capsys.readouterr().err
    assert err.startswith("specinfer-gateway: error: --chat-template") and len(err.strip().splitlines()) == 1


def test_specinfer_up_passes_a_chat_template_to_the_gateway(monkeypatch, template_file, tmp_path, capsys):
    from specinfer.cli.launcher import Stack, StackConfig
    from specinfer.cli.main import main

    spawned = {}
    monkeypatch.setattr(Stack, "_spawn", lambda self, name, module, args, port, env: spawned.update({name: env}))
    Stack(StackConfig(llm=Path("/m/llm"), ssms=(), chat_template=template_file)).start()
    assert spawned["gateway"]["SPECINFER_CHAT_TEMPLATE"] == str(template_file.resolve())
    Stack(StackConfig(llm=Path("/m/llm"), ssms=())).start()
    assert "SPECINFER_CHAT_TEMPLATE" not in spawned["gateway"]
    (tmp_path / "broken.jinja").write_text("{% if %}")
    for path in (tmp_path / "missing.jinja", tmp_path / "broken.jinja"):  # refused before any model or process
        assert main(["up", "--chat-template", str(path), "--cache-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "--chat-template" in err and len(err.strip().splitlines()) == 1
