"""What a feature-level (EAGLE-style) draft head reaches against the LLM, beside the cut draft of make-draft.

    python scripts/feature_head_probe.py [--llm GGUF_OR_DIR] [--work DIR] [--train-minutes 4]
        [--features pre|post] [--ce-weight 1.0] [--reg-weight 0.5] [--lr 5e-4] [--batch-size 8]
        [--draft DIR] [--result FILE] [--threads 2]

`specinfer make-draft` cuts a draft from the LLM's first layers and distills it on the LLM's own
answers. This script measures, on the same teacher data and the same held-out answer positions,
what a draft that reads the LLM's features instead of only its tokens reaches within a few CPU
minutes of training:

1. **Teacher data**, exactly as a build makes it (`make_draft.teacher_data` with a `DraftPlan`
   of the default `DraftConfig`): `--work` is a make-draft work directory (``.NAME.make-draft``).
   When it already holds finished teacher data, that data is used as it is; otherwise the cut and
   the data are made there, within the data share of the build's budget (``DraftConfig.minutes``
   times ``data_share``, about 5 minutes), and kept for the next run. A build removes its work
   directory when it finishes; to measure on the very data of a build, copy its work directory's
   ``data/``, ``data.done``, ``costs.json`` and ``run.json`` once ``data.done`` appears, and pass
   the copy as ``--work``.
2. **Features.** One teacher-forced LLM pass per sequence (the engine's own layers and kernels)
   gives the final hidden state at every position: before the final norm (``--features pre``,
   the default) or after it (``post``). The LLM's top-1 from these features is checked against
   the data's targets on every held-out answer position and some training ones.
3. **The head**, in plain torch (float32, autograd): at position t, ``fc(concat(feature_t,
   embedding(token_{t+1})))`` and one Llama decoder layer (RMSNorm, causal self-attention with
   RoPE over the sequence, SwiGLU MLP), initialised from the LLM's last layer, with ``fc`` set to
   the identity on each half (``x = feature + gain * embedding``, ``--embed-gain``; 0 scales the
   embedding up to the features' rms), give ``g_t``, a prediction of ``feature_{t+1}``. Its
   logits are the
   LLM's frozen final norm and LM head applied to ``g_t`` (``pre``), or the LM head alone
   (``post``, where the features are already normed, as in EAGLE). The loss is
   ``ce_weight`` times the cross-entropy against the LLM's top-1 at t + 1 (answer positions, as
   make-draft trains) plus ``reg_weight`` times the smooth L1 distance of ``g_t`` to
   ``feature_{t+1}`` (every position, per dimension in units of the features' standard
   deviation). Embeddings, final norm and LM head stay frozen. AdamW, batches of sequences,
   linear warmup then a cosine decay over the time budget (``--train-minutes``).
4. **Measurement** on the held-out answer positions make-draft evaluates (``mask``), before and
   after training: depth 1, the head's top-1 at position m (from the LLM's features up to m - 1
   and token m) equals the LLM's; depth 2, the head then continues from its own ``g`` and its own
   token (attending to the head's keys of the true positions before m), and its next top-1 also
   equals the LLM's (counted over positions m with m and m + 1 both answer positions, as
   make-draft's ``acceptance_by_depth``). The depth-2 chain with true features at both steps is
   reported too, the bound that exact feature prediction would reach. Each is measured with the
   head proposing from the whole vocabulary and from the reduced vocabulary make-draft gives a
   draft's head (``DraftConfig.vocab`` most frequent answer tokens, `make_draft.draft_vocabulary`).
   One-token pass costs (after a 64-token context, median of repeated passes, packed weights and
   a KV cache, as the engine runs them), with the whole and the reduced head: the head, the LLM,
   and the cut draft when ``--draft`` holds a finished build.
5. The cut draft under ``--draft``, if any, is measured on the same held-out positions in the
   engine (teacher-forced, both vocabularies), beside its own ``make_draft.json``. A table on
   stdout, and every number in ``--result`` (JSON).

A run reuses the work directory's data and caches the features next to the result, so a rerun
costs the training budget plus about a minute.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from specinfer.engine.runtime.cpu import configure_cpu_runtime

configure_cpu_runtime()  # before torch loads OpenMP, as the command line does: passes are timed below

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from specinfer.engine.layers.activations import ACTIVATIONS
from specinfer.engine.layers.linear import can_pack, linear, pack
from specinfer.engine.layers.norms import rms_norm
from specinfer.engine.layers.rope import apply_rope, rope_tables
from specinfer.engine.models.checkpoint import engine_weights, load_state_dict
from specinfer.engine.models.config import ModelConfig
from specinfer.engine.runtime.runner import ModelRunner, chain_work
from specinfer.model_source import resolve
from specinfer.pool.boost_data import BoostData
from specinfer.pool.make_draft import (
    one_token_ms,
    PROVENANCE_NAME, Clock, DraftPlan, acceptance_by_depth, cut_draft, draft_vocabulary, rate, teacher_data,
)
from specinfer.pool.tuning_config import DraftConfig
from specinfer.util import write_json

PROBE = Path("/work/dl/probe")
DEFAULT_LLM = Path("/work/dl/SmolLM2-135M-Instruct.Q4_1.gguf")
CONTEXT_TOKENS = 64  # context before a timed one-token pass, as make-draft's pass costs
TIMING_REPS = 15
# The DraftConfig settings that decide the teacher data (the others shape the draft).
DATA_SETTINGS = ("data_share", "prompt_tokens", "continuation_tokens", "sampled_fraction", "temperature", "kl_top_k",
                 "eval_prompts", "gen_batch_size", "max_batches", "seed")


def say(line: str) -> None:
    print(f"feature-head: {line}", file=sys.stderr, flush=True)


# ---- 1. teacher data -------------------------------------------------------------------------


def plan_for(llm: Path, work: Path) -> DraftPlan:
    """The default build's plan whose work directory is `work` (named ``.NAME.make-draft``)."""
    suffix = ".make-draft"
    if not (work.name.startswith(".") and work.name.endswith(suffix)) or len(work.name) <= len(suffix) + 1:
        raise SystemExit(f"--work {work}: a make-draft work directory is named .NAME{suffix}")
    plan = DraftPlan(llm, work.parent / work.name[1 : -len(suffix)], DraftConfig())
    assert plan.work == work
    return plan


