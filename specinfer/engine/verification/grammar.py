r"""Structured output under SpecInfer's tree verification (Section 4): a request's constraint
(`params.Constraint`) is a token mask at every node of its token tree, so the LLM's token at a
node, and so every token verification keeps, is one the grammar allows after that node's path;
a draft the grammar rejects is an invalid node and never accepted. Masks are model-vocab wide;
ids past the tokenizer's are never allowed.

The matcher is llguidance's, chosen over xgrammar by measurement on CPU with the reference
tokenizer (8192 tokens) over random grammatical 32-node trees, medians:

                                     llguidance 1.9           xgrammar 0.2
    state per tree path              consume, fill, rollback(1) along a DFS in both; deep copy 1-2 us;
                                     xgrammar also walks a whole tree in C++
    mask per node, schema / regex    3 / 4 us                 5 / 2 us (C++ tree walk 3 / 1 us)
    compile, 4-field schema / regex  0.4 / 0.8 ms             1.3 / 0.3 ms
    compile \w{60000} / ([a-z]{1,1000}-){1,1000}
                                     2 / 1 ms                 63 / 128 ms, growing with the counts

Masks cost the same; llguidance is bounded: its lexer is built lazily and every compile and mask
step runs on fuel (`LLParserLimits`), so a pathological regex or schema is an error, not a stall
of the verifier; it reports bad input as messages (xgrammar logs C++ lines, and matches `\p{L}`
as the letter p); it needs no other package. This module's `tree_masks` on that tree: 2.7 us a
node for the schema, 3.9 for the regex, 3 us for a root alone; `apply` on CPU 0.1 ms (32 x 8192).

llguidance's forcing is on (its default, and vLLM's): where the grammar forces text, only that
text's canonical tokenization is allowed. So `forced` drafts are certain: the LLM's token at each
of their nodes is the only one its mask leaves (measured on the reference pair with a schema of
long keys: 12-13 LLM steps for 89-97 tokens, against 65 steps for 128 with forcing off, where the
LLM often spelled a forced key in other tokens than the draft). Elsewhere every token that keeps
the text a prefix of an accepted string is allowed.

Kinds: json_schema (compact JSON: `JSON_LAYOUT`), json_object, regex (the
whole output matches; Rust `regex` syntax, no look-around or backreferences), choice (string
literals of a Lark grammar), grammar (Lark as llguidance takes it, start rule `start`, or
llama.cpp's GBNF, `root ::= ...`, which llguidance converts to Lark).
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from pathlib import Path

import llguidance
import numpy as np
import torch
from tokenizers import Tokenizer

from specinfer import limits
from specinfer.errors import UserError
from specinfer.model_source import ModelSource, resolve
from specinfer.params import Constraint

NUM_COMPILE_WORKERS = 2  # threads that compile; a compile past its timeout holds one until it ends
FAILED_TTL_S = 600.0  # a constraint that failed to compile fails at once for this long
MAX_ERROR_CHARS = 300
# JSON is laid out one way, as OpenAI's structured outputs write it: `, ` and `: ` and no other
# whitespace. A model cannot wander off into blank lines, and keys with their punctuation become
# text the grammar forces (free drafts). A schema's own "x-guidance" options override this.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A constraint compiled for one tokenizer: a matcher at the start, copied per request."""

    key: tuple
    matcher: llguidance.LLMatcher  # never advanced; only copied
    tokenizer: llguidance.LLTokenizer
    lock: threading.Lock

    def new_matcher(self) -> llguidance.LLMatcher:
        with self.lock:
            return self.matcher.deep_copy()


@dataclass(frozen=True, eq=False)
class TreeMasks:
    """The masks of one token tree, row i for the token after node i's path. `bitmask` is a view
    of the state's reused buffer: it holds until that state's next `tree_masks`."""

    valid: list[bool]
    bitmask: np.ndarray  # (num_nodes, ceil(vocab_size / 32)) int32, bit t of row i = token t allowed
    vocab_size: int

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Disallowed entries of (num_nodes, vocab_size) logits set to -inf, in place."""
        num_nodes = len(self.valid)
        if logits.dim() != 2 or logits.shape[0] != num_nodes or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must be ({num_nodes}, {self.vocab_size}), got {tuple(logits.shape)}")
        if logits.device.type == "cpu":
            bits = np.unpackbits(self.bitmask.view(np.uint8), axis=1, count=self.vocab_size, bitorder="little")
            allowed = torch.from_numpy(bits.view(np.bool_))
        else:  # 1 bit a token on the wire, unpacked there
            allowed = unpack_bits(torch.from_numpy(self.bitmask).to(logits.device), self.vocab_size)
        return logits.masked_fill_(allowed.logical_not_(), float("-inf"))

    def allows(self, node: int, token: int) -> bool:
        return self.valid[node] and _has_bit(self.bitmask[node], token, self.vocab_size)


def unpack_bits(words: torch.Tensor, num_bits: int) -> torch.Tensor:
    """(n, W) int32 words -> (n, num_bits) bool, on the words' device: entry 32 w + j is bit j of word w."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1)[:, :num_bits].bool()


