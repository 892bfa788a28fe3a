"""Logits processors at every tree node: penalised greedy output equals transformers' generate with
the same processors, with and without speculation, alone and in batches; a grammar's mask, its
cut drafts and its forced tokens change nothing but speed; the processors' own errors.

Constraints here use a small stand-in grammar over token ids (the real grammar engine has its own
tests), so the engine's side is checked on its own: per-path state, pruning, forced drafts."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from specinfer.engine.llm_engine import Engine, mode_params
from specinfer.engine.verification.processors import RequestLogits
from specinfer.engine.drafting.tree import TokenTree
from specinfer.errors import UserError
from specinfer.params import Constraint, SamplingParams, TreeShape

NEW_TOKENS = 40


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's frequency and presence penalties over the generated tokens, written plainly."""

    def __init__(self, num_prompt: int, frequency: float, presence: float):
        self.num_prompt, self.frequency, self.presence = num_prompt, frequency, presence

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for row, ids in enumerate(input_ids[:, self.num_prompt:].tolist()):
            for token in set(ids):
                scores[row, token] -= self.frequency * ids.count(token) + self.presence
        return scores


def transformers_greedy(hf, prompt: list[int], sampling: SamplingParams, max_new: int) -> list[int]:
    kwargs = {}
    if sampling.repetition_penalty != 1.0:
        kwargs["repetition_penalty"] = sampling.repetition_penalty
    if sampling.logit_bias:
        kwargs["sequence_bias"] = {(t,): b for t, b in sampling.logit_bias}
    procs = LogitsProcessorList()
    if sampling.frequency_penalty or sampling.presence_penalty:
        procs.append(OpenAIPenalties(len(prompt), sampling.frequency_penalty, sampling.presence_penalty))
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, pad_token_id=0,
                          logits_processor=procs, eos_token_id=None, **kwargs)
    return out[0, len(prompt):].tolist()


PENALTIES = {
    "frequency": SamplingParams(frequency_penalty=1.5),
    "presence": SamplingParams(presence_penalty=1.2),
    "repetition": SamplingParams(repetition_penalty=1.8),
    "bias": SamplingParams(logit_bias=((5, 4.0), (9, -100.0), (17, 2.5))),
    "all": SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4, repetition_penalty=1.3,
                          logit_bias=((5, 3.0), (11, -2.0))),
}


@pytest.fixture(scope="module")
def hf(tiny_pair):
    return AutoModelForCausalLM.from_pretrained(tiny_pair.llm, dtype=torch.float32).eval()


@pytest.mark.parametrize("case", list(PENALTIES))
def test_penalised_greedy_equals_transformers(hf, pair_runners, greedy_prompts, case):
    llm, ssms = pair_runners
    sampling = PENALTIES[case]
    engine = Engine.from_runners(llm, ssms)
    num_rejected = num_accepted = 0
    for prompt in greedy_prompts[:6]:
        expected = transformers_greedy(hf, prompt, sampling, NEW_TOKENS)
        plain = engine.generate(prompt, mode_params("incremental", NEW_TOKENS, sampling=sampling, is_ignore_eos=True))
        assert plain.output_ids == expected
        tree = engine.generate(prompt, mode_params("tree", NEW_TOKENS, TreeShape((2, 2, 1, 1)), sampling,
                                                   is_ignore_eos=True))
        assert tree.output_ids == expected
        num_accepted += sum(tree.accepted_per_step)
        num_rejected += sum(1 for a in tree.accepted_per_step if a < 4)
    # Trees were both accepted and cut short: the per-node contexts were exercised.
    assert num_accepted > 0 and num_rejected > 0
    assert llm.allocator.num_used == 0


def test_penalties_change_the_output(hf, greedy_prompts):
    """The comparison above has teeth: the penalties do change what greedy decoding outputs."""
    prompt = greedy_prompts[0]
    plain = transformers_greedy(hf, prompt, SamplingParams(), NEW_TOKENS)
    for sampling in PENALTIES.values():
        assert transformers_greedy(hf, prompt, sampling, NEW_TOKENS) != plain


def test_penalised_batch_equals_single(pair_runners, greedy_prompts):
    llm, ssms = pair_runners
    engine = Engine.from_runners(llm, ssms)
    cases = list(PENALTIES.values()) + [SamplingParams()]
    params = [mode_params("tree", NEW_TOKENS, TreeShape((2, 1, 2)), s, is_ignore_eos=True) for s in cases]
    singles = [engine.generate(p, q).output_ids for p, q in zip(greedy_prompts, params)]
    batch = engine.generate_batch([engine.start(p, q) for p, q in zip(greedy_prompts, params)])
    assert [r.output_ids for r in batch] == singles