def get_teacher_data(plan: DraftPlan) -> tuple[BoostData, BoostData, dict]:
    """(train, held-out, info) from the work directory, made there first when it has none."""
    record = plan.work / "run.json"
    wanted = json.loads(json.dumps(plan.run_record()))
    notes = []
    if record.is_file():
        stored = json.loads(record.read_text())
        differ = sorted(k for k in DATA_SETTINGS if stored["settings"].get(k) != wanted["settings"].get(k))
        differ += [k for k in ("format", "llm", "corpus") if stored.get(k) != wanted.get(k)]
        if differ:
            raise SystemExit(f"{plan.work} holds teacher data made with other {', '.join(differ)} "
                             f"({record}); give another --work")
        if stored != wanted:
            notes.append(f"the stored build record differs from this version's in settings that do not make the "
                         f"data: {sorted(set(stored['settings']) ^ set(wanted['settings'])) or 'values'}")
            say(f"note: {notes[-1]}")
    clock = Clock(plan.cfg.minutes)  # started before the cut, as a build's
    plan.work.mkdir(parents=True, exist_ok=True)
    if not record.is_file():
        write_json(record, wanted)
    cached = (plan.work / "data.done").is_file() and (plan.work / "costs.json").is_file()
    if not cached:
        say(f"no teacher data in {plan.work}: making it (data share {plan.cfg.data_share} of "
            f"{plan.cfg.minutes:g} min)")
        cut_draft(plan, lambda line: say(line))
    started = time.monotonic()
    train, evals = teacher_data(plan, clock, True, lambda line: say(line))
    info = {"work": str(plan.work), "reused": cached, "seconds": round(time.monotonic() - started, 1),
            "batches": json.loads((plan.work / "data.done").read_text())["batches"],
            "build_pass_costs": json.loads((plan.work / "costs.json").read_text()),
            "train_answers": len(train), "train_positions": train.num_positions,
            "eval_answers": len(evals), "eval_positions": evals.num_positions,
            "train_sampled_answers": int(train.sampled.sum()), "eval_sampled_answers": int(evals.sampled.sum()),
            "notes": notes}
    return train, evals, info


# ---- 2. the LLM's features -------------------------------------------------------------------


@torch.inference_mode()
def hidden_states(runner: ModelRunner, batch, kv) -> torch.Tensor:
    """The residual stream after the last layer, before the final norm: `DecoderModel.forward`'s
    own steps up to its final norm."""
    model = runner.model
    h = F.embedding(batch.token_ids, model.w["embed"])
    if model.embed_scale is not None:
        h = h * model.embed_scale
    rope = [(cos[batch.positions].unsqueeze(1), sin[batch.positions].unsqueeze(1)) for cos, sin in model.rope]
    window_seqs = batch.window_seqs if batch.window_seqs is not None else batch.seqs
    for i, (is_sliding, rope_index) in enumerate(model.layer_kinds):
        h = h + model.attention_block(i, h, rope[rope_index], batch, window_seqs if is_sliding else batch.seqs, kv)
        h = h + model.mlp_block(i, h)
    return h


