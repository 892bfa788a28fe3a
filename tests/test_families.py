"""Every supported model family decodes exactly what transformers does (float32, greedy).

Tiny random checkpoints built with transformers' own config classes: Llama, Mistral (a window
shorter than the prompt), Qwen2 (windowed layers from `max_window_layers`), Qwen3 (explicit
head_dim, biases, q/k norms, windows), Gemma 3 (local and global layers, a window shorter than
prompt + output, per-type RoPE with linear scaling on the global layers, soft-capped logits, a
config without `architectures`), Phi-3 (fused projections, partial rotary, a window; LongRoPE
within its original context). Each one: prefill logits, plain decoding against `generate`,
speculative decoding in the default mode (dynamic trees of an SSM cut by make-ssm plus the
model-free members) and static trees, batched, with prefix-cache hits; make-ssm; the Triton
kernel (interpreter) with windows; tensor parallelism for Gemma 3 and Phi-3.
"""

from __future__ import annotations

import json
import os

from specinfer.engine.kernels import use_interpreter

if os.environ.get("TRITON_INTERPRET") != "0":
    use_interpreter()  # before anything imports triton

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specinfer.engine.drafting.speculator import model_free_member
from specinfer.engine.drafting.tree import window_starts
from specinfer.engine.llm_engine import Engine, EngineConfig, mode_params
from specinfer.engine.models.config import ModelConfig
from specinfer.engine.runtime.assemble import load_runner
from specinfer.engine.runtime.parallel import ParallelConfig
from specinfer.engine.runtime.runner import ModelRunner, Work, chain_work
from specinfer.errors import UserError
from specinfer.params import TreeBudget, TreeShape
from specinfer.pool.make_ssm import make_ssm
from policies import FixedBudget
from util import add_tokenizer

VOCAB = 320  # a byte-level BPE needs its 256 bytes plus merges
NEW_TOKENS = 24
PROMPTS = [[(7 * i + 3) % 300 + 5 for i in range(22)], [40, 41, 42, 43] * 6 + [9], [200 + i % 13 for i in range(30)]]
SHARED = [(11 * i + 5) % 290 + 7 for i in range(36)]  # a prefix longer than every window
CORPUS = ["def add(a, b):\n    return a + b\n", "import os\nimport sys\n", "for x in range(3):\n    print(x)\n"] * 30
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, max_position_embeddings=256, initializer_range=0.3, bos_token_id=0,
              eos_token_id=None, pad_token_id=0, rms_norm_eps=1e-5)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**COMMON, attention_bias=True))


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**COMMON, sliding_window=6))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=7, max_window_layers=1))


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=24, attention_bias=True, use_sliding_window=True,
                                        sliding_window=8, max_window_layers=2))


GEMMA_WINDOW = 5


def _gemma3(window: int = GEMMA_WINDOW):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}
    cfg = Gemma3TextConfig(**COMMON, head_dim=32, query_pre_attn_scalar=20, sliding_window=window,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
                           rope_parameters=rope, final_logit_softcapping=5.0, tie_word_embeddings=True)
    return Gemma3ForCausalLM(cfg)


def _phi3():
    from transformers import Phi3Config, Phi3ForCausalLM

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    return Phi3ForCausalLM(Phi3Config(**COMMON, rope_parameters=rope, sliding_window=9))


def _phi3_longrope():
    from transformers import Phi3Config, Phi3ForCausalLM

    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.3, 2.1, 3.0], "long_factor": [1.5, 3.0, 7.0, 11.0]}
    return Phi3ForCausalLM(Phi3Config(**{**COMMON, "max_position_embeddings": 256}, rope_parameters=rope,
                                      original_max_position_embeddings=64))


BUILDERS = {"llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3, "gemma3": _gemma3,
            "phi3": _phi3, "phi3-longrope": _phi3_longrope}
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"]


