"""Every input is bounded before work is done on it, and fails alone with an error naming its field.

The gateway measures a prompt or session prefix before tokenizing it, tokenizes without stalling
other requests, checks named SSMs against the verifier's Info before recording a request; the
verifier enforces the request limits itself, whoever calls it; checkpoints that need remote
code or pickle loading are refused with one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from opentelemetry import trace

import services.gateway.core as gateway_core
from fake_verifier import FakeVerifier, cycle_successor, start_fake_verifier
from services.gateway.config import GatewayConfig
from services.gateway.core import CallContext
from services.gateway.server import serve
from services.gateway.validation import NewRequest
from services.verifier.config import parse_config
from specinfer.engine.models.config import ModelConfig
from specinfer.errors import UserError
from specinfer.limits import MAX_BYTES_PER_TOKEN, RequestLimits, max_prompt_chars
from specinfer.params import GenerationParams
from specinfer.serving.metrics import new_registry
from specinfer.tokenizer import TextTokenizer
from specinfer.v1 import specinfer_pb2 as pb
from specinfer.v1 import specinfer_pb2_grpc as pb_grpc
from util import add_tokenizer, save_tiny_llama, start_stack

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ["hello world, hello gateway. ", "the quick brown fox jumps over the lazy dog. "] * 30
LIMITS = RequestLimits(max_prompt_tokens=64, max_new_tokens=64, default_max_new_tokens=8, max_concurrent_requests=8)
HUGE = 20_000_000  # characters: a 20 MB paste
NEAR_WIRE_LIMIT = 3_900_000  # characters: the largest prompt gRPC's default 4 MiB message carries


class WatchedTokenizer(TextTokenizer):
    """A TextTokenizer that records every encode's length, and announces when an encode of a big
    text (over 100k characters) starts and ends."""

    def __init__(self, inner: TextTokenizer):
        super().__init__(inner.tok, inner.eos_token_ids, inner.bos_token_id)
        self.calls: list[int] = []  # characters per encode
        self.big_started, self.big_ended = threading.Event(), threading.Event()

    def encode(self, text: str) -> list[int]:
        self.calls.append(len(text))
        if len(text) <= 100_000:
            return super().encode(text)
        self.big_started.set()
        try:
            return super().encode(text)
        finally:
            self.big_ended.set()


class NamedFakeVerifier(FakeVerifier):
    """The fake verifier, hosting named SSMs; its Info can be made to fail."""

    def __init__(self, *args, ssm_names=("ssm-a", "ssm-b"), **kwargs):
        super().__init__(*args, **kwargs)
        self.ssm_names = list(ssm_names)
        self.is_info_down = False

    def Info(self, request, context):
        if self.is_info_down:
            context.abort(grpc.StatusCode.UNAVAILABLE, "Info is down")
        info = super().Info(request, context)
        info.ssm_names.extend(self.ssm_names)
        return info


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bounds_tok")
    add_tokenizer(d, 400, CORPUS)
    return d


@pytest.fixture(scope="module")
def base_tokenizer(tok_dir) -> TextTokenizer:
    return TextTokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def fake_server(base_tokenizer):
    fake = NamedFakeVerifier(cycle_successor(list(dict.fromkeys(base_tokenizer.encode(" hello world gateway")))))
    server = start_fake_verifier(fake)
    yield fake, server
    server.stop(0)


@pytest.fixture
def fake(fake_server) -> NamedFakeVerifier:
    fake_server[0].reset()
    fake_server[0].is_info_down = False
    return fake_server[0]


class Gateway:
    """A gateway in front of the fake verifier, with a watched tokenizer and its own channel."""

    def __init__(self, port: int, tok_dir: Path, tokenizer: TextTokenizer, limits: RequestLimits):
        self.tokenizer = WatchedTokenizer(tokenizer)
        cfg = GatewayConfig(port=0, verifier_addr=f"127.0.0.1:{port}", model_dir=tok_dir, limits=limits, grace_s=0)
        self.server = serve(cfg, trace.NoOpTracer(), new_registry(), tokenizer=self.tokenizer)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.stub = pb_grpc.GatewayStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0)


@pytest.fixture
def gateway(fake_server, tok_dir, base_tokenizer):
    gw = Gateway(fake_server[1].port, tok_dir, base_tokenizer, LIMITS)
    yield gw
    gw.close()


def rpc_error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


class _Link:
    def is_active(self) -> bool:
        return True

    def add_callback(self, callback) -> bool:
        return True


# ---- sizes before tokenizing -------------------------------------------------------------------
def test_bound_is_generous_for_real_text(base_tokenizer):
    """Real text is far inside the bound: a prompt of exactly max_prompt_tokens tokens of the test
    corpus has a few characters per token, against MAX_BYTES_PER_TOKEN allowed."""
    ids = base_tokenizer.encode("".join(CORPUS))[:LIMITS.max_prompt_tokens]
    text = base_tokenizer.decode(ids)
    assert len(text) / len(ids) < MAX_BYTES_PER_TOKEN / 4
    assert max_prompt_chars(LIMITS) == LIMITS.max_prompt_tokens * MAX_BYTES_PER_TOKEN


def test_oversize_prompt_is_refused_before_tokenizing(gateway, fake):
    request = pb.GenerateRequest(prompt="hello world " * (NEAR_WIRE_LIMIT // 12), max_tokens=4)
    for call in (lambda: gateway.stub.Generate(request, timeout=10),
                 lambda: list(gateway.stub.GenerateStream(request, timeout=10))):
        err = rpc_error(call)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("prompt:"), err
    assert gateway.tokenizer.calls == [] and fake.calls == []  # refused before any tokenizing


def test_huge_prompt_is_refused_in_the_core_before_tokenizing(gateway, fake):
    """A 20 MB prompt (past the default message size; a deployment may raise it) costs nothing."""
    prompt = "hello world " * (HUGE // 12)
    with pytest.raises(UserError, match=r"^prompt: \d+ characters"):
        next(gateway.server.core.generate(NewRequest(prompt, GenerationParams()), CallContext(_Link(), 5.0)))
    assert gateway.tokenizer.calls == [] and fake.calls == []  # by its length alone


def test_oversize_session_prefix_is_refused_before_tokenizing(gateway):
    err = rpc_error(lambda: gateway.stub.CreateSession(
        pb.CreateSessionRequest(prefix="hello world " * (NEAR_WIRE_LIMIT // 12)), timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("prefix:"), err
    with pytest.raises(UserError, match=r"^prefix: \d+ characters"):
        gateway.server.core.create_session("hello world " * (HUGE // 12))
    assert gateway.tokenizer.calls == []  # by its length alone
    assert gateway.stub.CreateSession(pb.CreateSessionRequest(prefix="hello world"), timeout=5).session_id
    assert len(gateway.tokenizer.calls) == 1


def test_oversize_ssm_names_are_refused(gateway, fake):
    for names, field in ((["x"] * 17, "ssm_names"), (["x" * 129], "ssm_names[0]")):
        err = rpc_error(lambda: gateway.stub.Generate(pb.GenerateRequest(prompt="hi", ssm_names=names), timeout=5))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(field), err
    assert gateway.tokenizer.calls == [] and fake.calls == []


def test_tokenizing_a_long_prompt_does_not_stall_other_requests(fake_server, tok_dir, base_tokenizer):
    fake = fake_server[0]
    fake.reset()
    gw = Gateway(fake_server[1].port, tok_dir, base_tokenizer, RequestLimits(max_prompt_tokens=200_000))
    try:
        # 2.4 MB of text: its encode takes seconds, in native code that lets other threads run
        big = threading.Thread(target=lambda: rpc_error(lambda: gw.stub.Generate(
            pb.GenerateRequest(prompt="hello world " * 200_000, max_tokens=4), timeout=60)))
        big.start()
        assert gw.tokenizer.big_started.wait(10)
        small = gw.stub.Generate(pb.GenerateRequest(prompt="hello", max_tokens=2), timeout=30)
        assert len(small.token_ids) == 2
        assert not gw.tokenizer.big_ended.is_set(), "the small request waited for the big one"
        big.join(60)
        assert gw.tokenizer.big_ended.is_set()
    finally:
        gw.close()


# ---- SSM names against the verifier's Info -----------------------------------------------------------
def test_unknown_ssm_names_are_refused_before_the_request_is_recorded(gateway, fake, monkeypatch):
    monkeypatch.setattr(gateway_core, "INFO_REFRESH_S", 0.0)
    err = rpc_error(lambda: gateway.stub.Generate(
        pb.GenerateRequest(prompt="hello", max_tokens=2, ssm_names=["ssm-a", "nope"], request_id="r-unknown-ssm"),
        timeout=5))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("ssm_names"), err
    assert "nope" in err.details() and "ssm-a" in err.details()
    assert fake.calls == []
    err = rpc_error(lambda: gateway.stub.GetRequest(pb.GetRequestRequest(request_id="r-unknown-ssm"), timeout=5))
    assert err.code() == grpc.StatusCode.NOT_FOUND  # no failed record left behind
    resp = gateway.stub.Generate(pb.GenerateRequest(prompt="hello", max_tokens=2, ssm_names=["ssm-b"]), timeout=5)
    assert len(resp.token_ids) == 2 and list(fake.calls[0].request.ssm_names) == ["ssm-b"]
    fake.ssm_names.append("ssm-new")  # a speculator joined: an unknown name re-asks the verifier
    try:
        resp = gateway.stub.Generate(pb.GenerateRequest(prompt="hello", max_tokens=2, ssm_names=["ssm-new"]),
                                     timeout=5)
        assert len(resp.token_ids) == 2
    finally:
        fake.ssm_names.remove("ssm-new")


def test_ssm_names_go_on_when_the_verifier_cannot_say(gateway, fake):
    fake.is_info_down = True
    resp = gateway.stub.Generate(pb.GenerateRequest(prompt="hello", max_tokens=2, ssm_names=["nope"]), timeout=5)
    assert len(resp.token_ids) == 2 and list(fake.calls[0].request.ssm_names) == ["nope"]


# ---- the verifier enforces its own limits ---------------------------------------------------------------
@pytest.fixture(scope="module")
def verifier_stack(tmp_path_factory):
    llm = save_tiny_llama(tmp_path_factory.mktemp("bounds_llm") / "llm", max_pos=4096)
    with start_stack(llm) as stack:
        yield stack


def test_verifier_refuses_max_new_tokens_past_its_limit(verifier_stack):
    limits = RequestLimits()
    err = rpc_error(lambda: list(verifier_stack.verifier_stub.Generate(pb.VerifierGenerateRequest(
        prompt_ids=[4, 5, 6], max_new_tokens=1200, speculate=False, ignore_eos=True), timeout=30)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert "max_tokens" in err.details() and str(limits.max_new_tokens) in err.details()


def test_verifier_refuses_prompts_past_its_limit_but_serves_continuations(verifier_stack):
    limits = RequestLimits()
    total = limits.max_prompt_tokens + limits.max_new_tokens
    too_long = pb.VerifierGenerateRequest(prompt_ids=[4] * (total - 3), max_new_tokens=4, speculate=False,
                                          ignore_eos=True)
    err = rpc_error(lambda: list(verifier_stack.verifier_stub.Generate(too_long, timeout=30)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("prompt_ids"), err
    # A continued request: past max_prompt_tokens by the tokens it generated, asking that many fewer.
    continued = pb.VerifierGenerateRequest(prompt_ids=[4] * (limits.max_prompt_tokens + 10), max_new_tokens=4,
                                           speculate=False, ignore_eos=True)
    ids = [t for r in verifier_stack.verifier_stub.Generate(continued, timeout=60) for t in r.token_ids]
    assert len(ids) == 4


def test_verifier_refuses_tree_shapes_past_the_limits(verifier_stack):
    err = rpc_error(lambda: list(verifier_stack.verifier_stub.Generate(pb.VerifierGenerateRequest(
        prompt_ids=[4, 5], max_new_tokens=4, shape=pb.TreeShape(widths=[1] * 17)), timeout=30)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "shape.widths" in err.details(), err


def test_verifier_limit_flags_and_env(tmp_path):
    cfg = parse_config(["--model", str(tmp_path), "--max-tokens", "64"], {"SPECINFER_MAX_PROMPT_TOKENS": "100"})
    assert (cfg.limits.max_new_tokens, cfg.limits.max_prompt_tokens) == (64, 100)
    defaults = parse_config(["--model", str(tmp_path)], {}).limits
    assert (defaults.max_new_tokens, defaults.max_prompt_tokens) == (512, 2048)
    with pytest.raises(UserError, match="SPECINFER_MAX_TOKENS"):
        parse_config(["--model", str(tmp_path)], {"SPECINFER_MAX_TOKENS": "0"})


# ---- checkpoints the engine does not run --------------------------------------------------------------
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 256, "rms_norm_eps": 1e-5}


def test_config_asking_for_remote_code_is_refused():
    assert ModelConfig.from_dict(TINY_CONFIG).architecture == "LlamaForCausalLM"
    remote = {**TINY_CONFIG, "auto_map": {"AutoConfig": "configuration_x.XConfig",
                                          "AutoModelForCausalLM": "modeling_x.XForCausalLM"}}
    with pytest.raises(UserError, match=r"auto_map .*modeling_x\.XForCausalLM"):
        ModelConfig.from_dict(remote)


@pytest.fixture(scope="module")
def pickle_only_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pickle_only")
    (d / "config.json").write_text(json.dumps(TINY_CONFIG))
    (d / "pytorch_model.bin").write_bytes(b"\x80\x02not loaded")
    add_tokenizer(d, 300, CORPUS)
    return d


@pytest.mark.parametrize("argv", [["-m", "services.verifier", "--port", "0", "--model", "{dir}"],
                                  ["-m", "specinfer.cli", "generate", "--prompt", "hi", "--llm", "{dir}"]],
                         ids=["verifier", "cli"])
def test_pickle_only_checkpoint_is_one_line_and_exit_2(pickle_only_dir, argv):
    argv = [a.format(dir=pickle_only_dir) for a in argv]
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, lines)
    assert len(lines) == 1 and "pickle" in lines[0] and "Traceback" not in lines[0], lines