@torch.inference_mode()
def llm_features(runner: ModelRunner, data: BoostData, check_rows: int, batch: int = 8) -> tuple[torch.Tensor, dict]:
    """(N, L, hidden) pre-norm features of every sequence (zeros past its length), and the check:
    the LLM's top-1 from them against `data.targets` on the answer positions of the first
    `check_rows` sequences."""
    model = runner.model
    n, width = data.tokens.shape
    feats = torch.zeros(n, width, model.cfg.hidden_size)
    same = total = 0
    for lo in range(0, n, batch):
        rows = list(range(lo, min(lo + batch, n)))
        ids = [data.tokens[r, : int(data.lengths[r])].tolist() for r in rows]
        seqs = [runner.new_sequence() for _ in rows]
        try:
            fb, _ = runner.prepare([chain_work(s, t, "none") for s, t in zip(seqs, ids)])
            h = hidden_states(runner, fb, runner.kv)
        finally:
            for s in seqs:
                s.free()
        start = 0
        for r, t in zip(rows, ids):
            feats[r, : len(t)] = h[start : start + len(t)]
            start += len(t)
            if r < check_rows:
                pos = torch.nonzero(data.mask[r, : len(t)]).squeeze(1)
                x = model.norm(feats[r, pos], model.w["norm"], model.cfg.rms_norm_eps)
                top1 = linear(x, model.w["lm_head"]).argmax(-1)
                same += int((top1 == data.targets[r, pos]).sum())
                total += len(pos)
    return feats, {"positions": total, "llm_top1_equals_targets": round(same / max(1, total), 4)}


def cached_features(runner: ModelRunner, data: BoostData, path: Path, check_rows: int) -> tuple[torch.Tensor, dict]:
    """`llm_features`, kept in `path` for the same sequences."""
    key = torch.tensor([int(data.tokens.sum()), int(data.lengths.sum()), *data.tokens.shape])
    if path.is_file():
        stored = load_file(str(path))
        if torch.equal(stored["key"], key):
            return stored["feats"], json.loads(path.with_suffix(".json").read_text())
    started = time.monotonic()
    feats, check = llm_features(runner, data, check_rows)
    check["seconds"] = round(time.monotonic() - started, 1)
    save_file({"feats": feats.contiguous(), "key": key}, str(path))
    path.with_suffix(".json").write_text(json.dumps(check))
    return feats, check


# ---- 3. the head -----------------------------------------------------------------------------


