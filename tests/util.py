"""Shared test helpers: tiny random-weight Llama checkpoints (no download, no training), the
services started in-process on localhost, and bounded waits on conditions.

The model and service imports sit inside the functions: importing this module is cheap.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    import grpc

    from services.gateway.server import GatewayServer
    from specinfer.serving.grpc_server import RunningServer


# ---- waiting and ports ---------------------------------------------------------------------------
def wait_until(predicate: Callable[[], object], timeout: float = 2.0, interval: float = 0.01) -> bool:
    """Polls `predicate` until it holds or `timeout` seconds pass; returns whether it held. For
    conditions no event announces (a KV pool draining, a span being exported)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return bool(predicate())
        time.sleep(interval)
    return True


def free_port() -> int:
    """A localhost port free when asked (for a listener that cannot take port 0, or a closed port to probe)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the services, in-process --------------------------------------------------------------------
@dataclass
class LocalStack:
    """Speculators, a verifier and optionally a gateway, each a real gRPC server on localhost.
    `stop` (or leaving a `with` block) closes the channels it made and stops every server."""

    speculators: list[tuple[RunningServer, Any]]  # (server, SpeculatorServicer), one per process
    verifier: RunningServer
    verifier_servicer: Any  # VerifierServicer
    gateway: GatewayServer | None = None
    channels: list[grpc.Channel] = field(default_factory=list)

    def channel(self, port: int) -> grpc.Channel:
        import grpc

        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.channels.append(ch)
        return ch

    @cached_property
    def verifier_stub(self):
        from specinfer.v1 import specinfer_pb2_grpc as pb_grpc

        return pb_grpc.VerifierStub(self.channel(self.verifier.port))

    @cached_property
    def gateway_stub(self):
        from specinfer.v1 import specinfer_pb2_grpc as pb_grpc

        assert self.gateway is not None, "this stack runs no gateway"
        return pb_grpc.GatewayStub(self.channel(self.gateway.port))

    def speculator_stub(self, index: int = 0):
        from specinfer.v1 import specinfer_pb2_grpc as pb_grpc

        return pb_grpc.SpeculatorStub(self.channel(self.speculators[index][0].port))

    def stop(self) -> None:
        for ch in self.channels:
            ch.close()
        servers = ([self.gateway] if self.gateway else []) + [self.verifier] + [s for s, _ in self.speculators]
        for server in servers:  # stopping twice is harmless: a test may have stopped one already
            server.stop(0)

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_stack(llm: Path, ssms: Sequence[Path | Sequence[Path]] = (), *, exporter=None,
                speculator_addrs: Sequence[str] = (), speculator: dict | None = None, gateway: dict | None = None,
                **verifier) -> LocalStack:
    """Starts one speculator per entry of `ssms` (one checkpoint, or several hosted together),
    then a verifier for `llm` that speculates with them (and with `speculator_addrs`), then, when
    `gateway` is given (GatewayConfig fields, may be empty), a gateway in front of it. Every
    server listens on a free localhost port, runs on the CPU and stops without draining;
    `speculator`, `verifier` and `gateway` override those config fields. Spans of all three go
    to `exporter` when one is given. If one fails to start, the ones started stop again."""
    from services.speculator.config import SpeculatorConfig
    from services.speculator.server import build as build_speculator
    from services.verifier.config import VerifierConfig
    from services.verifier.server import build as build_verifier

    base = {"port": 0, "device": "cpu", "grace_s": 0}
    # SSMs in float32, as the in-process engines the tests compare with: "auto" may pick bfloat16
    # on one machine and not another, and an SSM in another dtype proposes other trees (the
    # output stays the same, the step counts need not).
    started: list = []
    try:
        specs = []
        for group in ssms:
            dirs = (group,) if isinstance(group, Path) else tuple(group)
            cfg = SpeculatorConfig(dirs, **{**base, "dtype": "float32", **(speculator or {})})
            specs.append(build_speculator(cfg, exporter))
            started.append(specs[-1][0])
        targets = tuple(f"127.0.0.1:{s.port}" for s, _ in specs) + tuple(speculator_addrs)
        server, servicer = build_verifier(VerifierConfig(llm, targets, **{**base, "ssm_dtype": "float32", **verifier}),
                                          exporter)
        started.append(server)
        front = None
        if gateway is not None:
            from services.gateway.config import GatewayConfig
            from services.gateway.server import serve
            from specinfer.serving.metrics import new_registry
            from specinfer.serving.tracing import setup_tracing

            cfg = GatewayConfig(**{"port": 0, "verifier_addr": f"127.0.0.1:{server.port}", "model_dir": llm,
                                   "grace_s": 0, **gateway})
            front = serve(cfg, setup_tracing("specinfer-gateway", None, exporter), new_registry())
    except BaseException:
        for s in reversed(started):
            s.stop(0)
        raise
    return LocalStack(specs, server, servicer, front)


def wait_for_every_tree(monkeypatch) -> None:
    """Every step waits for its speculators' trees up to the step timeout, not a deadline from their
    pace: for tests that compare step counts with the in-process engine's, which a tree late
    under CPU load would change (never the tokens)."""
    from services.verifier import speculators

    monkeypatch.setattr(speculators, "SPECULATOR_DEADLINE_FLOOR_S", float("inf"))


# ---- checkpoints -----------------------------------------------------------------------------------
def save_tiny_llama(
    path: Path,
    *,
    vocab: int = 64,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 64,
    max_pos: int = 256,
    tie: bool = False,
    seed: int = 0,
    init_std: float = 0.3,
    rope_scaling: dict | None = None,
    arch: str = "llama",
    attention_bias: bool = False,
    max_shard_size: str | None = None,
    eos_token_id: int | None = 1,
) -> Path:
    """Saves a random LlamaForCausalLM (or Mistral) as an ordinary HF checkpoint directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=intermediate, max_position_embeddings=max_pos,
        tie_word_embeddings=tie, initializer_range=init_std, bos_token_id=0, eos_token_id=eos_token_id,
        rms_norm_eps=1e-5,
    )
    if arch == "mistral":
        cfg = MistralConfig(**common, sliding_window=None)
        model = MistralForCausalLM(cfg)
    else:
        if rope_scaling is not None:
            common["rope_scaling"] = rope_scaling
        cfg = LlamaConfig(**common, attention_bias=attention_bias)
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # non-trivial norm weights so the norms are really exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    kwargs = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)
    return Path(path)