def test_path_counts_as_output():
    """Row i of a tree's logits is penalised for the tokens on node i's own path, and only those."""
    sampling = SamplingParams(frequency_penalty=1.0, presence_penalty=0.5)
    proc = RequestLogits(sampling, [1, 2, 3, 4], num_output=1, vocab_size=8)  # 4 is earlier output
    tree = TokenTree.with_root(4)
    a = tree.add_draft(0, 5)
    b = tree.add_draft(a, 5)
    c = tree.add_draft(0, 6)
    out = proc.process(torch.zeros(4, 8), tree)
    assert out[0].tolist() == [0, 0, 0, 0, -1.5, 0, 0, 0]  # the output so far: token 4 once
    assert out[a][5] == -1.5 and out[b][5] == -2.5 and out[c][5] == 0 and out[c][6] == -1.5
    assert out[a][4] == out[b][4] == out[c][4] == -1.5


def test_logit_bias_outside_the_vocabulary_is_a_user_error(pair_runners):
    llm, _ = pair_runners
    engine = Engine.from_runners(llm)
    with pytest.raises(UserError, match=r"sampling.logit_bias: token 999 is outside the vocabulary \(size 128\)"):
        engine.start([3, 4], mode_params("incremental", 4, sampling=SamplingParams(logit_bias=((999, 1.0),))))
    assert llm.allocator.num_used == 0


def test_out_of_range_penalties_are_user_errors():
    with pytest.raises(UserError, match="sampling.frequency_penalty"):
        SamplingParams(frequency_penalty=2.5)
    with pytest.raises(UserError, match="sampling.repetition_penalty"):
        SamplingParams(repetition_penalty=0.0)
    with pytest.raises(UserError, match="sampling.min_p"):
        SamplingParams(min_p=1.5)
    with pytest.raises(UserError, match="sampling.logit_bias: the bias of token 3"):
        SamplingParams(logit_bias={3: 200})


# ---- a grammar over token ids -------------------------------------------------------------------
@dataclass
class Masks:
    allowed: list[frozenset[int] | None]  # per node; None: its token was rejected
    valid: list[bool]

    def apply(self, logits):
        out = torch.full_like(logits, float("-inf"))
        for row, allowed in enumerate(self.allowed):
            if allowed is not None:
                idx = torch.tensor(sorted(allowed))
                out[row, idx] = logits[row, idx]
        return out

    def allows(self, node, token):
        return self.allowed[node] is not None and token in self.allowed[node]


class CycleGrammar:
    """Output position i may hold only the tokens of `sets[i % len(sets)]`: a set of one token is a
    forced token. After `length` tokens only EOS is allowed."""

    def __init__(self, sets: list[frozenset[int]], length: int, eos: int):
        self.sets, self.length, self.eos, self.num_done = sets, length, eos, 0

    def allowed_at(self, position: int) -> frozenset[int]:
        return frozenset({self.eos}) if position >= self.length else self.sets[position % len(self.sets)]

    def advance(self, tokens):
        for t in tokens:
            if t not in self.allowed_at(self.num_done):
                raise ValueError(f"token {t} rejected at {self.num_done}")
            self.num_done += 1

    def tree_masks(self, tokens, parents):
        allowed, valid, depth = [], [], [0] * len(tokens)
        for node, parent in enumerate(parents):
            if node:
                depth[node] = depth[parent] + 1
            ok = node == 0 or (valid[parent] and tokens[node] in self.allowed_at(self.num_done + depth[node] - 1))
            valid.append(ok)
            allowed.append(self.allowed_at(self.num_done + depth[node]) if ok else None)
        return Masks(allowed, valid)

    def forced(self, max_tokens):
        out = []
        while len(out) < max_tokens and self.num_done + len(out) < self.length:
            allowed = self.allowed_at(self.num_done + len(out))
            if len(allowed) != 1:
                break
            out += list(allowed)
        return out

    @property
    def is_terminated(self):
        return self.num_done > self.length


class CycleCompiler:
    def __init__(self, eos: int):
        self.eos = eos

    def new_state(self, constraint: Constraint):
        sets = [frozenset(int(t) for t in part.split(",")) for part in constraint.spec.split(";")]
        return CycleGrammar(sets, int(constraint.choices[0]) if constraint.choices else 24, self.eos)


# Free positions, then a run of forced tokens (a "key"), then a choice between two.
CYCLE = Constraint("regex", "3,7,9,12,20,21,30,31,40;50;51;52;53;8,9")


