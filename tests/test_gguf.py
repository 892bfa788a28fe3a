"""GGUF files as models: `--llm x.gguf` decodes what the same weights decode as a checkpoint
directory; config, tokenizer and chat template come from the file's metadata; K-quant blocks
dequantize to what the block layout says; bad files fail alone with a clear UserError (exit 2).

The GGUF files are written here with gguf-py's writer the way llama.cpp's converter writes a
Llama: its tensor names, q/k rows permuted for ggml's RoPE, norms in F32, the BPE tokenizer as
`tokenizer.ggml.*` metadata. The reference directory holds the same weights after quantizing
and dequantizing (gguf-py's reference quantizers), under Hugging Face names, unpermuted.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from specinfer.cli.main import main
from specinfer.errors import UserError
from util import add_tokenizer, perturbed_copy, save_tiny_llama

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

CORPUS = ["def add(a, b):\n    return a + b\n", "class Foo:\n    pass\n", "for i in range(10):\n    print(i)\n"] * 20
VOCAB = 300
HEADS, KV_HEADS = 4, 2
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")

# llama.cpp's names for a Llama's tensors (written out here, independently of gguf-py's name map)
LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    if hf in TOP_NAMES:
        return TOP_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_NAMES[module]}.{suffix}"


def permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows from halves (HF RoPE) to interleaved pairs (ggml's)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tokenizer_metadata(model_dir: Path) -> dict:
    raw = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = raw["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in raw["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in raw["model"]["merges"]]
    return {"tokens": tokens, "types": [3 if t in special else 1 for t in tokens], "merges": merges}


def write_gguf(path: Path, cfg: dict, tensors: dict[str, tuple[np.ndarray, int]], tok: dict | None,
               arch: str = "llama", extra: dict | None = None) -> Path:
    """A GGUF of `tensors` (GGUF name -> (data, ggml type; quantized data as bytes)) with a Llama
    config and the tokenizer `tok` as llama.cpp writes them."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    if tok is not None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tok["tokens"])
        w.add_token_types(tok["types"])
        w.add_token_merges(tok["merges"])
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
        w.add_unk_token_id(2)
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)
    for key, value in (extra or {}).items():
        w.add_uint32(key, value)
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=Q(qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def encode(w: np.ndarray, kind) -> np.ndarray:
    """What llama.cpp writes for float32 weights `w` as `kind`."""
    if kind == Q.F32:
        return w
    return w.astype(np.float16) if kind == Q.F16 else gguf.quants.quantize(w, kind)


def quantized(hf: dict[str, torch.Tensor], qtype: str, cfg: dict) -> tuple[dict, dict]:
    """(GGUF tensors as llama.cpp writes them, the reference weights they dequantize to)."""
    out, ref = {}, {}
    for name, t in hf.items():
        w = t.float().numpy()
        kind = Q.F32 if w.ndim == 1 else Q[qtype]  # norms stay F32, as llama.cpp keeps them
        ref[name] = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(encode(w, kind), kind)))
        heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}.get(name.split(".")[-2], 0)
        out[gguf_name(name)] = (np.ascontiguousarray(encode(permute(w, heads) if heads else w, kind)), kind)
    return out, ref


