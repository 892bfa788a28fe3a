"""The grammar engine (`specinfer.engine.verification.grammar`): tree masks against brute force over a tiny
byte-level BPE vocabulary, forced tokens, JSON that parses, errors, bounded and cached compiles."""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import regex
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from specinfer.engine.verification.grammar import GrammarCompiler, unpack_bits
from specinfer.errors import UserError
from specinfer.params import Constraint

CORPUS = ['{"name": "Ada", "age": 36, "ok": true, "tags": ["x"]}', "hello world, how are you", "hello world, how is it",
          "the quick brown fox jumps over the lazy dog", "2024-01-31 12:00", "[1, 2, 3]", "alpha beta gamma"]
EOS = (1, 2)  # "</s>" and "<|end|>"
NUM_PADDING = 13  # model vocabulary entries beyond the tokenizer's


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>", "<|end|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok


@pytest.fixture(scope="module")
def token_bytes(tokenizer) -> list[bytes | None]:
    """Each id's bytes; None for special tokens and for the model's padding beyond the tokenizer."""
    decode = byte_decoder()
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    out: list[bytes | None] = [None] * (tokenizer.get_vocab_size() + NUM_PADDING)
    for text, i in tokenizer.get_vocab().items():
        out[i] = None if text in special else bytes(decode[c] for c in text)
    return out


@pytest.fixture(scope="module")
def compiler(tokenizer):
    c = GrammarCompiler.from_tokenizer(tokenizer, tokenizer.get_vocab_size() + NUM_PADDING, EOS)
    yield c
    c.close()


def regex_oracle(pattern: str):
    """(text viable as a prefix, text accepted whole) by Python's `regex`, ASCII texts only."""
    def viable(data: bytes) -> tuple[bool, bool]:
        if not data.isascii():
            return False, False
        text = data.decode()
        return regex.fullmatch(pattern, text, partial=True) is not None, regex.fullmatch(pattern, text) is not None
    return viable


def choice_oracle(choices: tuple[str, ...]):
    encoded = [c.encode() for c in choices]
    return lambda data: (any(c.startswith(data) for c in encoded), data in encoded)


def allowed_by_oracle(oracle, token_bytes, path: bytes) -> set[int]:
    out = {t for t, b in enumerate(token_bytes) if b is not None and oracle(path + b)[0]}
    return out | set(EOS) if oracle(path)[1] else out


def random_tree(oracle, token_bytes, rng: random.Random, num_nodes: int):
    """A tree of mostly grammatical drafts, some not; returns tokens, parents, each node's path bytes
    (None below an ungrammatical or EOS node)."""
    tokens, parents, paths = [0], [-1], [b""]
    while len(tokens) < num_nodes:
        parent = rng.randrange(len(tokens))
        path = paths[parent]
        allowed = sorted(allowed_by_oracle(oracle, token_bytes, path)) if path is not None else []
        token = rng.choice(allowed) if allowed and rng.random() < 0.8 else rng.randrange(len(token_bytes))
        ok = path is not None and token in allowed and token not in EOS
        tokens.append(token)
        parents.append(parent)
        paths.append(path + token_bytes[token] if ok else None)
    return tokens, parents, paths


def check_masks(state, oracle, token_bytes, tokens, parents, paths, has_branches: bool = True):
    """Every token a mask allows keeps the text a prefix of an accepted string (the oracle), and
    where the oracle allows something the mask allows something too. Where the grammar forces
    text, only its canonical tokenization is allowed (llguidance's forcing: it is what makes
    forced drafts certain), so a mask may allow fewer tokens than the oracle, never others; where
    nothing is forced (the patterns' branch points) the two are equal. A node is valid exactly
    when its parent is and its parent's mask allows its token."""
    masks = state.tree_masks(tokens, parents)
    logits = masks.apply(torch.zeros(len(tokens), len(token_bytes)))
    assert torch.equal(unpack_bits(torch.from_numpy(masks.bitmask), len(token_bytes)), logits == 0)  # off CPU
    num_equal = 0
    for i, path in enumerate(paths):
        if i:
            assert masks.valid[i] == (masks.valid[parents[i]] and masks.allows(parents[i], tokens[i])), i
        if path is None or not masks.valid[i]:
            assert not masks.valid[i] or (i > 0 and tokens[i] in EOS), i
            continue
        expected = allowed_by_oracle(oracle, token_bytes, path)
        got = {t for t in range(len(token_bytes)) if masks.allows(i, t)}
        assert got <= expected, (i, path, got - expected)
        assert bool(got) == bool(expected), (i, path)
        num_equal += got == expected
        assert set(torch.nonzero(logits[i] == 0).flatten().tolist()) == got
    assert num_equal > 0 or not has_branches  # at the branch points the mask is the oracle's, token for token
    return masks


@pytest.mark.parametrize("pattern", [r"(ab|cd)+[0-9]{1,3}( (yes|no))?", r"hello world, how (are you|is it)",
                                     r"\[[0-9](, [0-9])*\]"])