def constrained_reference(hf, prompt, grammar: CycleGrammar, eos: int, max_new: int) -> list[int]:
    """Plain masked greedy decoding with transformers' model: the meaning of constrained greedy output."""
    ids, out = list(prompt), []
    with torch.no_grad():
        while len(out) < max_new:
            logits = hf(torch.tensor([ids])).logits[0, -1]
            allowed = sorted(grammar.allowed_at(len(out)))
            token = allowed[int(logits[allowed].argmax())]
            out.append(token)
            ids.append(token)
            if token == eos:
                break
    return out


@pytest.mark.parametrize("mode", ["incremental", "tree", "auto"])
def test_constrained_greedy_equals_masked_decoding(hf, pair_runners, greedy_prompts, tiny_pair, mode):
    llm, ssms = pair_runners
    eos = llm.cfg.eos_token_ids[0]
    engine = Engine.from_runners(llm, ssms)
    engine.grammars = CycleCompiler(eos)
    steps = tokens = 0
    for prompt in greedy_prompts[:5]:
        expected = constrained_reference(hf, prompt, CycleCompiler(eos).new_state(CYCLE), eos, NEW_TOKENS)
        assert expected[-1] == eos  # the grammar ended it: EOS was forced where it completed
        r = engine.generate(prompt, mode_params(mode, NEW_TOKENS, TreeShape((2, 2, 1)), constraint=CYCLE))
        assert r.output_ids == expected
        steps += r.num_llm_steps
        tokens += len(r.output_ids)
    if mode != "incremental":  # forced runs of four tokens are drafted for free, and accepted
        assert tokens / steps > 2.0
    assert llm.allocator.num_used == 0


def test_drafts_the_grammar_rejects_are_cut(pair_runners, greedy_prompts):
    """Trees hold only tokens the grammar allows along their paths."""
    llm, ssms = pair_runners
    eos = llm.cfg.eos_token_ids[0]
    engine = Engine.from_runners(llm, ssms)
    engine.grammars = CycleCompiler(eos)
    seen = []

    class Watch:
        def speculated(self, step, draft, started, ended):
            pass

        def verified(self, step, tree, accepted, kept, batch_size, started, ended):
            seen.append(tree)

    g = engine.start(greedy_prompts[1], mode_params("tree", NEW_TOKENS, TreeShape((3, 3, 2)), constraint=CYCLE),
                     observer=Watch())
    engine.generate_batch([g])
    assert seen and max(len(t) for t in seen) > 1
    grammar = CycleCompiler(eos).new_state(CYCLE)
    done = 0
    for tree, accepted_len in zip(seen, g.result.accepted_per_step):
        for node in range(1, len(tree)):
            position = done + tree.depths[node] - 1
            assert tree.tokens[node] in grammar.allowed_at(position), (node, tree.tokens)
        done += accepted_len + 1


def test_resumed_output_counts(hf, pair_runners, greedy_prompts):
    """A request resumed with its earlier output at the end of its prompt continues exactly: its
    penalties count that output and its grammar has matched it."""
    llm, ssms = pair_runners
    eos = llm.cfg.eos_token_ids[0]
    engine = Engine.from_runners(llm, ssms)
    engine.grammars = CycleCompiler(eos)
    sampling = SamplingParams(frequency_penalty=1.0, presence_penalty=0.3)
    prompt = greedy_prompts[2]
    whole = engine.generate(prompt, mode_params("tree", NEW_TOKENS, TreeShape((2, 1)), sampling, constraint=CYCLE))
    cut = 7
    rest = engine.generate(prompt + whole.output_ids[:cut],
                           mode_params("tree", NEW_TOKENS - cut, TreeShape((2, 1)), sampling, constraint=CYCLE,
                                       num_resumed_tokens=cut))
    assert whole.output_ids[:cut] + rest.output_ids == whole.output_ids
    fresh = engine.generate(prompt + whole.output_ids[:cut],
                            mode_params("tree", NEW_TOKENS - cut, TreeShape((2, 1)), sampling))
    assert fresh.output_ids != rest.output_ids  # without the count, the continuation differs


def test_constraint_without_a_grammar_engine_is_a_user_error(pair_runners):
    llm, _ = pair_runners
    engine = Engine.from_runners(llm)
    with pytest.raises(UserError, match="regex: structured output needs the model's tokenizer"):
        engine.start([3, 4], mode_params("incremental", 4, constraint=Constraint("regex", "a+")))
    assert llm.allocator.num_used == 0


def test_min_p_drops_unlikely_tokens():
    from specinfer.engine.verification.sampling import warp_logits

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = warp_logits(logits, replace(SamplingParams(1.0), min_p=0.4)).isfinite()[0].tolist()
    assert kept == [True, True, False, False]  # 0.15 < 0.4 x 0.5
