"""The runner's logits equal transformers' on the same checkpoint: prefill, decode, tree step."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specinfer.engine.runtime.runner import ModelRunner, Work, chain_work
from specinfer.engine.drafting.tree import TokenTree
from util import save_tiny_llama

VARIANTS = {
    "llama-gqa": dict(),
    "mha-tied": dict(heads=4, kv_heads=4, tie=True),
    "mqa": dict(heads=4, kv_heads=1),
    "llama3-rope": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "linear-rope": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "yarn-rope": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "attention-bias": dict(attention_bias=True),
    "sharded": dict(max_shard_size="20KB"),
    "mistral": dict(arch="mistral"),
}


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def branching_tree(root: int) -> TokenTree:
    tree = TokenTree.with_root(root)
    a = tree.add_draft(0, 5)
    b = tree.add_draft(0, 9)
    tree.add_draft(a, 7)
    c = tree.add_draft(a, 11)
    tree.add_draft(b, 7)  # same token, same depth, different parent
    tree.add_draft(c, 3)
    return tree


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(tmp_path, variant):
    path = save_tiny_llama(tmp_path / variant, seed=3, **VARIANTS[variant])
    if variant == "sharded":
        assert (path / "model.safetensors.index.json").is_file()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner.from_dir(path, max_kv_tokens=256, block_size=4)
    prompt = [3, 14, 15, 9, 2, 6, 5, 35, 8, 9, 7, 9, 3, 23, 8, 4, 6, 26, 43]
    seq = runner.new_sequence()

    # prefill: every position's logits
    (pre,) = runner.run([chain_work(seq, prompt, "all")])
    seq.num_committed += len(prompt)
    assert (pre - hf_logits(hf, prompt)).abs().max().item() <= 1e-4

    # decode one token
    (dec,) = runner.run([chain_work(seq, [17], "last")])
    seq.num_committed += 1
    ctx = prompt + [17]
    assert (dec[0] - hf_logits(hf, ctx)[-1]).abs().max().item() <= 1e-4

    # a tree step with branches, rooted at the next token
    tree = branching_tree(21)
    base = seq.num_committed
    (out,) = runner.run([Work(seq, tree.tokens, [base + d for d in tree.depths], tree.parents, "all")])
    for node in range(len(tree)):
        path = ctx + [21] + tree.path_tokens(node)
        assert (out[node] - hf_logits(hf, path)[-1]).abs().max().item() <= 1e-4, node


def test_commit_equals_incremental_kv(tmp_path):
    """After committing an accepted path, the cache holds what incremental decoding would."""
    path = save_tiny_llama(tmp_path / "m", seed=5)
    prompt = [4, 8, 15, 16, 23, 42]
    tree = branching_tree(30)
    accepted_path = [0, 1, 4, 6]  # root -> 5 -> 11 -> 3: not the first-child chain, so rows move

    spec = ModelRunner.from_dir(path, max_kv_tokens=128, block_size=4)
    seq = spec.new_sequence()
    spec.prefill(seq, prompt)
    base = seq.num_committed
    spec.run([Work(seq, tree.tokens, [base + d for d in tree.depths], tree.parents, "all")])
    spec.commit(seq, accepted_path)

    ref = ModelRunner.from_dir(path, max_kv_tokens=128, block_size=4)
    rseq = ref.new_sequence()
    ref.prefill(rseq, prompt)
    for node in accepted_path:
        ref.prefill(rseq, [tree.tokens[node]])

    assert seq.num_committed == rseq.num_committed == len(prompt) + len(accepted_path)
    slots = torch.tensor(seq.slots(0, seq.num_committed))
    rslots = torch.tensor(rseq.slots(0, rseq.num_committed))
    for a, b in ((spec.kv.k, ref.kv.k), (spec.kv.v, ref.kv.v)):
        diff = (a[:, slots] - b[:, rslots]).abs().max().item()
        assert diff <= 1e-5, diff
    # and the cache is really different from an uncommitted one (the test can fail)
    assert (spec.kv.k[:, slots[-1]] - ref.kv.k[:, rslots[-2]]).abs().max().item() > 1e-3


def test_non_contiguous_blocks_match(tmp_path):
    """Sequences whose blocks interleave (index-gather path) give the same logits."""
    path = save_tiny_llama(tmp_path / "m", seed=6)
    runner = ModelRunner.from_dir(path, max_kv_tokens=256, block_size=2)
    a, b = runner.new_sequence(), runner.new_sequence()
    ids_a, ids_b = [1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2]
    for i in range(max(len(ids_a), len(ids_b))):  # interleave growth so block tables interleave
        for seq, ids in ((a, ids_a), (b, ids_b)):
            if i < len(ids):
                runner.prefill(seq, [ids[i]])
    assert a.contiguous_start(a.num_committed) is None
    (la, lb) = runner.run([chain_work(a, [10], "last"), chain_work(b, [11], "last")])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert (la[0] - hf_logits(hf, ids_a + [10])[-1]).abs().max().item() <= 1e-4
    assert (lb[0] - hf_logits(hf, ids_b + [11])[-1]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close(tmp_path, dtype):
    path = save_tiny_llama(tmp_path / "m", seed=7)
    ref = ModelRunner.from_dir(path)
    low = ModelRunner.from_dir(path, dtype=dtype)
    ids = [5, 6, 7, 8, 9, 10]
    r = ref.prefill(ref.new_sequence(), ids)
    lo = low.prefill(low.new_sequence(), ids)
    assert lo.dtype == torch.float32 and torch.isfinite(lo).all()
    assert (r - lo).abs().max().item() < 0.1 * r.abs().max().item()


_IMPORT_KERNELS = """
import os
before = dict(os.environ)
import specinfer.engine.kernels as kernels
kernels.HAS_TRITON
import specinfer.engine.kernels.commit, specinfer.engine.kernels.cuda_graphs, specinfer.engine.kernels.tree_attention
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
print("changed:", changed)
"""


def test_importing_the_kernels_leaves_the_environment_alone():
    """The optional kernels import without side effects, even without CUDA: Triton's interpreter
    is an explicit opt-in (`use_interpreter`), not something an import switches on."""
    import os
    import subprocess
    import sys

    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/"), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", _IMPORT_KERNELS], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "changed: []"


def test_cost_model_calibrates_within_a_short_context(tmp_path):
    """A model whose context is shorter than the default calibration prefix plus its largest
    size still calibrates (the load-aware verifier starts on it) and frees what it used."""
    from specinfer.engine.scheduling.policy import CostModel

    path = save_tiny_llama(tmp_path / "m", seed=8, max_pos=64)
    runner = ModelRunner.from_dir(path, max_kv_tokens=1024, block_size=4)
    num_free = runner.allocator.num_free
    model = CostModel.calibrate(runner, repeats=1)
    sizes = [n for n, _ in model.points]
    assert sizes and max(sizes) <= 32 and all(t > 0 for _, t in model.points)
    assert runner.allocator.num_free == num_free


def test_calibration_times_a_small_pass_after_one_of_its_size(tmp_path):
    """Decoding runs a small pass after another small one. Timed right after the round's largest
    pass, a one-token pass would carry the cold caches that pass left (here: a fixed penalty for a
    pass that follows a larger one) and hide what a second token adds to it."""
    from specinfer.engine.scheduling.policy import CostModel

    path = save_tiny_llama(tmp_path / "m", seed=8)
    runner = ModelRunner.from_dir(path, max_kv_tokens=1024, block_size=4)
    sizes = (1, 2, 4, 8, 16, 32, 64)
    cost = {n: 0.001 * n + 0.005 for n in sizes}
    passes = []  # every pass's size, the untimed ones included
    run = runner.run

    def recorded_run(works):
        passes.append(len(works[0].token_ids))
        return run(works)

    runner.run = recorded_run

    def timer(_, work):
        n = len(work.token_ids)
        after_larger = bool(passes) and passes[-1] > n
        passes.append(n)
        return cost[n] + (0.004 if after_larger else 0.0)

    model = CostModel.calibrate(runner, sizes=sizes, context=64, repeats=3, timer=timer)
    assert dict(model.points) == pytest.approx(cost)
    # after the prefix's prefill, each small size timed after an untimed pass of its own size; the
    # larger ones once a round (a warm-up round and three timed ones)
    assert passes[1:3] == [1, 1] and passes.count(1) == passes.count(16) == 8 and passes.count(32) == 4


def test_checkpoint_reads_equal_safetensors_own_and_refuse_a_truncated_file(tmp_path):
    """Weights are read with plain reads (no memory map that keeps fused originals resident):
    every tensor equals what safetensors itself reads, bf16 included; a cut file is a UserError."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from specinfer.engine.models.checkpoint import SafetensorsFile
    from specinfer.errors import UserError

    path = tmp_path / "t.safetensors"
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(4),
               "d": torch.tensor(2.5), "e": torch.zeros(0, 3)}
    save_file(tensors, str(path))
    with SafetensorsFile(path) as f, safe_open(str(path), framework="pt") as g:
        assert sorted(f.keys()) == sorted(g.keys())
        for name in g.keys():
            mine, theirs = f.get_tensor(name), g.get_tensor(name)
            assert mine.dtype == theirs.dtype and mine.shape == theirs.shape and torch.equal(mine, theirs)
        for key in (slice(1, 3), (slice(None), slice(2, 4)), slice(2, 2)):  # rows, columns, none (tensor parallel)
            assert torch.equal(f.get_slice("a")[key], g.get_slice("a")[key])
        assert torch.equal(f.get_slice("b")[2:6], g.get_slice("b")[2:6])
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(UserError, match="truncated"), SafetensorsFile(path) as f:
        f.get_tensor("a"), f.get_tensor("b"), f.get_tensor("c")
    (tmp_path / "bad.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(UserError, match="not a readable safetensors"), SafetensorsFile(tmp_path / "bad.safetensors"):
        pass


@pytest.mark.parametrize("rotary", [16, 8])  # the whole head, and Phi-3's partial rotary
def test_rope_is_bitwise_the_families_rotation(rotary):
    """`apply_rope` over its signed-sin table gives transformers' x * cos + rotate_half(x) * sin
    bit for bit, queries and keys rotated together or apart (the decoder rotates them together)."""
    from transformers.models.llama.modeling_llama import rotate_half

    from specinfer.engine.layers.rope import apply_rope, rope_tables
    from specinfer.engine.models.hf import RopeConfig

    cos, signed_sin = rope_tables(RopeConfig(theta=10000.0), rotary, 64, 64, torch.float32, "cpu")
    sin = torch.cat((-signed_sin[:, : rotary // 2], signed_sin[:, rotary // 2 :]), dim=-1)
    positions = torch.tensor([0, 3, 17, 63])
    x = torch.randn(4, 6, 16) * 3
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    expected = torch.cat((x[..., :rotary] * c + rotate_half(x[..., :rotary]) * s, x[..., rotary:]), dim=-1)
    together = apply_rope(x, c, signed_sin[positions].unsqueeze(1))
    assert torch.equal(together, expected)
    assert torch.equal(torch.cat((apply_rope(x[:, :4], c, signed_sin[positions].unsqueeze(1)),
                                  apply_rope(x[:, 4:], c, signed_sin[positions].unsqueeze(1))), dim=1), expected)
    # The plain sin in place of the signed one rotates the other way: the test tells them apart.
    assert not torch.equal(apply_rope(x, c, s), expected)