def test_regex_masks_match_brute_force(compiler, token_bytes, pattern):
    oracle = regex_oracle(pattern)
    rng = random.Random(pattern)
    for _ in range(4):
        state = compiler.new_state(Constraint("regex", pattern))
        tokens, parents, paths = random_tree(oracle, token_bytes, rng, 32)
        check_masks(state, oracle, token_bytes, tokens, parents, paths, has_branches=not pattern.startswith("hello"))


def test_choice_masks_match_brute_force(compiler, token_bytes):
    choices = ("hello world", "hello world, how are you", 'say "hi"\\n', "back\\slash", "a|b*", "caf\u00e9", "\n")
    oracle = choice_oracle(choices)
    rng = random.Random(0)
    for _ in range(4):
        state = compiler.new_state(Constraint("choice", choices=choices))
        check_masks(state, oracle, token_bytes, *random_tree(oracle, token_bytes, rng, 32))


def test_masks_follow_the_verified_output(compiler, tokenizer, token_bytes):
    """After advance, row 0 is the state after the output; tree_masks leaves the state as it was."""
    pattern = r"(ab|cd)+[0-9]{1,3}( (yes|no))?"
    oracle = regex_oracle(pattern)
    state = compiler.new_state(Constraint("regex", pattern))
    before = state.tree_masks([0], [-1]).bitmask.copy()
    rng = random.Random(1)
    for _ in range(3):
        state.tree_masks(*random_tree(oracle, token_bytes, rng, 40)[:2])
        assert (state.tree_masks([0], [-1]).bitmask == before).all()
    output = tokenizer.encode("abcd12").ids
    state.advance(output)
    fresh = compiler.new_state(Constraint("regex", pattern))
    for t in output:
        fresh.advance([t])
    prefix = b"abcd12"
    tokens, parents, paths = random_tree(lambda data: oracle(prefix + data), token_bytes, rng, 32)
    paths = [None if p is None else prefix + p for p in paths]
    masks = check_masks(state, oracle, token_bytes, tokens, parents, paths)
    assert (fresh.tree_masks(tokens, parents).bitmask == masks.bitmask).all()


def test_eos_ends_the_output(compiler, tokenizer):
    state = compiler.new_state(Constraint("regex", r"ab|abc"))
    state.advance(tokenizer.encode("ab").ids)
    masks = state.tree_masks([0, EOS[1], tokenizer.token_to_id("c")], [-1, 0, 0])
    assert masks.allows(0, EOS[0]) and masks.allows(0, EOS[1]) and masks.valid == [True, True, True]
    with pytest.raises(ValueError):
        state.advance(tokenizer.encode("x").ids)
    state.advance(tokenizer.encode("c").ids)  # the rejected token committed nothing
    row = state.tree_masks([0], [-1])
    assert {t for t in range(compiler.vocab_size) if row.allows(0, t)} == set(EOS)  # it can only end
    assert not state.is_terminated
    state.advance([EOS[1]])
    assert state.is_terminated and state.forced(8) == []
    assert state.tree_masks([0, EOS[0]], [-1, 0]).valid == [True, False]
    with pytest.raises(ValueError):
        state.advance([EOS[0]])


def test_forced_takes_a_long_common_prefix(compiler, tokenizer):
    choices = ("the quick brown fox jumps over the lazy dog", "the quick brown fox sleeps")
    state = compiler.new_state(Constraint("choice", choices=choices))
    before = state.tree_masks([0], [-1]).bitmask.copy()
    forced = state.forced(16)
    text = tokenizer.decode(forced)
    assert "the quick brown fox ".startswith(text) and len(text) >= len("the quick brown"), text
    assert (state.tree_masks([0], [-1]).bitmask == before).all()
    assert state.forced(2) == forced[:2]
    state.advance(forced)
    state.advance(tokenizer.encode("fox sleeps"[len(text) - len("the quick brown "):]).ids)
    assert state.forced(16) == [EOS[0]]  # the grammar can only end


@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
def test_json_following_the_mask_parses(compiler, tokenizer, kind):
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok", "tags"],
              "properties": {"name": {"type": "string", "maxLength": 4}, "age": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 99},
                             "ok": {"type": "boolean"},
                             "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}}}
    constraint = Constraint(kind, json.dumps(schema) if kind == "json_schema" else "")
    num_done = 0
    for seed in range(6):
        rng, state, output = random.Random(seed), compiler.new_state(constraint), []
        while not state.is_terminated and len(output) < 400:
            row = state.tree_masks([0], [-1])
            allowed = [t for t in range(compiler.vocab_size) if row.allows(0, t)]
            # End where it may, and now and then close a structure, so that the walk ends.
            closing = [t for t in allowed if t in EOS] or [t for t in allowed if "}" in tokenizer.decode([t])]
            token = closing[0] if closing and (closing[0] in EOS or rng.random() < 0.1) else rng.choice(allowed)
            state.advance([token])
            output.append(token)
        if not state.is_terminated:
            continue
        value = json.loads(tokenizer.decode(output[:-1]))
        assert isinstance(value, dict)
        if kind == "json_schema":
            assert set(value) == {"name", "age", "ok", "tags"}
            assert isinstance(value["age"], int) and 0 <= value["age"] <= 99 and isinstance(value["ok"], bool)
            assert len(value["name"]) <= 4 and set(value["tags"]) <= {"x", "y"}
        num_done += 1
    assert num_done >= 4


