"""The gateway's streaming detokenizer (services/gateway/stops.py): incremental, and identical to
decoding the whole output on every token.

The reference below is that definition: after each token, decode all ids, cut before the first
stop string, hold back a trailing incomplete character and any suffix that may grow into a stop
string, never retract visible text. The incremental `TextState` must agree with it token by
token on random sequences (multi-byte characters split over tokens, invalid bytes, special
tokens, stop strings spanning token boundaries), while decoding only a bounded window per token.
"""

from __future__ import annotations

import random

import pytest

from services.gateway.stops import AppendOnlyText, TextState, first_stop, held_back_len
from specinfer.tokenizer import TextTokenizer
from util import add_tokenizer

VOCAB = 400
CORPUS = ["the quick brown fox jumps over the lazy dog. ", "hello world, hello gateway. ",
          "stop here and go on. ", "caf\u00e9 na\u00efve r\u00e9sum\u00e9. "] * 30
SNIPPETS = ["the lazy dog", " caf\u00e9 \u20ac5", "na\u00efve r\u00e9sum\u00e9", " hello\n", "\u00fc\u2192\u00e9\u00e9",
            " stop here", "go on. ", "\U0001f600 ok"]


class FullDecodeTextState:
    """The definition: every push decodes the whole output."""

    def __init__(self, tokenizer: TextTokenizer, stops: tuple[str, ...]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.visible = ""
        self.visible_lens = [0]
        self.is_stopped = False
        self.stop_text: str | None = None

    def push(self, token_id: int) -> bool:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        pos = first_stop(text, self.stops) if self.stops else None
        if pos is not None:
            self.is_stopped, self.stop_text = True, text[:pos]
            self._advance(self.stop_text)
            return True
        safe = text.rstrip("\ufffd")
        self._advance(safe[: len(safe) - held_back_len(safe, self.stops)] if self.stops else safe)
        return False

    def _advance(self, candidate: str) -> None:
        if candidate.startswith(self.visible):
            self.visible = candidate
        self.visible_lens.append(len(self.visible))

    def final_text(self) -> str:
        return self.stop_text if self.stop_text is not None else self.tokenizer.decode(self.ids)


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every decode call."""

    def __init__(self, inner: TextTokenizer):
        self.inner = inner
        self.decoded_lens: list[int] = []

    def decode(self, ids: list[int]) -> str:
        self.decoded_lens.append(len(ids))
        return self.inner.decode(ids)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> TextTokenizer:
    d = tmp_path_factory.mktemp("text_tok")
    add_tokenizer(d, VOCAB, CORPUS)
    return TextTokenizer.from_dir(d)


def byte_tokens(tokenizer: TextTokenizer, text: str) -> list[int]:
    """`text`'s UTF-8 bytes as one byte-level token each (so its characters split over tokens)."""
    out = [tokenizer.tok.token_to_id(ch) for piece in tokenizer.tok.encode(text).tokens for ch in piece]
    assert None not in out and tokenizer.decode(out) == text
    return out


def random_ids(rng: random.Random, tokenizer: TextTokenizer) -> list[int]:
    ids: list[int] = []
    while len(ids) < 60:
        kind = rng.random()
        snippet = rng.choice(SNIPPETS)
        if kind < 0.45:
            ids += tokenizer.encode(snippet)
        elif kind < 0.75:
            ids += byte_tokens(tokenizer, snippet)
        else:  # anything: invalid bytes, special tokens (decoded as nothing), merges
            ids += [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 4))]
    return ids


def random_stops(rng: random.Random, text: str) -> tuple[str, ...]:
    stops = []
    for _ in range(rng.randint(0, 3)):
        if text and rng.random() < 0.8:
            start = rng.randrange(len(text))
            stops.append(text[start:start + rng.randint(1, 6)])
        else:
            stops.append(rng.choice(["zzq", "\u00e9\u00e9\u00e9x", " the lazy cat"]))
    return tuple(stops)


def test_incremental_text_matches_full_decode(tokenizer):
    num_stopped = num_spanning = 0
    for seed in range(200):
        rng = random.Random(seed)
        ids = random_ids(rng, tokenizer)
        stops = random_stops(rng, tokenizer.decode(ids))
        ref, state = FullDecodeTextState(tokenizer, stops), TextState(tokenizer, stops)
        for k, t in enumerate(ids):
            is_stop = ref.push(t)
            assert state.push(t) == is_stop, (seed, k)
            assert state.visible == ref.visible, (seed, k)
            if is_stop:
                num_stopped += 1
                last_alone = tokenizer.decode([t])
                num_spanning += not any(s in last_alone for s in stops)
                break
        assert state.is_stopped == ref.is_stopped and state.ids == ref.ids
        assert state.visible_lens == ref.visible_lens
        assert state.final_text() == ref.final_text(), seed
        for k in range(len(state.ids) + 1):
            want = ref.visible[: ref.visible_lens[k]]
            assert state.text_at(k) == want
            cut = rng.randint(0, len(want))
            assert state.text_since(cut, k) == want[cut:]
        replayed = TextState.replay(tokenizer, stops, ids)
        assert replayed.visible == ref.visible and replayed.final_text() == ref.final_text()
    assert num_stopped >= 80 and num_spanning >= 20  # the cases that matter were exercised


def test_text_state_decodes_incrementally(tokenizer):
    """The decoder sees a bounded window per token: the work grows linearly with the output."""
    rng = random.Random(7)
    ids = []
    while len(ids) < 2000:
        snippet = rng.choice(SNIPPETS)
        ids += byte_tokens(tokenizer, snippet) if rng.random() < 0.5 else tokenizer.encode(snippet)
    ids = ids[:2000]

    def decoded_lens(n: int) -> list[int]:
        counting = CountingTokenizer(tokenizer)
        state = TextState(counting, ("the lazy cat", "\u00e9\u00e9x"))  # prefixes match often, never whole
        for t in ids[:n]:
            assert not state.push(t)
        assert state.final_text() == tokenizer.decode(ids[:n])
        return counting.decoded_lens

    short, long = decoded_lens(500), decoded_lens(2000)
    assert max(long) <= 8  # never more than a few tokens at a time (one character's bytes plus context)
    assert len(long) <= 2 * 2000 and sum(long) <= 6 * 2000
    assert sum(long) <= 4.5 * sum(short)  # 4x the tokens, about 4x the work (decoding all would be 16x)


def test_append_only_text_slices():
    rng = random.Random(3)
    text, whole = AppendOnlyText(), ""
    for _ in range(300):
        piece = "".join(rng.choice("ab\u00e9\U0001f600") for _ in range(rng.randint(0, 4)))
        text.append(piece)
        whole += piece
        assert len(text) == len(whole)
        start = rng.randint(0, len(whole))
        stop = rng.randint(0, len(whole) + 2)
        assert text.slice(start, stop) == whole[start:stop] and text.slice(start) == whole[start:]
    assert str(text) == whole