def save_reference(hf_dir: Path, ref: dict[str, torch.Tensor], out: Path) -> Path:
    out.mkdir(parents=True)
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (hf_dir / f).is_file():
            shutil.copyfile(hf_dir / f, out / f)
    save_file({k: v.contiguous() for k, v in ref.items()}, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny Llama as GGUF files of every type, each with its reference directory; an SSM
    (a noisy copy) as a checkpoint directory and as a Q8_0 GGUF."""
    root = tmp_path_factory.mktemp("gguf")
    hf_dir = save_tiny_llama(root / "hf", vocab=VOCAB, hidden=64, layers=2, heads=HEADS, kv_heads=KV_HEADS,
                             intermediate=128, max_pos=256, seed=3)
    add_tokenizer(hf_dir, VOCAB, CORPUS)
    ssm_dir = perturbed_copy(hf_dir, root / "ssm-hf", noise=0.05, seed=4)
    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = tokenizer_metadata(hf_dir)
    out = {"root": root, "hf": hf_dir, "cfg": cfg, "tok": tok}
    for qtype in TYPES:
        tensors, ref = quantized(load_file(str(hf_dir / "model.safetensors")), qtype, cfg)
        out[qtype] = (write_gguf(root / f"tiny-{qtype}.gguf", cfg, tensors, tok),
                      save_reference(hf_dir, ref, root / f"ref-{qtype}"))
    tensors, ref = quantized(load_file(str(ssm_dir / "model.safetensors")), "Q8_0", cfg)
    out["ssm"] = (write_gguf(root / "ssm-Q8_0.gguf", cfg, tensors, tok), save_reference(hf_dir, ref, root / "ssm-ref"))
    return out


def generate(capsys, llm, *flags) -> list[list[int]]:
    prompts = ["def add(a", "class Foo", "for i in"]
    outputs = []
    for prompt in prompts:
        code = main(["generate", "--llm", str(llm), "--prompt", prompt, "--max-new-tokens", "16", "--device", "cpu",
                     *map(str, flags)])
        out, err = capsys.readouterr()
        assert code == 0, err
        outputs.append(json.loads(out)["output_token_ids"])
    return outputs


# ---- weights, config, tokenizer --------------------------------------------------------------


@pytest.mark.parametrize("qtype", TYPES)
def test_weights_and_config_equal_the_reference_directory(models, qtype):
    from dataclasses import replace

    from specinfer.engine.models.checkpoint import load_state_dict
    from specinfer.engine.models.config import ModelConfig

    path, ref_dir = models[qtype]
    ours, ref = load_state_dict(path), load_file(str(ref_dir / "model.safetensors"))
    assert set(ours) == set(ref)
    for name in ref:
        assert torch.equal(ours[name].float(), ref[name]), name
    stored = {"F16": "float16", "BF16": "bfloat16"}.get(qtype, "float32")
    gguf_cfg = ModelConfig.from_dir(path)
    assert gguf_cfg.stored_dtype == stored
    ref_cfg = ModelConfig.from_dir(ref_dir)
    assert gguf_cfg.rms_norm_eps == float(np.float32(ref_cfg.rms_norm_eps))  # GGUF stores it as float32
    assert replace(gguf_cfg, stored_dtype="x", rms_norm_eps=0) == replace(ref_cfg, stored_dtype="x", rms_norm_eps=0)
    # dequantized straight to the compute dtype
    assert load_state_dict(path, torch.bfloat16)["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16


def test_tokenizer_and_chat_template_come_from_the_metadata(models):
    from specinfer.chat_template import ChatTemplate
    from specinfer.tokenizer import TextTokenizer

    path, _ = models["Q8_0"]
    ours, theirs = TextTokenizer.from_dir(path), TextTokenizer.from_dir(models["hf"])
    # transformers' byte-level converter adds its default special token where the vocabulary lacks it
    assert theirs.tok.get_vocab().items() <= ours.tok.get_vocab().items()
    for text in CORPUS[:3] + ["def f(x):  return x  # <s> </s>", "naïve ünïcode ✓"]:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
    template = ChatTemplate.from_dir(path)
    assert template.source == CHAT_TEMPLATE and template.bos_token == "<s>" and template.eos_token == "</s>"


# ---- decoding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", TYPES)
def test_greedy_incremental_decodes_what_the_directory_does(models, capsys, qtype):
    path, ref_dir = models[qtype]
    assert generate(capsys, path, "--mode", "incremental") == generate(capsys, ref_dir, "--mode", "incremental")


def test_speculative_with_gguf_llm_and_ssm_decodes_what_the_directories_do(models, capsys):
    llm, llm_ref = models["Q4_1"]
    ssm, ssm_ref = models["ssm"]
    expected = generate(capsys, llm_ref, "--mode", "incremental")
    assert generate(capsys, llm, "--ssm", ssm) == expected  # dynamic trees with the model-free members
    assert generate(capsys, llm, "--ssm", ssm, "--mode", "tree", "--tree-width", "2,2,1") == expected
    assert generate(capsys, llm_ref, "--ssm", ssm_ref, "--mode", "tree", "--tree-width", "2,2,1") == expected


def test_services_serve_gguf_files(models):
    """Gateway (tokenizer and chat template from the GGUF, no torch), verifier and speculator,
    each given a .gguf: the text the in-process engine decodes from the reference directories."""
    from specinfer.engine.llm_engine import Engine, mode_params
    from specinfer.engine.runtime.runner import ModelRunner
    from specinfer.tokenizer import TextTokenizer
    from specinfer.v1 import specinfer_pb2 as pb
    from util import start_stack

    (llm, llm_ref), (ssm, ssm_ref) = models["Q4_1"], models["ssm"]
    engine = Engine.from_runners(ModelRunner.from_dir(llm_ref), [ModelRunner.from_dir(ssm_ref)])
    tokenizer = TextTokenizer.from_dir(llm_ref)
    with start_stack(llm, [ssm], gateway={}, is_load_aware=False) as stack:
        for prompt in ("def add(a, b", "class Foo"):
            resp = stack.gateway_stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=24), timeout=60)
            expected = engine.generate(tokenizer.encode(prompt), mode_params("incremental", 24)).output_ids
            assert list(resp.token_ids) == expected and resp.text == tokenizer.decode(expected)


def test_tensor_parallel_shards_equal_the_directory_s(models):
    from specinfer.engine.models.config import ModelConfig
    from specinfer.engine.runtime.parallel import load_shard

    path, ref_dir = models["Q4_0"]
    cfg = ModelConfig.from_dir(ref_dir)
    for rank in range(2):
        ours, theirs = load_shard(path, cfg, rank, 2), load_shard(ref_dir, cfg, rank, 2)
        assert set(ours) == set(theirs)
        assert all(torch.equal(ours[k].float(), theirs[k].float()) for k in theirs)


def test_make_ssm_from_a_gguf_cuts_what_the_directory_gives(models, tmp_path):
    from specinfer.pool.make_ssm import make_ssm
    from specinfer.tokenizer import TextTokenizer

    path, ref_dir = models["Q8_0"]
    ours, theirs = make_ssm(path, tmp_path / "a", "1", 0.5), make_ssm(ref_dir, tmp_path / "b", "1", 0.5)
    a, b = load_file(str(ours / "model.safetensors")), load_file(str(theirs / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in b)
    assert TextTokenizer.from_dir(ours).encode(CORPUS[0]) == TextTokenizer.from_dir(theirs).encode(CORPUS[0])


def test_boost_tune_of_a_gguf_pool_trains_what_the_directories_train(models, tmp_path):
    from specinfer.pool.boost_data import DataConfig
    from specinfer.pool.boost_tune import BoostConfig, TrainConfig, boost_tune

    corpus = tmp_path / "corpus.py"
    corpus.write_text("".join(CORPUS) * 4)
    data = DataConfig(num_prompts=6, eval_prompts=2, prompt_tokens=16, continuation_tokens=8, kl_top_k=0)
    train = TrainConfig(steps=3, batch_size=2, lr=3e-3, warmup_steps=1, checkpoint_every=2)
    runs = {}
    for kind, (llm, ssm) in {"gguf": (models["Q8_0"][0], models["ssm"][0]),
                             "dir": (models["Q8_0"][1], models["ssm"][1])}.items():
        cfg = BoostConfig(llm=llm, ssms=(ssm,), corpus=(corpus,), out=tmp_path / kind, data=data, train=train)
        runs[kind] = boost_tune(cfg, progress=False)["ssms"][0]
    tuned = {k: load_file(str(Path(r["checkpoint"]) / "model.safetensors")) for k, r in runs.items()}
    assert Path(runs["gguf"]["checkpoint"]).name == "ssm-0-ssm-Q8_0"  # a checkpoint directory named after the file
    assert set(tuned["gguf"]) == set(tuned["dir"])
    assert all(torch.equal(tuned["gguf"][k], tuned["dir"][k]) for k in tuned["dir"])
    assert runs["gguf"]["eval_agreement_after"] == runs["dir"]["eval_agreement_after"]


def test_transformers_model_of_a_gguf_has_the_directory_s_weights(models):
    from specinfer.pool.hf_model import load_hf_model

    path, ref_dir = models["Q4_0"]
    ours, theirs = load_hf_model(path).state_dict(), load_hf_model(ref_dir).state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)


# ---- K-quants: random blocks against the block layout ---------------------------------------------


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32)


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    """ggml's get_scale_min_k4: 6-bit scale and min j of the 12 packed bytes."""
    if j < 4:
        return int(q[j] & 63), int(q[j + 4] & 63)
    return int((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)), int((q[j + 4] >> 4) | ((q[j] >> 6) << 4))


def ref_q4_k(block: np.ndarray) -> np.ndarray:
    """block_q4_K: d (f16), dmin (f16), scales[12], qs[128]; 8 sub-blocks of 32."""
    d, dmin = _f16(block[0:2].view(np.float16))[0], _f16(block[2:4].view(np.float16))[0]
    scales, qs = block[4:16], block[16:144]
    y = np.empty(256, np.float32)
    for j in range(4):  # 64 values per step: low nibbles, then high nibbles of 32 bytes
        sc1, m1 = _scale_min_k4(2 * j, scales)
        sc2, m2 = _scale_min_k4(2 * j + 1, scales)
        q = qs[32 * j:32 * j + 32]
        y[64 * j:64 * j + 32] = np.float32(d * sc1) * (q & 0xF) - np.float32(dmin * m1)
        y[64 * j + 32:64 * j + 64] = np.float32(d * sc2) * (q >> 4) - np.float32(dmin * m2)
    return y


def ref_q5_k(block: np.ndarray) -> np.ndarray:
    """block_q5_K: d, dmin, scales[12], qh[32] (the fifth bits), qs[128]."""
    d, dmin = _f16(block[0:2].view(np.float16))[0], _f16(block[2:4].view(np.float16))[0]
    scales, qh, qs = block[4:16], block[16:48], block[48:176]
    y = np.empty(256, np.float32)
    for j in range(4):
        sc1, m1 = _scale_min_k4(2 * j, scales)
        sc2, m2 = _scale_min_k4(2 * j + 1, scales)
        q = qs[32 * j:32 * j + 32].astype(np.int32)
        high1 = np.where(qh & (1 << (2 * j)), 16, 0)
        high2 = np.where(qh & (1 << (2 * j + 1)), 16, 0)
        y[64 * j:64 * j + 32] = np.float32(d * sc1) * ((q & 0xF) + high1) - np.float32(dmin * m1)
        y[64 * j + 32:64 * j + 64] = np.float32(d * sc2) * ((q >> 4) + high2) - np.float32(dmin * m2)
    return y


def ref_q6_k(block: np.ndarray) -> np.ndarray:
    """block_q6_K: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (int8), d (f16)."""
    ql, qh = block[0:128].astype(np.int32), block[128:192].astype(np.int32)
    sc, d = block[192:208].view(np.int8).astype(np.float32), _f16(block[208:210].view(np.float16))[0]
    y = np.empty(256, np.float32)
    for n in range(2):  # two halves of 128 values: 64 ql bytes, 32 qh bytes, 8 scales each
        lo, hi, s = ql[64 * n:64 * n + 64], qh[32 * n:32 * n + 32], sc[8 * n:8 * n + 8]
        for l in range(32):
            i = l // 16
            q1 = ((lo[l] & 0xF) | (((hi[l] >> 0) & 3) << 4)) - 32
            q2 = ((lo[l + 32] & 0xF) | (((hi[l] >> 2) & 3) << 4)) - 32
            q3 = ((lo[l] >> 4) | (((hi[l] >> 4) & 3) << 4)) - 32
            q4 = ((lo[l + 32] >> 4) | (((hi[l] >> 6) & 3) << 4)) - 32
            y[128 * n + l] = np.float32(d * s[i]) * q1
            y[128 * n + l + 32] = np.float32(d * s[i + 2]) * q2
            y[128 * n + l + 64] = np.float32(d * s[i + 4]) * q3
            y[128 * n + l + 96] = np.float32(d * s[i + 6]) * q4
    return y


K_QUANTS = {"Q4_K": (144, ref_q4_k, (0, 2)), "Q5_K": (176, ref_q5_k, (0, 2)), "Q6_K": (210, ref_q6_k, (208,))}


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes, with finite small f16 scales where the layout has them."""
    size, _, scale_at = K_QUANTS[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
    for at in scale_at:
        blocks[:, at:at + 2] = rng.uniform(0.002, 0.02, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, cols // 256 * size)


def reference_dequantize(qtype: str, data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    size, ref, _ = K_QUANTS[qtype]
    return np.stack([ref(b) for b in data.reshape(-1, size)]).reshape(rows, cols)


@pytest.fixture(scope="module")
def k_quant_model(models, tmp_path_factory):
    """A Llama of hidden size 256 whose matrices are random Q4_K, Q5_K and Q6_K blocks, and its
    reference directory from the block layouts above."""
    root = tmp_path_factory.mktemp("kquant")
    cfg = {"num_hidden_layers": 1, "max_position_embeddings": 128, "hidden_size": 256, "intermediate_size": 256,
           "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-5}
    hf_dir = save_tiny_llama(root / "hf", vocab=VOCAB, hidden=256, layers=1, heads=HEADS, kv_heads=KV_HEADS,
                             intermediate=256, max_pos=128, seed=5)
    shutil.copyfile(models["hf"] / "tokenizer.json", hf_dir / "tokenizer.json")
    shutil.copyfile(models["hf"] / "tokenizer_config.json", hf_dir / "tokenizer_config.json")
    rng = np.random.default_rng(0)
    tensors, ref = {}, {}
    kinds = iter(list(K_QUANTS) * 4)
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        if t.ndim == 1:
            tensors[gguf_name(name)], ref[name] = (t.numpy(), Q.F32), t
            continue
        qtype = next(kinds)
        data = random_blocks(qtype, t.shape[0], t.shape[1], rng)
        tensors[gguf_name(name)] = (data, Q[qtype])
        w = reference_dequantize(qtype, data, t.shape[0], t.shape[1])
        heads = HEADS if "q_proj" in name else KV_HEADS if "k_proj" in name else 0
        ref[name] = torch.from_numpy(unpermute(w, heads) if heads else w)  # the file holds ggml's row order
    path = write_gguf(root / "kquant.gguf", cfg, tensors, models["tok"])
    return path, save_reference(hf_dir, ref, root / "ref")


def test_k_quant_blocks_dequantize_as_their_layout_says(k_quant_model):
    from specinfer.engine.models.checkpoint import load_state_dict

    path, ref_dir = k_quant_model
    ours, ref = load_state_dict(path), load_file(str(ref_dir / "model.safetensors"))
    assert set(ours) == set(ref)
    for name in ref:
        assert torch.allclose(ours[name], ref[name], rtol=1e-6, atol=1e-7), name


def test_k_quant_model_decodes_what_its_reference_does(k_quant_model, capsys):
    path, ref_dir = k_quant_model
    assert generate(capsys, path, "--mode", "incremental") == generate(capsys, ref_dir, "--mode", "incremental")


def logits_of(model_dir, is_coded: bool | None = None) -> torch.Tensor:
    """A pass's float32 logits over a short prompt and a 5-node chain; with `is_coded` set, first
    checks whether the CPU kernel multiplies the model's matrices as block codes, and whether its
    token embedding is looked up from them."""
    from specinfer.engine.layers import cpu_gemm
    from specinfer.engine.layers.embedding import CodedTable
    from specinfer.engine.runtime.runner import ModelRunner, chain_work

    runner = ModelRunner.from_dir(model_dir, "float32", "cpu", 512)
    if is_coded is not None:
        matrices = [w for name, w in runner.model.w.items() if name.endswith((".qkv", ".o", ".gate_up", ".down"))]
        assert all(isinstance(w.data, cpu_gemm.CodePanels) == is_coded for w in matrices)
        assert isinstance(runner.model.w["embed"], CodedTable) == is_coded  # the embedding too: looked up from codes
    seq = runner.new_sequence()
    runner.prefill(seq, [5, 9, 13, 21, 34, 2, 7, 40])
    return runner.run([chain_work(seq, [3, 11, 19, 27, 35], logits="all")])[0]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "K"])
def test_block_coded_weights_give_the_directory_s_logits_bit_for_bit(models, k_quant_model, qtype):
    """The CPU kernel multiplies a GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and K-quant matrices as their codes,
    rebuilding each float32 element in registers: every logit equals the dequantized directory's."""
    from specinfer.engine.layers import cpu_gemm

    if not cpu_gemm.available():
        pytest.skip("the CPU kernel is not built here")
    path, ref_dir = k_quant_model if qtype == "K" else models[qtype]
    assert torch.equal(logits_of(path, is_coded=True), logits_of(ref_dir, is_coded=False))
    if qtype != "K":  # the kernel's narrowest layouts are the ones this checked: 4-bit codes in 4 bits, float16 scales
        from specinfer.engine.runtime.runner import ModelRunner

        runner = ModelRunner.from_dir(path, "float32", "cpu", 512)
        panels = [w.data for name, w in runner.model.w.items() if name.endswith((".qkv", ".o", ".gate_up", ".down"))]
        assert all(p.is_nibbles == (qtype in ("Q4_0", "Q4_1")) for p in panels)
        assert all(p.scales.dtype == torch.float16 for p in panels)


def test_every_coded_tensor_carries_codes_that_define_it(models, k_quant_model):
    from specinfer.engine.models.checkpoint import load_state_dict

    for path in [models[q][0] for q in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")] + [k_quant_model[0]]:
        matrices = {n: t for n, t in load_state_dict(path).items() if t.ndim == 2}
        for name, t in matrices.items():
            assert torch.equal(t.block_codes.values(), t), (path.name, name)


def test_the_k_quant_reference_has_teeth():
    """A block read with another K-quant's layout, or a nibble order swapped, gives other values."""
    rng = np.random.default_rng(1)
    data = random_blocks("Q4_K", 1, 256, rng)
    good = reference_dequantize("Q4_K", data, 1, 256)
    from gguf.quants import dequantize

    assert np.allclose(dequantize(data, Q.Q4_K), good, rtol=1e-6, atol=1e-7)
    swapped = data.copy()
    swapped[0, 16:144] = (swapped[0, 16:144] >> 4) | (swapped[0, 16:144] << 4)
    assert not np.allclose(dequantize(swapped, Q.Q4_K), good)


# ---- the metadata cache ----------------------------------------------------------------------


def test_metadata_is_made_once_and_again_when_the_file_changes(models, tmp_path, monkeypatch):
    from specinfer import model_source

    path = tmp_path / "copy.gguf"
    shutil.copyfile(models["Q8_0"][0], path)
    first = model_source.resolve(path, tmp_path / "cache")
    assert first.meta_dir.parent == tmp_path / "cache" / "gguf" and first.name == "copy"
    assert not any(p.suffix in (".safetensors", ".gguf") for p in first.meta_dir.iterdir())  # never the weights

    def refuse(_):
        raise AssertionError("the metadata was read again")

    monkeypatch.setattr(model_source, "read_gguf", refuse)
    monkeypatch.setattr(model_source, "_resolved", {})  # a new process: only the cache on disk
    assert model_source.resolve(path, tmp_path / "cache").meta_dir == first.meta_dir
    monkeypatch.undo()
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    again = model_source.resolve(path, tmp_path / "cache")
    assert again.meta_dir != first.meta_dir and (again.meta_dir / "config.json").is_file()


# ---- errors ----------------------------------------------------------------------------------------


def run_error(capsys, llm) -> str:
    code = main(["generate", "--llm", str(llm), "--prompt", "x", "--max-new-tokens", "2", "--device", "cpu"])
    _, err = capsys.readouterr()
    assert code == 2, err
    assert err.startswith("specinfer: error:") and len(err.strip().splitlines()) == 1, err
    return err


def test_unsupported_architecture_is_a_clear_error(models, capsys, tmp_path):
    tensors, _ = quantized(load_file(str(models["hf"] / "model.safetensors")), "F32", models["cfg"])
    path = write_gguf(tmp_path / "gpt2.gguf", models["cfg"], tensors, models["tok"], arch="gpt2")
    err = run_error(capsys, path)
    assert "'gpt2'" in err and "llama" in err and "gemma3" in err


def test_unsupported_tensor_type_is_a_clear_error(models, capsys, tmp_path):
    from specinfer.engine.models.config import ModelConfig

    tensors, _ = quantized(load_file(str(models["hf"] / "model.safetensors")), "F32", models["cfg"])
    name = "blk.0.ffn_up.weight"
    tensors[name] = (tensors[name][0].astype(np.int32), Q.I32)
    err = run_error(capsys, write_gguf(tmp_path / "i32.gguf", models["cfg"], tensors, models["tok"]))
    assert name in err and "I32" in err and "Q4_K" in err
    with pytest.raises(UserError, match="I32"):  # before any weights load
        ModelConfig.from_dir(tmp_path / "i32.gguf")


@pytest.mark.parametrize("case", ["missing", "not gguf", "safetensors file", "no config", "shard", "split metadata"])
def test_bad_model_paths_say_what_is_supported(models, capsys, tmp_path, case):
    if case == "missing":
        path, expected = tmp_path / "nope.gguf", "not found"
    elif case == "not gguf":
        path, expected = tmp_path / "model.gguf", "not a GGUF file"
        path.write_bytes(b"PK\x03\x04" + bytes(100))
    elif case == "safetensors file":
        path, expected = models["hf"] / "model.safetensors", "give its directory"
    elif case == "no config":
        path, expected = tmp_path / "dir", "no config.json"
        path.mkdir()
        shutil.copyfile(models["Q8_0"][0], path / "m.gguf")
    elif case == "shard":
        path, expected = tmp_path / "m-00001-of-00002.gguf", "merge"
        shutil.copyfile(models["Q8_0"][0], path)
    else:
        tensors, _ = quantized(load_file(str(models["hf"] / "model.safetensors")), "F32", models["cfg"])
        path, expected = tmp_path / "split.gguf", "split into 3 files"
        write_gguf(path, models["cfg"], tensors, models["tok"], extra={"split.count": 3})
    err = run_error(capsys, path)
    assert expected in err
    if case in ("missing", "not gguf", "no config"):
        assert ".gguf" in err and "config.json" in err


# ---- the other families: config and weights as transformers defines them ------------------------


def family_model(arch: str):
    """A tiny transformers model of the family (random weights, non-trivial norms)."""
    import transformers

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=64, max_position_embeddings=128, rms_norm_eps=1e-6)
    configs = {
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "query_pre_attn_scalar": 16,
                                                             "sliding_window": 8}),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0, "partial_rotary_factor": 0.5}),
    }
    config_cls, model_cls, extra = configs[arch]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**common, **extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.1 * torch.randn_like(p))
    return model