@pytest.mark.parametrize("constraint, message", [
    (Constraint("json_schema", '{"type": "nonsense"}'), "json_schema: invalid schema (Invalid type: nonsense)"),
    (Constraint("json_schema", '{"type": '), "json_schema: invalid schema (not JSON"),
    (Constraint("json_schema", "false"), "json_schema: invalid schema (Unsatisfiable"),
    (Constraint("regex", "(ab"), "regex: "),
    (Constraint("regex", r"(a)\1"), "regex: "),
    (Constraint("regex", r"[^\s\S]"), "regex: matches no text"),
    (Constraint("grammar", "start: foo"), "grammar: "),
    (Constraint("grammar", 'root ::= "a" y'), "grammar: "),
    (Constraint("grammar", 'start: start "a"'), "grammar: matches no text"),
])
def test_errors_name_the_field(compiler, constraint, message):
    with pytest.raises(UserError) as info:
        compiler.compile(constraint)
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)
    with pytest.raises(UserError):  # remembered: fails again, at once
        compiler.compile(constraint)


def test_grammar_takes_lark_and_gbnf(compiler, tokenizer):
    for spec in ('start: "a" | "b" x\nx: /[0-9]+/', 'root ::= "a" | "b" x\nx ::= [0-9]+'):
        state = compiler.new_state(Constraint("grammar", spec))
        state.advance(tokenizer.encode("b12").ids)
        assert state.tree_masks([0], [-1]).allows(0, EOS[0])


def test_a_slow_compile_times_out_once(tokenizer, monkeypatch):
    compiler = GrammarCompiler.from_tokenizer(tokenizer, tokenizer.get_vocab_size(), EOS, timeout_s=0.5)
    release, slow_done, threads = threading.Event(), threading.Event(), []
    original = GrammarCompiler._compile_now

    def slow(self, constraint):
        threads.append(threading.current_thread())
        if constraint.spec == "slow":
            release.wait(60)  # until the test lets it go (a minute guards a hang)
            slow_done.set()
        return original(self, constraint)

    monkeypatch.setattr(GrammarCompiler, "_compile_now", slow)
    with pytest.raises(UserError, match=r"^regex: took longer than 0.5s to compile$"):
        compiler.compile(Constraint("regex", "slow"))
    assert not slow_done.is_set()  # it gave up while the compile still ran
    # From here a compile may wait an hour: what must not wait hangs, and the futures' generous
    # timeouts catch that, whatever the machine's load.
    compiler.timeout_s = 3600.0
    with ThreadPoolExecutor(2) as pool:
        try:
            again = pool.submit(compiler.compile, Constraint("regex", "slow"))
            with pytest.raises(UserError, match=r"^regex: took longer than 0.5s to compile$"):
                again.result(timeout=30)  # the remembered failure, at once (a new one would name the hour)
            assert len(threads) == 1  # and no second compile
            assert threads[0] is not threading.current_thread()
            fast = pool.submit(compiler.new_state, Constraint("regex", "fast"))
            assert fast.result(timeout=30) is not None  # another worker compiles while the slow one runs
            assert not slow_done.is_set()
        finally:
            release.set()  # the slow compile ends (the pool waits for what waits on it)
    compiler.close()


def test_one_key_compiles_once_and_the_cache_is_lru(tokenizer, monkeypatch):
    compiler = GrammarCompiler.from_tokenizer(tokenizer, tokenizer.get_vocab_size(), EOS, cache_size=2)
    calls = []
    original = GrammarCompiler._compile_now

    def counted(self, constraint):
        calls.append(constraint.key)
        time.sleep(0.1)
        return original(self, constraint)

    monkeypatch.setattr(GrammarCompiler, "_compile_now", counted)
    constraint = Constraint("regex", "[a-z]+")
    barrier, results = threading.Barrier(8), []

    def compile_it():
        barrier.wait()
        results.append(compiler.compile(constraint))

    workers = [threading.Thread(target=compile_it) for _ in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(calls) == 1 and len(results) == 8 and all(r is results[0] for r in results)
    compiler.compile(Constraint("regex", "b"))
    compiler.compile(constraint)  # most recently used
    compiler.compile(Constraint("regex", "c"))  # evicts "b"
    compiler.compile(constraint)
    assert len(calls) == 3
    compiler.compile(Constraint("regex", "b"))
    assert len(calls) == 4
    compiler.close()