def perturbed_copy(src: Path, dst: Path, noise: float, seed: int) -> Path:
    """A copy of a checkpoint with Gaussian noise on every weight: an SSM that mostly agrees."""
    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(str(f))
            noisy = {k: (v + noise * v.std() * torch.randn(v.shape, generator=gen)).contiguous() for k, v in tensors.items()}
            save_file(noisy, str(dst / f.name), metadata={"format": "pt"})
        elif f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def add_tokenizer(model_dir: Path, vocab: int, corpus: list[str]) -> None:
    """Trains a small byte-level BPE of exactly `vocab` tokens and saves it next to the model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    assert tok.get_vocab_size() <= vocab, tok.get_vocab_size()
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def save_text_pair(root: Path, vocab: int, corpus: list[str], *, hidden: int, max_pos: int, seed: int,
                   ssm_seed: int, noise: float, eos_token_id: int | None = None) -> tuple[Path, Path]:
    """An LLM with a byte-level BPE tokenizer trained on `corpus` and by default no EOS token
    (generation runs to its token limit; `</s>` is token 1), and a noisy copy of it as its SSM:
    (llm_dir, ssm_dir)."""
    llm = save_tiny_llama(root / "llm", vocab=vocab, hidden=hidden, layers=2, max_pos=max_pos, seed=seed,
                          eos_token_id=eos_token_id)
    add_tokenizer(llm, vocab, corpus)
    return llm, perturbed_copy(llm, root / "ssm", noise=noise, seed=ssm_seed)


def set_config(model_dir: Path, **updates) -> None:
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(updates)
    cfg_path.write_text(json.dumps(cfg))