class FeatureHead(nn.Module):
    """fc(concat(feature_t, embedding(token_{t+1}))) -> one decoder layer -> g_t ~ feature_{t+1}."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], layer: int, prenorm: bool, max_len: int,
                 embed_gain: float = 1.0):
        super().__init__()
        if cfg.norm_offset or cfg.is_sandwich_norm or cfg.is_qk_norm or cfg.attention_bias or cfg.mlp_bias \
                or cfg.embed_scale is not None or cfg.final_logit_softcapping is not None:
            raise SystemExit(f"this probe builds Llama-style heads only, not {cfg.architecture}'s layer")
        hidden = cfg.hidden_size
        self.cfg, self.prenorm = cfg, prenorm
        self.fc = nn.Linear(2 * hidden, hidden)
        with torch.no_grad():  # the identity on each half, the embedding's scaled to the features': x = f + gain * e
            self.fc.weight.copy_(torch.cat([torch.eye(hidden), embed_gain * torch.eye(hidden)], dim=1))
            self.fc.bias.zero_()
        for name in ("qkv", "o", "gate_up", "down", "in_norm", "mlp_norm"):
            setattr(self, name, nn.Parameter(w[f"{layer}.{name}"].float().clone()))
        self.register_buffer("embed", w["embed"].float(), persistent=False)
        self.register_buffer("norm", w["norm"].float(), persistent=False)
        self.register_buffer("lm_head", w["lm_head"].float(), persistent=False)
        cos, sin = rope_tables(cfg.layer_rope(layer), cfg.rotary_dim or cfg.head_dim, cfg.max_position_embeddings,
                               max_len, torch.float32, "cpu")
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def inputs(self, feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([feats, F.embedding(tokens, self.embed)], dim=-1))

    def qkv_of(self, x: torch.Tensor, positions: torch.Tensor):
        """(B, T, heads, D) queries, keys and values (roped) of residual inputs x (B, T, hidden)."""
        cfg = self.cfg
        b, t, _ = x.shape
        q, k, v = F.linear(rms_norm(x, self.in_norm, cfg.rms_norm_eps), self.qkv).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # (T, 1, D)
        q = apply_rope(q.view(b, t, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rope(k.view(b, t, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        return q, k, v.view(b, t, cfg.num_kv_heads, cfg.head_dim)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual x plus the attention output (B, T, H * D) and the MLP."""
        x = x + F.linear(attn, self.o)
        gate, up = F.linear(rms_norm(x, self.mlp_norm, self.cfg.rms_norm_eps), self.gate_up).chunk(2, dim=-1)
        return x + F.linear(self.act(gate) * up, self.down)

    def forward(self, feats: torch.Tensor, next_tokens: torch.Tensor):
        """g (B, T, hidden) over whole sequences (causal), and the layer's keys and values."""
        x = self.inputs(feats, next_tokens)
        b, t, _ = x.shape
        q, k, v = self.qkv_of(x, torch.arange(t))
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True, scale=self.cfg.attention_scale,
                                              enable_gqa=self.cfg.num_kv_heads != self.cfg.num_heads)
        return self.finish(x, attn.transpose(1, 2).reshape(b, t, self.q_size)), (k, v)

    def second_step(self, g: torch.Tensor, tokens: torch.Tensor, kv) -> torch.Tensor:
        """Row t (t >= 1): the head continued from its own g_{t-1} and token `tokens[:, t]`, at
        position t, attending to the true rows 0..t-1 (keys `kv`) and to itself."""
        k1, v1 = kv
        b, t, _ = g.shape
        prev = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)
        x = self.inputs(prev, tokens)
        q, k2, v2 = self.qkv_of(x, torch.arange(t))
        group = self.cfg.num_heads // self.cfg.num_kv_heads
        q = q.transpose(1, 2)  # (B, H, T, D)
        k1, v1, k2, v2 = (z.repeat_interleave(group, dim=2).transpose(1, 2) for z in (k1, v1, k2, v2))
        scale = self.cfg.attention_scale
        past = (q @ k1.transpose(-1, -2)) * scale  # (B, H, T, T)
        past = past.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(-1), float("-inf"))
        own = (q * k2).sum(-1, keepdim=True) * scale  # (B, H, T, 1)
        weights = torch.softmax(torch.cat([past, own], dim=-1), dim=-1)
        attn = weights[..., :t] @ v1 + weights[..., t:] * v2  # (B, H, T, D)
        return self.finish(x, attn.transpose(1, 2).reshape(b, t, self.q_size))

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        x = rms_norm(g, self.norm, self.cfg.rms_norm_eps) if self.prenorm else g
        return F.linear(x, self.lm_head)


def as_features(feats: torch.Tensor, head_norm: torch.Tensor, eps: float, prenorm: bool) -> torch.Tensor:
    return feats if prenorm else rms_norm(feats, head_norm, eps)


def batch_of(feats, data: BoostData, rows, prenorm: bool, norm_w, eps):
    width = int(data.lengths[rows].max())
    f = as_features(feats[rows, :width], norm_w, eps, prenorm)
    tokens = data.tokens[rows, :width]
    next_tokens = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)
    return f, tokens, next_tokens, width