def save_family(path: Path, build, seed: int) -> Path:
    """A random checkpoint with non-trivial norms and biases, and a BPE tokenizer."""
    torch.manual_seed(seed)
    model = build()
    is_gemma = "Gemma3" in type(model).__name__
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma scales by (1 + w): centred on 0 there, on 1 elsewhere
                p.copy_((0.0 if is_gemma else 1.0) + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif is_gemma and "embed_tokens" in name:  # scaled by sqrt(hidden) and tied: kept small, the
                p.copy_(0.03 * torch.randn_like(p))  # layers (not the input token) decide the output
    model.save_pretrained(path, safe_serialization=True)
    add_tokenizer(path, VOCAB, CORPUS)
    if is_gemma:  # as real Gemma 3 text checkpoints ship: model_type gemma3_text, no architectures
        raw = json.loads((path / "config.json").read_text())
        raw.pop("architectures", None)
        (path / "config.json").write_text(json.dumps(raw))
    return path


@dataclass
class Fam:
    name: str
    llm: Path
    ssm: Path

    @property
    def window(self) -> int | None:
        return ModelConfig.from_dir(self.llm).attention_window


@pytest.fixture(scope="module")
def fams(tmp_path_factory) -> dict[str, Fam]:
    root = tmp_path_factory.mktemp("families")
    out = {}
    for seed, (name, build) in enumerate(BUILDERS.items()):
        llm = save_family(root / name, build, seed)
        out[name] = Fam(name, llm, make_ssm(llm, root / f"{name}-ssm", "0,2", mlp_keep=0.5))
    return out


_HF: dict = {}


def hf_model(path: Path):
    if path not in _HF:
        _HF[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF[path]


def hf_generate(path: Path, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = hf_model(path).generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


def runner(path: Path, **kwargs) -> ModelRunner:
    return ModelRunner.from_dir(path, max_kv_tokens=kwargs.pop("max_kv_tokens", 2048), block_size=8, **kwargs)


# On a CPU the engine attends through its own kernel (`cpu_gemm.attention`): the same softmax
# attention summed in another order, so its logits stand a few float32 roundings further from
# transformers' (SDPA's) than the 1e-5 the rest of the forward keeps (at most 2.3e-5 measured on
# these models). The forward is held to 1e-5 with SDPA, and the kernel's to this.
KERNEL_ATTENTION_ATOL = 5e-5


def sdpa_runner(path: Path) -> ModelRunner:
    r = runner(path)
    r.model.is_kernel_attention = False
    return r


def dynamic_engine(fam: Fam, **kwargs) -> Engine:
    engine = Engine.from_runners(runner(fam.llm, **kwargs), [runner(fam.ssm, **kwargs)],
                                 model_free=[model_free_member("lookup"), model_free_member("suffix")])
    engine.load_policy = FixedBudget(TreeBudget(max_nodes=16, max_depth=8, node_cost=0.002, level_cost=0.01))
    return engine


# ---- config and registry -------------------------------------------------------------------------


def test_each_family_parses_as_transformers_builds_it(fams):
    cfgs = {name: ModelConfig.from_dir(f.llm) for name, f in fams.items()}
    assert {n: c.family for n, c in cfgs.items()} == {"llama": "llama", "mistral": "llama", "qwen2": "qwen2",
                                                      "qwen3": "qwen3", "gemma3": "gemma3", "phi3": "phi3",
                                                      "phi3-longrope": "phi3"}
    g = cfgs["gemma3"]
    assert g.architecture == "Gemma3ForCausalLM"  # from model_type gemma3_text alone
    assert g.layer_types == ("sliding_attention", "full_attention", "sliding_attention", "sliding_attention")
    assert (g.rope.rope_type, g.rope.factor, g.rope.theta, g.local_rope.theta) == ("linear", 2.0, 50000.0, 1000.0)
    assert g.attention_scale == 20 ** -0.5 and g.embed_scale == 64 ** 0.5 and g.final_logit_softcapping == 5.0
    assert cfgs["mistral"].layer_types == ("sliding_attention",) * 4 and cfgs["mistral"].sliding_window == 6
    assert cfgs["qwen2"].layer_types == ("full_attention",) + ("sliding_attention",) * 3
    assert cfgs["qwen3"].head_dim == 24 and cfgs["qwen3"].is_qk_norm and cfgs["qwen3"].attention_bias
    assert cfgs["phi3"].rotary_dim == 8 and cfgs["phi3"].attention_window == 9
    assert cfgs["llama"].attention_window is None and cfgs["llama"].max_context == 256
    assert cfgs["phi3-longrope"].max_context == 64  # LongRoPE runs exactly within its original context


def test_unknown_architectures_are_refused_naming_the_supported_ones():
    raw = {"architectures": ["GPT2LMHeadModel"], "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2}
    with pytest.raises(UserError, match=r"GPT2LMHeadModel.*Llama 1/2/3.*SmolLM.*TinyLlama.*Mistral.*Qwen2\.5.*"
                                        r"Qwen3.*Gemma 3.*Phi-3"):
        ModelConfig.from_dict(raw)
    with pytest.raises(UserError, match="model_type 'gpt2'"):
        ModelConfig.from_dict({**raw, "architectures": None, "model_type": "gpt2"})
    with pytest.raises(UserError, match="auto_map"):
        ModelConfig.from_dict({**raw, "architectures": ["Qwen2ForCausalLM"], "auto_map": {"AutoModel": "m.X"}})
    gemma = {**raw, "architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": 50.0}
    with pytest.raises(UserError, match="attn_logit_softcapping"):
        ModelConfig.from_dict(gemma)


def test_window_starts_follow_positions_into_the_tree():
    # A chain after 10 committed tokens, window 4: token at position p sees keys p-3..p.
    assert window_starts([-1, 0, 1], 3, 10, [10, 11, 12], 4) == [7, 8, 9]
    # A tree: nodes 0 (depth 0), 1 and 2 (children of 0), 3 (child of 2); window 2 starts at the parent.
    assert window_starts([-1, 0, 0, 2], 4, 5, [5, 6, 6, 7], 2) == [4, 5, 5, 7]
    assert window_starts([-1, 0], 2, 0, [0, 1], 8) == [0, 0]


# ---- exactness ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES + ["phi3-longrope"])
def test_prefill_logits_and_hidden_states_match_transformers(fams, name):
    fam = fams[name]
    prompt = PROMPTS[2]  # longer than every window
    with torch.no_grad():
        out = hf_model(fam.llm)(torch.tensor([prompt]), output_hidden_states=True)
        last_hidden = hf_model(fam.llm).model(torch.tensor([prompt])).last_hidden_state[0]
    for r, atol in ((sdpa_runner(fam.llm), 1e-5), (runner(fam.llm), KERNEL_ATTENTION_ATOL)):
        seq = r.new_sequence()
        batch, _ = r.prepare([chain_work(seq, prompt, "all")])
        if fam.window:
            assert batch.window_seqs is not batch.seqs and batch.window_starts[-1] == len(prompt) - fam.window
        logits, hidden = r.model.forward(batch, r.kv, return_hidden=True)
        torch.testing.assert_close(logits, out.logits[0].float(), rtol=1e-5, atol=atol)
        torch.testing.assert_close(hidden, last_hidden, rtol=1e-5, atol=atol)
        assert torch.equal(r.model.forward(batch, r.kv), logits)  # the default path returns the same logits


@pytest.mark.parametrize("name", FAMILIES + ["phi3-longrope"])
def test_incremental_greedy_equals_transformers_generate(fams, name):
    fam = fams[name]
    engine = Engine.from_runners(runner(fam.llm))
    for prompt in PROMPTS:
        assert engine.generate(prompt, mode_params("incremental", NEW_TOKENS)).output_ids == hf_generate(fam.llm, prompt)


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_the_window_is_exact_not_off_by_one(fams, tmp_path, name):
    """transformers' window (q - k < window) decodes differently from one a token wider or
    narrower on these prompts, so the equality above pins the window down exactly."""
    fam = fams[name]
    expected = [hf_generate(fam.llm, p) for p in PROMPTS]
    raw = json.loads((fam.llm / "config.json").read_text())
    for delta in (-1, 1):
        other = tmp_path / f"w{delta}"
        other.mkdir()
        for f in fam.llm.iterdir():
            (other / f.name).write_bytes(f.read_bytes())
        (other / "config.json").write_text(json.dumps({**raw, "sliding_window": raw["sliding_window"] + delta}))
        assert [hf_generate(other, p) for p in PROMPTS] != expected
        ours = Engine.from_runners(runner(other))
        assert [ours.generate(p, mode_params("incremental", NEW_TOKENS)).output_ids for p in PROMPTS] != expected


@pytest.mark.parametrize("name", FAMILIES)
def test_speculative_batched_and_prefix_cached_equal_transformers(fams, name):
    """Dynamic trees (the default mode's: a make-ssm cut plus the model-free members) and static
    trees; requests batched; later requests reusing a cached prefix longer than the window."""
    fam = fams[name]
    prompts = [SHARED + p[:6] for p in PROMPTS]
    expected = [hf_generate(fam.llm, p) for p in prompts]
    engine = dynamic_engine(fam)
    first = engine.generate(prompts[0], mode_params("auto", NEW_TOKENS))
    later = [engine.start(p, mode_params("auto", NEW_TOKENS)) for p in prompts[1:]]
    assert all(g.session.num_reused >= 32 for g in later)
    results = [first] + engine.generate_batch(later)
    assert [r.output_ids for r in results] == expected
    assert sum(sum(r.accepted_per_step) for r in results) > 0  # drafts were accepted
    assert max(r.tree_nodes_per_step[i] for r in results for i in range(len(r.tree_nodes_per_step))) > 4
    static = Engine.from_runners(runner(fam.llm), [runner(fam.ssm)], model_free=[model_free_member("lookup")])
    reqs = [static.start(p, mode_params("tree", NEW_TOKENS, TreeShape((2, 2, 1, 1, 1, 1, 1)))) for p in prompts]
    assert [r.output_ids for r in static.generate_batch(reqs)] == expected
    assert engine.verifier.runner.allocator.num_used == 0


def test_trees_deeper_than_the_window_stay_exact(fams):
    """Mistral's window (6) is shorter than the accepted paths: a tree node's window then starts
    at one of its own ancestors. The LLM drafts for itself here, so whole paths are accepted."""
    fam = fams["mistral"]
    engine = Engine.from_runners(runner(fam.llm), [runner(fam.llm)])
    for prompt in PROMPTS:
        r = engine.generate(prompt, mode_params("tree", 40, TreeShape((2, 1, 1, 1, 1, 1, 1, 1))))
        assert r.output_ids == hf_generate(fam.llm, prompt, 40)
        assert max(r.accepted_per_step) >= fam.window


def test_longrope_refuses_what_it_cannot_run_exactly(fams):
    r = runner(fams["phi3-longrope"].llm)
    with pytest.raises(UserError, match="context of 64"):
        r.prefill(r.new_sequence(), list(range(5, 70)))


def test_bfloat16_gemma3_computes_as_transformers_does_in_bfloat16(fams):
    """Gemma's norms in float32 with (1 + w), the embedding scale rounded to the model's dtype."""
    fam = fams["gemma3"]
    r = runner(fam.llm, dtype="bfloat16")
    ours = r.run([chain_work(r.new_sequence(), PROMPTS[2], "all")])[0]
    hf = AutoModelForCausalLM.from_pretrained(fam.llm, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[2]])).logits[0].float()
    torch.testing.assert_close(ours, ref, rtol=1e-2, atol=1e-2)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_offloaded_and_auto_dtype_paths_take_the_families(fams, tmp_path, monkeypatch):
    """Offloading (its CPU bookkeeping mode) streams Gemma's per-type RoPE and embedding scale
    along; the SSM's dtype is measured and cached per family. The passes are timed by a steady
    fake clock and the load average is read as idle: a choice measured on a busy machine is
    rightly not cached, and that must not depend on what else the test machine runs."""
    from specinfer.engine.runtime import dtype_choice as dc
    from specinfer.engine.runtime.offload import StreamedWeights, offload_model

    monkeypatch.setattr(dc.machine_cache, "is_loaded", lambda *a, **k: False)
    steady = {"float32": 0.002, "bfloat16": 0.003}

    fam = fams["gemma3"]
    resident, streamed = runner(fam.llm), runner(fam.llm)
    assert isinstance(offload_model(streamed.model, "cpu").w, StreamedWeights)
    outs = [r.run([chain_work(r.new_sequence(), PROMPTS[0], "all")])[0] for r in (resident, streamed)]
    assert torch.equal(outs[0], outs[1])
    def timer(runner, work):
        runner.run([work])  # each candidate still runs its passes
        return steady[str(runner.model.dtype).removeprefix("torch.")]

    ssm = dc.load_ssm(fams["phi3"].ssm, "auto", "cpu", 512, cache_dir=tmp_path, timer=timer)
    (entry,) = json.loads((tmp_path / dc.CACHE_FILE).read_text()).values()
    assert entry["key"]["model"]["family"] == "phi3" and ssm.dtype_choice.dtype == entry["dtype"] == "float32"
    assert dc.load_ssm(fams["phi3"].ssm, "auto", "cpu", 512, cache_dir=tmp_path, timer=timer).dtype_choice.is_cached


# ---- make-ssm -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_make_ssm_cuts_every_family(fams, name):
    fam = fams[name]
    llm_cfg, ssm_cfg = ModelConfig.from_dir(fam.llm), ModelConfig.from_dir(fam.ssm)
    assert ssm_cfg.layer_types == (llm_cfg.layer_types[0], llm_cfg.layer_types[2])
    assert ssm_cfg.num_layers == 2 and ssm_cfg.intermediate_size == 64 and ssm_cfg.family == llm_cfg.family
    prompt = PROMPTS[2]
    with torch.no_grad():
        ref = hf_model(fam.ssm)(torch.tensor([prompt])).logits[0].float()
    for r, atol in ((sdpa_runner(fam.ssm), 1e-5), (runner(fam.ssm), KERNEL_ATTENTION_ATOL)):
        ours = r.run([chain_work(r.new_sequence(), prompt, "all")])[0]
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=atol)


def test_make_ssm_prunes_fused_gate_up_channels(fams):
    """Phi-3's fused gate_up_proj: the cut equals the LLM with the other layers deleted and the
    dropped channels of gate (and so of the product) zeroed."""
    from safetensors.torch import load_file

    fam = fams["phi3"]
    cut = load_file(str(fam.ssm / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(fam.llm, dtype=torch.float32).eval()
    kept = [hf.model.layers[0], hf.model.layers[2]]
    with torch.no_grad():
        for new, layer in enumerate(kept):
            gate_up = layer.mlp.gate_up_proj.weight
            rows = cut[f"model.layers.{new}.mlp.gate_up_proj.weight"]
            keep = [c for c in range(128) if any(torch.equal(gate_up[c], row) for row in rows[:64])]
            assert len(keep) == 64 and torch.equal(rows[64:], gate_up[[128 + c for c in keep]])
            drop = torch.ones(128, dtype=torch.bool)
            drop[keep] = False
            gate_up[:128][drop] = 0.0
    hf.model.layers = torch.nn.ModuleList(kept)
    hf.config.num_hidden_layers = 2
    prompt = PROMPTS[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt]), use_cache=False).logits[0]
    r = runner(fam.ssm)
    torch.testing.assert_close(r.run([chain_work(r.new_sequence(), prompt, "all")])[0], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_boost_tune_trains_every_family(fams, tmp_path, name):
    """boost-tune trains the cut SSM with transformers; the tuned checkpoint it saves is read by
    the engine exactly as transformers reads it."""
    from specinfer.pool.boost_data import DataConfig
    from specinfer.pool.boost_tune import BoostConfig, TrainConfig, boost_tune

    fam = fams[name]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(CORPUS))
    data = DataConfig(num_prompts=4, eval_prompts=2, prompt_tokens=16, continuation_tokens=8, gen_batch_size=4)
    train = TrainConfig(steps=2, batch_size=2, lr=1e-2, warmup_steps=1, checkpoint_every=2)
    summary = boost_tune(BoostConfig(fam.llm, (fam.ssm,), (corpus,), tmp_path / "out", data, train), progress=False)
    tuned = tmp_path / "out" / summary["ssms"][0]["name"]
    assert ModelConfig.from_dir(tuned).layer_types == ModelConfig.from_dir(fam.ssm).layer_types
    prompt = PROMPTS[2]
    r = runner(tuned)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(tuned, dtype=torch.float32).eval()(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(r.run([chain_work(r.new_sequence(), prompt, "all")])[0], ref, rtol=1e-5, atol=1e-5)


# ---- Triton kernel (interpreter on CPU) -------------------------------------------------------------


@pytest.mark.parametrize("name", ["gemma3", "mistral"])
def test_triton_windowed_tree_attention_matches_sdpa(fams, name):
    triton = pytest.importorskip("triton")  # noqa: F841
    from specinfer.engine.kernels import enable_triton

    fam = fams[name]
    reference, fast = runner(fam.llm), runner(fam.llm)
    backend = enable_triton(fast)
    prompt = PROMPTS[0][:13]
    parents = [-1, 0, 1, 1, 3, 4, 5, 6, 2]  # depth 8 > window: windows start inside the tree
    depths = [0, 1, 2, 2, 3, 4, 5, 6, 3]
    outs = []
    for r in (reference, fast):
        seq = r.new_sequence()
        r.prefill(seq, prompt)
        work = Work(seq, [60 + i for i in range(9)], [len(prompt) + d for d in depths], parents, "all")
        outs.append(r.run([work, chain_work(r.new_sequence(), PROMPTS[1], "all")]))
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert backend.num_builds == 2  # prefill, then the tree: one build per step for both layer types


def test_graph_runner_static_path_windows_like_sdpa(fams):
    """The CUDA-graph runner's static buffers (run eagerly on CPU) carry each row's window start."""
    pytest.importorskip("triton")
    from specinfer.engine.kernels import enable_triton
    from specinfer.engine.kernels.cuda_graphs import GraphRunner

    fam = fams["mistral"]
    reference, fast = runner(fam.llm), runner(fam.llm)
    enable_triton(fast)
    graphs = GraphRunner(fast, batch_sizes=(1, 4), tree_sizes=(1, 16), max_context=64, capture=False)
    parents = [[-1, 0, 1, 1, 3, 4, 5, 6, 7], [-1]]
    depths = [[0, 1, 2, 2, 3, 4, 5, 6, 7], [0]]
    outs = []
    for r, run in ((reference, reference.run), (fast, graphs.run)):
        seqs = [r.new_sequence() for _ in parents]
        for s, prompt in zip(seqs, PROMPTS):
            r.prefill(s, prompt)
        works = [Work(s, [60 + i for i in range(len(p))], [s.num_committed + d for d in ds], p, "all")
                 for s, p, ds in zip(seqs, parents, depths)]
        outs.append(run(works))
    assert graphs.num_replays == 1 and graphs.num_fallbacks == 0
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    graphs.close()


def test_triton_engine_decodes_gemma3_as_transformers(fams):
    pytest.importorskip("triton")
    fam = fams["gemma3"]
    engine = dynamic_engine(fam, exec_cfg=_triton_exec())
    prompt = PROMPTS[1]
    assert engine.generate(prompt, mode_params("auto", 12)).output_ids == hf_generate(fam.llm, prompt, 12)


def _triton_exec():
    from specinfer.engine.runtime.exec_config import ExecConfig

    return ExecConfig(attention="triton", cuda_graphs=False)


# ---- tensor parallelism ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_two_ranks_decode_what_transformers_does(fams, name):
    """Fused Phi-3 tensors, Gemma's q/k norms and post-norms, windows: sharded over two ranks."""
    fam = fams[name]
    prompts = [SHARED + p[:6] for p in PROMPTS]
    expected = [hf_generate(fam.llm, p) for p in prompts]
    sharded = load_runner(fam.llm, max_kv_tokens=2048, block_size=8, parallel=ParallelConfig.spawned(2))
    try:
        engine = Engine.from_runners(sharded, [runner(fam.ssm)], EngineConfig(),
                                     model_free=[model_free_member("lookup")])
        engine.load_policy = FixedBudget(TreeBudget(max_nodes=12, max_depth=6, node_cost=0.002, level_cost=0.01))
        first = engine.generate(prompts[0], mode_params("auto", NEW_TOKENS))
        later = [engine.start(p, mode_params("auto", NEW_TOKENS)) for p in prompts[1:]]
        assert all(g.session.num_reused >= 32 for g in later)
        assert [first.output_ids] + [r.output_ids for r in engine.generate_batch(later)] == expected
        inc = mode_params("incremental", NEW_TOKENS)
        assert engine.generate(PROMPTS[2], inc).output_ids == hf_generate(fam.llm, PROMPTS[2])
    finally:
        sharded.close()