def llama_cpp_gguf(model, arch: str, path: Path) -> Path:
    """The model as llama.cpp's converter writes it (F32; Gemma's norms stored plus one)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    name_map = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                        cfg.num_hidden_layers)
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, suffix = name.rsplit(".", 1)
        w = t.float().numpy() + (1.0 if arch == "gemma3" and "norm" in name else 0.0)
        tensors[f"{name_map.get_name(base)}.{suffix}"] = (np.ascontiguousarray(w, dtype=np.float32), Q.F32)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if arch in ("qwen3", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
    if arch == "phi3":
        w.add_rope_dimension_count(int(head_dim * cfg.partial_rotary_factor))
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3", "phi3"])
def test_family_config_and_weights_are_transformers_own(arch, tmp_path):
    from specinfer.engine.models.checkpoint import load_state_dict
    from specinfer.model_source import resolve

    model = family_model(arch)
    path = llama_cpp_gguf(model, arch, tmp_path / f"{arch}.gguf")
    ours = json.loads(resolve(path, tmp_path / "cache").config_file.read_text())
    theirs = model.config.to_dict()
    assert ours["architectures"] == [type(model).__name__] and ours["model_type"] == theirs["model_type"]
    for key, value in ours.items():
        if key in ("architectures", "dtype"):
            continue
        assert key in theirs, key
        assert value == (pytest.approx(theirs[key], rel=1e-6) if isinstance(value, float) else theirs[key]), key
    weights, expected = load_state_dict(path), model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert set(weights) == set(expected)
    for name, value in expected.items():  # Gemma's norms: (w + 1) - 1 in float32, as transformers computes it
        assert torch.allclose(weights[name], value, atol=1e-7, rtol=0), name
    if arch == "gemma3":
        assert ours["layer_types"].count("full_attention") == 1 and ours["layer_types"][5] == "full_attention"


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "F16", "K"])
def test_the_memory_plan_counts_a_gguf_s_weights_as_they_load(models, k_quant_model, qtype):
    """The KV cache's budget counts a GGUF's weights as the loaded model holds them: block codes
    stay codes on a CPU (a fraction of float32's bytes), so the estimate is what the model holds
    (within the panels' padding) or a little above; 16-bit matrices at 16 bits."""
    from specinfer.engine.layers import cpu_gemm
    from specinfer.engine.layers.embedding import CodedTable
    from specinfer.engine.runtime.memory import num_parameters, weight_bytes
    from specinfer.engine.models.config import ModelConfig
    from specinfer.engine.runtime.runner import ModelRunner

    if not cpu_gemm.available():
        pytest.skip("the CPU kernel is not built here")
    path = k_quant_model[0] if qtype == "K" else models[qtype][0]
    held = 0
    for t in {id(t): t for t in ModelRunner.from_dir(path, "float32", "cpu", 64).model.w.values()}.values():
        held += t.nbytes() if isinstance(t, CodedTable) else t.numel() * t.element_size()  # a tensor or panels
    estimate = weight_bytes(path, "float32")
    float32 = num_parameters(ModelConfig.from_dir(path)) * 4
    assert 0.99 * held <= estimate <= 1.25 * held
    assert estimate < (0.7 if qtype == "F16" else 0.45) * float32


# ---- loading a weight at a time ------------------------------------------------------------------


def _reads_alive(monkeypatch, handle_cls) -> tuple[list, list[int]]:
    """Records every matrix `handle_cls.get_tensor` returns (weakly), and before each read how
    many of the matrices read so far are still alive in their read form."""
    import weakref

    reads, counts = [], []
    original = handle_cls.get_tensor

    def get_tensor(self, name):
        counts.append(sum(1 for r in reads if r() is not None))
        t = original(self, name)
        if t.ndim == 2:
            reads.append(weakref.ref(t))
        return t

    monkeypatch.setattr(handle_cls, "get_tensor", get_tensor)
    return reads, counts


@pytest.mark.parametrize("kind", ["Q4_1", "K", "tied directory"])
def test_a_model_loads_holding_one_matrix_at_a_time_in_its_read_form(models, k_quant_model, tmp_path,
                                                                     monkeypatch, kind):
    """`ModelRunner.from_dir` lays each weight out before it reads the next: while it loads, at
    most the embedding and two parts of a fused matrix are alive as read (a GGUF's dequantized
    float32), and once loaded none is but those the model holds as they are. Reading the whole
    state dict first (as before) keeps them all, which this measure sees."""
    from specinfer.engine.models.checkpoint import SafetensorsFile, engine_weights, load_state_dict
    from specinfer.engine.models.config import ModelConfig
    from specinfer.engine.models.gguf import GGUFTensors
    from specinfer.engine.runtime.runner import ModelRunner

    if kind == "tied directory":
        path, handle_cls = save_tiny_llama(tmp_path / "tied", vocab=VOCAB, hidden=64, layers=3, tie=True, seed=5), \
            SafetensorsFile
    else:
        path, handle_cls = (k_quant_model[0] if kind == "K" else models[kind][0]), GGUFTensors
    reads, counts = _reads_alive(monkeypatch, handle_cls)
    runner = ModelRunner.from_dir(path, "float32", "cpu", 64)
    held = {id(t) for t in runner.model.w.values()}
    assert len(reads) > 6 and max(counts) <= 3, counts
    assert all(r() is None or id(r()) in held for r in reads)

    reads.clear(), counts.clear()
    ModelRunner.from_weights(ModelConfig.from_dir(path), engine_weights(ModelConfig.from_dir(path),
                                                                        load_state_dict(path)), "float32", "cpu", 64)
    assert max(counts) > 6  # the measure's teeth: a whole state dict read first holds every matrix


def test_read_and_checked_in_chunks_the_weights_are_the_same(models, k_quant_model, monkeypatch):
    """Block types are dequantized, their codes taken, and `pack`'s check of the codes run a few
    rows at a time; with chunks of one row each the tensors, their codes and the logits are
    bitwise what whole tensors give, and a code wrong in the last row is still caught."""
    from specinfer.engine.layers import cpu_gemm, linear
    from specinfer.engine.models.checkpoint import load_state_dict

    paths = [models[q][0] for q in ("Q4_0", "Q4_1", "Q5_1", "Q8_0")] + [k_quant_model[0]]
    whole = {p: load_state_dict(p) for p in paths}
    logits = {p: logits_of(p) for p in paths}
    monkeypatch.setattr(cpu_gemm, "CHUNK_ELEMENTS", 1)
    for p in paths:
        chunked = load_state_dict(p)
        for name, t in whole[p].items():
            assert torch.equal(chunked[name], t), (p.name, name)
            if t.ndim == 2:
                a, b = chunked[name].block_codes, t.block_codes
                assert a.block == b.block and all(torch.equal(getattr(a, f), getattr(b, f))
                                                  for f in ("codes", "scales", "offsets")), (p.name, name)
        assert torch.equal(logits_of(p), logits[p])
    weight = whole[paths[0]]["model.layers.0.mlp.down_proj.weight"]
    codes = weight.block_codes
    assert linear._defines(codes, weight)
    wrong = codes.codes.clone()
    wrong[-1, -1] += 1
    assert not linear._defines(cpu_gemm.BlockCodes(wrong, codes.scales, codes.offsets, codes.block), weight)