def top1_of(logits: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    """The top-1 token ids, over the whole vocabulary or only the ids `vocab`."""
    return logits.argmax(-1) if vocab is None else vocab[logits[..., vocab].argmax(-1)]


@torch.no_grad()
def evaluate(head: FeatureHead, feats: torch.Tensor, data: BoostData, vocab: torch.Tensor | None = None,
             batch: int = 8) -> dict:
    """Agreement with the LLM on the answer positions: depth 1, the chain of depth 2 from the
    head's own features and token, and the depth-2 chain with true features; the head proposes
    from the whole vocabulary or from `vocab`."""
    head.eval()
    n, width = data.tokens.shape
    d1 = torch.zeros(n, width, dtype=torch.bool)  # d1[r, m]: head's top-1 for position m (row m - 1) is the LLM's
    d2 = torch.zeros(n, width, dtype=torch.bool)  # d2[r, m]: second step's top-1 for position m (row m - 1)
    for lo in range(0, n, batch):
        rows = list(range(lo, min(lo + batch, n)))
        f, _, next_tokens, t = batch_of(feats, data, rows, head.prenorm, head.norm, head.cfg.rms_norm_eps)
        targets = data.targets[rows, :t]
        g, kv = head(f, next_tokens)
        top1 = top1_of(head.logits(g), vocab)  # row j: the LLM's top-1 at position j + 1
        d1[rows, 1:t] = top1[:, : t - 1] == targets[:, 1:]
        g2 = head.second_step(g, torch.cat([torch.zeros_like(top1[:, :1]), top1[:, :-1]], dim=1), kv)
        top2 = top1_of(head.logits(g2), vocab)  # row j >= 1: from g_{j-1} and its own token, position j + 1
        d2[rows, 2:t] = top2[:, 1 : t - 1] == targets[:, 2:]
    mask = data.mask
    pairs = mask[:, :-1] & mask[:, 1:]
    chain2 = d1[:, :-1] & d2[:, 1:] & pairs
    depth1 = d1 & mask
    return {
        "depth1": rate(d1, mask),
        "depth2_chain": round(int(chain2.sum()) / max(1, int(pairs.sum())), 4),
        "depth2_given_depth1": round(int(chain2.sum()) / max(1, int((depth1[:, :-1] & pairs).sum())), 4),
        "depth2_chain_true_features": acceptance_by_depth(d1, mask, 2)[1:2][0] if pairs.any() else None,
        "chain_by_depth_true_features": acceptance_by_depth(d1, mask),
        "positions": int(mask.sum()), "depth2_positions": int(pairs.sum()),
    }


def feature_scale(feats: torch.Tensor, data: BoostData, prenorm: bool, norm_w, eps) -> torch.Tensor:
    """Per-dimension standard deviation of the training features (the regression's unit)."""
    valid = torch.arange(feats.shape[1]).unsqueeze(0) < data.lengths.unsqueeze(1)
    f = as_features(feats[valid], norm_w, eps, prenorm)
    return f.std(0).clamp_min(1e-3 * float(f.std()))


def train_head(head: FeatureHead, feats: torch.Tensor, data: BoostData, args, scale: torch.Tensor) -> dict:
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    budget = 60.0 * args.train_minutes
    order: list[int] = []
    step = seen = 0
    log = []
    started = time.monotonic()
    ce_sum = reg_sum = acc_sum = 0.0
    while True:
        elapsed = time.monotonic() - started
        if elapsed >= budget or (args.steps and step >= args.steps):
            break
        frac = elapsed / budget if not args.steps else step / args.steps
        lr = args.lr * min(1.0, (step + 1) / args.warmup_steps) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        if len(order) < args.batch_size:
            order += torch.randperm(len(data), generator=gen).tolist()
        rows, order = order[: args.batch_size], order[args.batch_size :]
        head.train()
        f, _, next_tokens, t = batch_of(feats, data, rows, head.prenorm, head.norm, head.cfg.rms_norm_eps)
        g, _ = head(f, next_tokens)
        lengths = data.lengths[rows].unsqueeze(1)
        valid = torch.arange(t).unsqueeze(0) < (lengths - 1)  # row j predicts feature j + 1
        target_f = torch.cat([f[:, 1:], torch.zeros_like(f[:, :1])], dim=1)
        reg = F.smooth_l1_loss((g[valid] - target_f[valid]) / scale, torch.zeros_like(g[valid]))
        ce_rows = torch.cat([data.mask[rows, 1:t], torch.zeros(len(rows), 1, dtype=torch.bool)], dim=1)
        ce_targets = torch.cat([data.targets[rows, 1:t], torch.zeros(len(rows), 1, dtype=torch.long)], dim=1)
        logits = head.logits(g[ce_rows])
        ce = F.cross_entropy(logits, ce_targets[ce_rows])
        loss = args.ce_weight * ce + args.reg_weight * reg
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        seen += len(rows)
        ce_sum += ce.item()
        reg_sum += reg.item()
        acc_sum += float((logits.argmax(-1) == ce_targets[ce_rows]).float().mean())
        if step % 20 == 0:
            entry = {"step": step, "seconds": round(time.monotonic() - started, 1), "lr": round(lr, 7),
                     "ce": round(ce_sum / 20, 4), "reg": round(reg_sum / 20, 4), "train_top1": round(acc_sum / 20, 4)}
            log.append(entry)
            say(" ".join(f"{k} {v}" for k, v in entry.items()))
            ce_sum = reg_sum = acc_sum = 0.0
    seconds = time.monotonic() - started
    return {"steps": step, "seconds": round(seconds, 1), "step_s": round(seconds / max(1, step), 3),
            "sequences_seen": seen, "epochs": round(seen / len(data), 2), "log": log}


# ---- pass costs ------------------------------------------------------------------------------


class HeadRunner:
    """The trained head as the engine would run it: packed weights and a KV cache of one layer
    (a one-layer `DecoderModel`'s attention and MLP blocks), fc and the LM head packed too."""

    def __init__(self, head: FeatureHead, cfg: ModelConfig, w: dict[str, torch.Tensor], layer: int,
                 vocab: torch.Tensor | None = None):
        one = replace(cfg, num_layers=1, layer_types=cfg.layer_types[layer : layer + 1] if cfg.layer_types else (),
                      head_token_ids=() if vocab is None else tuple(vocab.tolist()))
        weights = {"embed": w["embed"], "norm": w["norm"], "lm_head": w["lm_head"],
                   **{f"0.{name}": getattr(head, name).detach().clone()
                      for name in ("qkv", "o", "gate_up", "down", "in_norm", "mlp_norm")}}
        if cfg.tie_word_embeddings:
            weights["lm_head"] = weights["embed"]
        self.runner = ModelRunner.from_weights(one, weights, "float32", "cpu", max_kv_tokens=256)
        fc = head.fc.weight.detach().clone().contiguous()
        self.fc = pack(fc) if can_pack(torch.device("cpu"), torch.float32) else fc
        self.fc_bias = head.fc.bias.detach().clone()
        self.prenorm = head.prenorm

    @torch.inference_mode()
    def step(self, seq, features: torch.Tensor, token_ids: list[int], commit: bool) -> torch.Tensor:
        runner = self.runner
        model = runner.model
        batch, _ = runner.prepare([chain_work(seq, token_ids, "last")])
        x = linear(torch.cat([features, F.embedding(batch.token_ids, model.w["embed"])], dim=-1), self.fc, self.fc_bias)
        cos, sin = model.rope[0]
        rope = (cos[batch.positions].unsqueeze(1), sin[batch.positions].unsqueeze(1))
        x = x + model.attention_block(0, x, rope, batch, batch.seqs, runner.kv)
        x = x + model.mlp_block(0, x)
        g = x[-1:]
        out = linear(model.norm(g, model.w["norm"], model.cfg.rms_norm_eps) if self.prenorm else g, model.w["lm_head"])
        if model.head_ids is not None:  # as `DecoderModel.forward` returns a reduced head's logits
            full = torch.full((1, model.cfg.vocab_size), -1e9)
            out = full.index_copy_(1, model.head_ids, out)
        if commit:
            seq.advance(token_ids)
        return out

    def pass_ms(self, hidden: int, reps: int = TIMING_REPS) -> float:
        seq = self.runner.new_sequence()
        try:
            self.step(seq, torch.randn(CONTEXT_TOKENS, hidden), list(range(3, 3 + CONTEXT_TOKENS)), True)
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                self.step(seq, torch.randn(1, hidden), [7], False)
                times.append(time.perf_counter() - start)
            return 1000 * statistics.median(times)
        finally:
            seq.free()


def draft_runner(path: Path, vocab: torch.Tensor | None) -> ModelRunner:
    """A finished draft in the engine, its head reduced to `vocab` when given."""
    cfg = ModelConfig.from_dir(path)
    if vocab is not None:
        cfg = replace(cfg, head_token_ids=tuple(vocab.tolist()))
    return ModelRunner.from_weights(cfg, engine_weights(cfg, load_state_dict(path, torch.float32)), "float32", "cpu",
                                    max_kv_tokens=8 * 512)


@torch.no_grad()
def runner_agreement(runner: ModelRunner, data: BoostData, batch: int = 8) -> dict:
    """A token-level draft's (the cut) top-1 against the LLM's on the answer positions, teacher-forced."""
    agree = torch.zeros_like(data.mask)
    for lo in range(0, len(data), batch):
        rows = list(range(lo, min(lo + batch, len(data))))
        ids = [data.tokens[r, : int(data.lengths[r])].tolist() for r in rows]
        seqs = [runner.new_sequence() for _ in rows]
        try:
            logits = runner.run([chain_work(s, t, "all") for s, t in zip(seqs, ids)])
        finally:
            for s in seqs:
                s.free()
        for r, t, rows_logits in zip(rows, ids, logits):
            agree[r, : len(t)] = rows_logits.argmax(-1) == data.targets[r, : len(t)]
    return {"depth1": rate(agree, data.mask), "chain_by_depth": acceptance_by_depth(agree, data.mask)}


def runner_pass_ms(runner: ModelRunner, reps: int = TIMING_REPS) -> float:
    """make_draft.pass_costs' measure: a one-token pass after a 64-token context, median."""
    return one_token_ms(runner, reps)


# ---- main ------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llm", type=Path, default=DEFAULT_LLM, help="the LLM: a checkpoint directory or a GGUF file")
    ap.add_argument("--work", type=Path, default=PROBE / ".teacher.make-draft",
                    help="make-draft work directory holding (or to hold) the teacher data")
    ap.add_argument("--draft", type=Path, default=PROBE / "draft", help="a finished make-draft build to compare with")
    ap.add_argument("--result", type=Path, default=PROBE / "result.json")
    ap.add_argument("--features", choices=("pre", "post"), default="pre",
                    help="the LLM's last hidden state before (pre) or after (post) its final norm")
    ap.add_argument("--train-minutes", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: by the time budget)")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--ce-weight", type=float, default=1.0)
    ap.add_argument("--reg-weight", type=float, default=0.5)
    ap.add_argument("--embed-gain", type=float, default=1.0,
                    help="fc's initial weight on the embedding half (0: the features' rms / the embeddings' rms)")
    ap.add_argument("--check-rows", type=int, default=16, help="training sequences whose targets are re-checked")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    total_started = time.monotonic()
    args.result.parent.mkdir(parents=True, exist_ok=True)

    plan = plan_for(args.llm, args.work)
    train, evals, data_info = get_teacher_data(plan)
    say(f"teacher data: {data_info['train_answers']} answers, {data_info['train_positions']} positions "
        f"({data_info['eval_positions']} held out)")

    source = resolve(args.llm)
    cfg = ModelConfig.from_dir(args.llm)
    weights = engine_weights(cfg, load_state_dict(source, torch.float32))
    width = max(train.tokens.shape[1], evals.tokens.shape[1])
    llm = ModelRunner.from_weights(cfg, weights, "float32", "cpu", max_kv_tokens=8 * (width + 16))
    feat_dir = args.result.parent
    feats_eval, check_eval = cached_features(llm, evals, feat_dir / "features-eval.safetensors", len(evals))
    feats_train, check_train = cached_features(llm, train, feat_dir / "features-train.safetensors", args.check_rows)
    say(f"features: LLM top-1 from them equals the targets at {check_eval['llm_top1_equals_targets']:.2%} of "
        f"{check_eval['positions']} held-out and {check_train['llm_top1_equals_targets']:.2%} of "
        f"{check_train['positions']} training positions")

    layer = cfg.num_layers - 1
    prenorm = args.features == "pre"
    valid = torch.arange(train.tokens.shape[1]).unsqueeze(0) < train.lengths.unsqueeze(1)
    rms = float(as_features(feats_train[valid], weights["norm"].float(), cfg.rms_norm_eps, prenorm).pow(2).mean().sqrt())
    embed_rms = float(weights["embed"].float()[train.tokens[valid]].pow(2).mean().sqrt())
    gain = args.embed_gain or rms / embed_rms
    head = FeatureHead(cfg, weights, layer, prenorm, width + 8, gain)
    scale = feature_scale(feats_train, train, prenorm, head.norm, cfg.rms_norm_eps)
    say(f"features ({args.features}-norm): rms {rms:.3g} (embeddings {embed_rms:.3g}: fc's embedding gain "
        f"{gain:.3g}), per-dimension std {float(scale.min()):.3g}..{float(scale.max()):.3g}")

    vocab = draft_vocabulary(train, plan.cfg.vocab, cfg)  # the reduced head make-draft gives a draft
    vocab_name = f"vocab {len(vocab)}" if vocab is not None else "full vocab"
    before = {"full": evaluate(head, feats_eval, evals), "reduced": evaluate(head, feats_eval, evals, vocab)}
    say(f"before training: depth 1 {before['full']['depth1']:.1%}, depth-2 chain {before['full']['depth2_chain']:.1%}")
    training = train_head(head, feats_train, train, args, scale)
    after = {"full": evaluate(head, feats_eval, evals), "reduced": evaluate(head, feats_eval, evals, vocab)}
    say(f"after {training['steps']} steps in {training['seconds']} s: depth 1 {after['full']['depth1']:.1%}, "
        f"depth-2 chain {after['full']['depth2_chain']:.1%}")

    llm_ms = runner_pass_ms(llm)
    costs = {"llm_pass_ms": round(llm_ms, 2),
             "head_pass_ms": round(HeadRunner(head, cfg, weights, layer).pass_ms(cfg.hidden_size), 2),
             "head_reduced_vocab_pass_ms": round(HeadRunner(head, cfg, weights, layer, vocab).pass_ms(cfg.hidden_size),
                                                 2)}
    draft_record = cut_now = None
    if (args.draft / PROVENANCE_NAME).is_file():
        draft_record = json.loads((args.draft / PROVENANCE_NAME).read_text())
        for key in ("train_positions", "eval_positions"):
            if draft_record.get(key) != data_info[key]:
                say(f"warning: the cut draft's {key} {draft_record.get(key)} differ from this data's "
                    f"{data_info[key]}: not the same teacher data")
        full_runner, reduced_runner = draft_runner(args.draft, None), draft_runner(args.draft, vocab)
        cut_now = {"full": runner_agreement(full_runner, evals), "reduced": runner_agreement(reduced_runner, evals)}
        costs["cut_draft_pass_ms"] = round(runner_pass_ms(full_runner), 2)
        costs["cut_draft_reduced_vocab_pass_ms"] = round(runner_pass_ms(reduced_runner), 2)
    for key in [k for k in costs if k != "llm_pass_ms"]:
        costs[key.replace("_pass_ms", "_to_llm_pass_cost")] = round(costs[key] / llm_ms, 3)

    result = {
        "llm": str(args.llm), "features": args.features, "head_layer_init": layer,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "draft_config": asdict(plan.cfg), "teacher_data": data_info,
        "feature_check": {"eval": check_eval, "train": check_train}, "feature_rms": round(rms, 4),
        "embedding_rms": round(embed_rms, 4), "embed_gain": round(gain, 4),
        "load_average_at_end": os.getloadavg(),
        "reduced_vocab_size": None if vocab is None else len(vocab),
        "head": {"before": before, "after": after, "training": training,
                 "trainable_parameters": sum(p.numel() for p in head.parameters() if p.requires_grad)},
        "pass_costs": costs,
        "cut_draft": None if draft_record is None else {
            "path": str(args.draft), "measured_here": cut_now,
            "make_draft_json": {k: draft_record.get(k) for k in (
                "agreement_before", "agreement_after", "acceptance_by_depth_before", "acceptance_by_depth_after",
                "steps", "train_positions", "eval_positions", "vocab_size", "llm_pass_ms", "draft_pass_ms",
                "draft_to_llm_pass_cost", "build_minutes")}},
        "total_seconds": round(time.monotonic() - total_started, 1),
    }
    write_json(args.result, result)

    def pct(x):
        return "-" if x is None else f"{x:.1%}"

    rows = []
    if draft_record is not None:
        depth = draft_record.get("acceptance_by_depth_before") or []
        rows.append(("cut draft, before (make_draft.json)", draft_record.get("agreement_before"),
                     depth[1] if len(depth) > 1 else None, None, None, None))
        depth = draft_record.get("acceptance_by_depth_after") or []
        rows.append((f"cut draft, after {draft_record.get('steps')} steps (make_draft.json)",
                     draft_record.get("agreement_after"), depth[1] if len(depth) > 1 else None, None, None, None))
        full, reduced = (cut_now[k] for k in ("full", "reduced"))
        rows.append(("cut draft, after (measured here)", full["depth1"], (full["chain_by_depth"] + [None])[1], None,
                     reduced["depth1"], (reduced["chain_by_depth"] + [None])[1]))
    for name, m in (("head, before training", before),
                    (f"head, after {training['steps']} steps ({training['seconds']:.0f} s)", after)):
        rows.append((name, m["full"]["depth1"], m["full"]["depth2_chain"], m["full"]["depth2_chain_true_features"],
                     m["reduced"]["depth1"], m["reduced"]["depth2_chain"]))
    print(f"held-out answer positions: {after['full']['positions']} (depth 2: {after['full']['depth2_positions']}); "
          f"head features: {args.features}-norm")
    print(f"{'draft':48s} {'depth 1':>8s} {'depth 2':>8s} {'d2 true f.':>10s} {'d1 ' + vocab_name:>12s} "
          f"{'d2 ' + vocab_name:>12s}")
    for name, *cells in rows:
        print(f"{name:48s} " + " ".join(f"{pct(c):>{w}s}" for c, w in zip(cells, (8, 8, 10, 12, 12))))
    parts = [f"LLM {costs['llm_pass_ms']} ms",
             f"head {costs['head_pass_ms']} ms (x{costs['head_to_llm_pass_cost']}; "
             f"{vocab_name}: x{costs['head_reduced_vocab_to_llm_pass_cost']})"]
    if "cut_draft_pass_ms" in costs:
        parts.append(f"cut draft {costs['cut_draft_pass_ms']} ms (x{costs['cut_draft_to_llm_pass_cost']}; "
                     f"{vocab_name}: x{costs['cut_draft_reduced_vocab_to_llm_pass_cost']})")
    print("one-token pass: " + ", ".join(parts))
    print(f"result: {args.result}")


if __name__ == "__main__":
    main()