def _has_bit(row: np.ndarray, token: int, vocab_size: int) -> bool:
    return 0 <= token < vocab_size and bool((int(row[token >> 5]) >> (token & 31)) & 1)


class GrammarState:
    """One request's matcher, at the output verified so far. Not thread-safe: one request's
    thread at a time."""

    def __init__(self, compiled: CompiledGrammar, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.kind = compiled.key[0]
        self._compiled = compiled
        self._matcher = compiled.new_matcher()
        self._output: list[int] = []  # committed tokens, replayed if the matcher must be rebuilt
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._eos = frozenset(eos_token_ids)
        num_words = (vocab_size + 31) // 32
        bits = np.zeros(32 * num_words, np.uint8)
        bits[list(eos_token_ids)] = 1
        self._eos_row = np.packbits(bits, bitorder="little").view(np.int32)  # only EOS allowed
        self._buffer = np.zeros((0, num_words), np.int32)
        self._is_terminated = False

    @property
    def is_terminated(self) -> bool:
        """EOS was committed: the output is whole and nothing may follow."""
        return self._is_terminated

    def advance(self, tokens: list[int]) -> None:
        """Commits verified output tokens; an EOS ends the output, and what follows it in `tokens`
        (a step's bonus after an accepted EOS) is not output. A token the grammar rejects raises
        ValueError and commits nothing."""
        if not tokens:
            return
        if self._is_terminated:
            raise ValueError(f"{self.kind}: token {tokens[0]} after the output ended")
        end = next((i for i, t in enumerate(tokens) if t in self._eos), None)
        tokens = list(tokens if end is None else tokens[: end + 1])
        body, is_end = (tokens[:-1], True) if tokens[-1] in self._eos else (tokens, False)
        bad = next((i for i, t in enumerate(body) if t in self._eos or not 0 <= t < self._vocab_size), len(body))
        num_ok = self._matcher.validate_tokens(body[:bad])
        if num_ok < len(body):
            raise ValueError(f"{self.kind}: the grammar rejects token {tokens[num_ok]} (position {num_ok} of "
                             f"{len(tokens)})")
        if not self._matcher.consume_tokens(body):
            raise ValueError(f"{self.kind}: the matcher failed on {body}: {self._matcher.get_error()}")
        if is_end and not self._matcher.is_accepting():
            self._matcher.rollback(len(body))
            raise ValueError(f"{self.kind}: EOS where the text is not accepted (position {len(body)})")
        self._output.extend(body)
        self._is_terminated = is_end

    def tree_masks(self, tokens: list[int], parents: list[int]) -> TreeMasks:
        """Row i: the tokens allowed right after node i's path (node 0, the root, is the current
        state). Walks the tree depth first with the state's matcher and rolls it back."""
        num_nodes = len(tokens)
        if num_nodes == 0 or len(parents) != num_nodes or parents[0] != -1:
            raise ValueError("tree_masks: needs a root (parents[0] == -1) and one parent per token")
        children: list[list[int]] = [[] for _ in range(num_nodes)]
        for i in range(1, num_nodes):
            p = parents[i]
            if not 0 <= p < i:
                raise ValueError(f"tree_masks: node {i} has parent {p}; parents must come first")
            children[p].append(i)
        if self._buffer.shape[0] < num_nodes:
            self._buffer = np.zeros((max(num_nodes, 2 * self._buffer.shape[0]), self._eos_row.size), np.int32)
        rows = self._buffer[:num_nodes]
        valid = [False] * num_nodes
        valid[0] = True
        if self._is_terminated:
            rows[0] = self._eos_row
            return TreeMasks(valid, rows, self._vocab_size)
        self._fill(0, rows)
        if self._matcher.is_error():
            raise UserError(f"{self.kind}: {_message(self._matcher.get_error(), self.kind)}")
        self._walk(0, [], tokens, children, rows, valid)
        invalid = [i for i, ok in enumerate(valid) if not ok]
        if invalid:
            rows[invalid] = -1  # allow everything: never used, and never a row of only -inf
        return TreeMasks(valid, rows, self._vocab_size)

    def _walk(self, node: int, path: list[int], tokens, children, rows, valid) -> None:
        """Fills the rows below `node`, whose row is filled and whose path the matcher is at."""
        for child in children[node]:
            token = tokens[child]
            if not _has_bit(rows[node], token, self._vocab_size):
                continue
            if token in self._eos:
                valid[child] = True
                rows[child] = self._eos_row
                continue
            if self._matcher.consume_token(token):
                self._fill(child, rows)
            if self._matcher.is_error():  # a step out of fuel: this branch stays invalid
                self._restore(path)
                continue
            valid[child] = True
            path.append(token)
            self._walk(child, path, tokens, children, rows, valid)
            path.pop()
            self._matcher.rollback(1)

    def _fill(self, node: int, rows: np.ndarray) -> None:
        row = rows[node]
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def _restore(self, path: list[int]) -> None:
        """A matcher in error stays there: a fresh one replays the output and then `path`."""
        self._matcher = self._compiled.new_matcher()
        self._matcher.consume_tokens(self._output + path)

    def forced(self, max_tokens: int) -> list[int]:
        """The tokens of the text the grammar forces from here, up to a branch point and at most
        `max_tokens`: the tokenizer's tokens of that text, less a last token that what follows
        could merge into; where the grammar can only end after it, all of them and the first EOS.
        The state is unchanged."""
        if self._is_terminated or max_tokens <= 0:
            return []
        matcher, tokenizer = self._matcher, self._compiled.tokenizer
        text = matcher.compute_ff_bytes()
        whole = tokenizer.tokenize_bytes(text) if text else []
        num_ok = matcher.validate_tokens(whole)
        if num_ok == len(whole):
            matcher.consume_tokens(whole)
            can_only_end = matcher.is_stopped() and not matcher.is_error()
            matcher.rollback(len(whole))
            if can_only_end:
                return (whole + [self._eos_token_ids[0]])[:max_tokens]
        tokens = tokenizer.tokenize_partial(text, recent_tokens=self._output[-8:])[0] if text else []
        return tokens[: min(max_tokens, matcher.validate_tokens(tokens))]


class GrammarCompiler:
    """Compiles constraints for one tokenizer on a small pool of worker threads, each compile
    bounded by `timeout_s`, and caches them (LRU by `Constraint.key`). Thread-safe: a key
    compiled by several threads at once compiles once."""

    def __init__(self, model: str | Path | ModelSource, vocab_size: int, eos_token_ids: tuple[int, ...],
                 timeout_s: float = limits.DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
                 cache_size: int = limits.DEFAULT_GRAMMAR_CACHE_SIZE, num_workers: int = NUM_COMPILE_WORKERS):
        """Over the tokenizer of a checkpoint directory or a GGUF file (`model_source.resolve`)."""
        source = resolve(model)
        if source.tokenizer_file is None:
            raise source.no_tokenizer()
        self._setup(Tokenizer.from_file(str(source.tokenizer_file)), vocab_size, eos_token_ids, timeout_s,
                    cache_size, num_workers)

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...],
                       timeout_s: float = limits.DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
                       cache_size: int = limits.DEFAULT_GRAMMAR_CACHE_SIZE,
                       num_workers: int = NUM_COMPILE_WORKERS) -> "GrammarCompiler":
        compiler = cls.__new__(cls)
        compiler._setup(tokenizer, vocab_size, eos_token_ids, timeout_s, cache_size, num_workers)
        return compiler

    def _setup(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], timeout_s: float,
               cache_size: int, num_workers: int) -> None:
        num_tokens = tokenizer.get_vocab_size(with_added_tokens=True)
        if vocab_size < num_tokens:
            raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {num_tokens} tokens")
        if not eos_token_ids or any(not 0 <= t < num_tokens for t in eos_token_ids):
            raise ValueError(f"eos_token_ids must be tokens of the tokenizer, got {eos_token_ids}")
        if timeout_s <= 0 or cache_size < 1 or num_workers < 1:
            raise ValueError("timeout_s must be > 0, cache_size and num_workers >= 1")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.num_workers = num_workers
        plain = Tokenizer.from_str(tokenizer.to_str())  # a copy, without padding or truncation
        plain.no_padding()
        plain.no_truncation()
        self._tokenizer = llguidance.LLTokenizer(plain.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._failed: OrderedDict[tuple, tuple[float, str]] = OrderedDict()  # key -> (until, message)
        self._pending: dict[tuple, Future] = {}
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []

    def new_state(self, constraint: Constraint) -> GrammarState:
        return GrammarState(self.compile(constraint), self.vocab_size, self.eos_token_ids)

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        key = constraint.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
            failed = self._failed.get(key)
            if failed is not None:
                if failed[0] > time.monotonic():
                    raise UserError(failed[1])
                del self._failed[key]
            future = self._pending.get(key)
            if future is None:
                future = self._pending[key] = Future()
                self._jobs.put((constraint, future))
                if len(self._workers) < self.num_workers:
                    worker = threading.Thread(target=self._work, name="grammar-compile", daemon=True)
                    self._workers.append(worker)
                    worker.start()
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeoutError:
            message = f"{constraint.kind}: took longer than {self.timeout_s:g}s to compile"
            with self._lock:
                self._remember_failure(key, message)
                if self._pending.get(key) is future:
                    del self._pending[key]
            raise UserError(message) from None

    def close(self) -> None:
        """Stops the workers once the compiles queued before it are done."""
        with self._lock:
            for _ in self._workers:
                self._jobs.put(None)
            self._workers = []

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            constraint, future = job
            key = constraint.key
            try:
                compiled = self._compile_now(constraint)
            except UserError as exc:
                with self._lock:
                    if self._pending.get(key) is future:
                        del self._pending[key]
                        self._remember_failure(key, str(exc))
                future.set_exception(exc)
            except BaseException as exc:  # a bug, not the input: reported, not remembered
                with self._lock:
                    if self._pending.get(key) is future:
                        del self._pending[key]
                future.set_exception(exc)
            else:
                with self._lock:
                    if self._pending.get(key) is future:  # not timed out meanwhile
                        del self._pending[key]
                        self._cache[key] = compiled
                        while len(self._cache) > self.cache_size:
                            self._cache.popitem(last=False)
                future.set_result(compiled)

    def _remember_failure(self, key: tuple, message: str) -> None:
        self._failed[key] = (time.monotonic() + FAILED_TTL_S, message)
        self._failed.move_to_end(key)
        while len(self._failed) > self.cache_size:
            self._failed.popitem(last=False)

    def _compile_now(self, constraint: Constraint) -> CompiledGrammar:
        kind = constraint.kind
        matcher = llguidance.LLMatcher(self._tokenizer, _grammar_text(constraint), log_level=0, limits=self._limits)
        if matcher.is_error():
            raise _input_error(kind, _message(matcher.get_error(), kind))
        row = np.zeros((self.vocab_size + 31) // 32, np.int32)
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)  # builds the lexer's start, and checks
        if matcher.is_error():
            detail = _message(matcher.get_error(), kind)
            raise UserError(f"{kind}: matches no text" if "NoExtension" in detail else f"{kind}: {detail}")
        return CompiledGrammar(constraint.key, matcher, self._tokenizer, threading.Lock())


def _grammar_text(constraint: Constraint) -> str:
    """The constraint as an llguidance grammar (JSON), nested under a start with llguidance's forcing on."""
    kind, spec = constraint.kind, constraint.spec
    try:
        if kind == "json_schema":
            try:
                schema = json.loads(spec)
            except ValueError as exc:
                raise UserError(f"json_schema: invalid schema (not JSON: {exc})") from None
            layout = JSON_LAYOUT if isinstance(schema, dict) else None  # `true` and `false` take no options
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=layout)
        elif kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_LAYOUT)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        elif kind == "choice":  # Lark string literals take JSON's escapes
            grammar = llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in constraint.choices))
        else:
            grammar = llguidance.grammar_from("grammar", spec)
    except ValueError as exc:
        if isinstance(exc, UserError):
            raise
        raise _input_error(kind, _message(str(exc), kind)) from None
    grammars = json.loads(grammar)["grammars"] if grammar.lstrip().startswith("{") else [{"lark_grammar": grammar}]
    return json.dumps({"grammars": [{"lark_grammar": '%llguidance {"no_forcing": false}\nstart: @constraint'},
                                    {**grammars[0], "name": "constraint"}, *grammars[1:]]})


def _input_error(kind: str, detail: str) -> UserError:
    return UserError(f"json_schema: invalid schema ({detail})" if kind == "json_schema" else f"{kind}: {detail}")


def _message(error: str, kind: str) -> str:
    """llguidance's error on one line: its first line and its `error:` line (regex), without the
    source excerpt, and without a position in a grammar the caller did not write."""
    lines = [line.strip() for line in error.splitlines()]
    lines = [line for line in lines if line and line != "<non-verbose/>" and not re.match(r"\d+ \||\^+$", line)]
    reason = next((line[len("error:"):].strip() for line in lines if line.startswith("error:")), None)
    text = f"{lines[0]} {reason}" if reason and lines else " ".join(lines)
    if kind != "grammar":
        text = re.sub(r"^at \d+\(\d+\): ", "", text)
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."
