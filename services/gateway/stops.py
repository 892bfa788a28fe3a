"""Token ids to streamable text, with stop sequences applied at the text level.

Generation ends *before* the first occurrence of any stop string, and at a stop token id: that
token is the last of the output's token ids, and, like a stop string, its text is not part of
the output's text. While streaming, the visible
text holds back (a) a trailing incomplete UTF-8 character and (b) any suffix that could still
grow into a stop string, so no stop text ever reaches the client.

The visible text after k tokens is a pure function of the first k token ids (tokens are pushed
one at a time, always), so a resumed stream can rebuild exactly the text a client already holds
at a given token offset: `text_at(k)`.

Detokenization is incremental (the prefix/read-offset scheme of HF text-generation-inference and
vLLM): each push decodes only a short window of recent tokens, with a few settled tokens before
it as context for the decoder, and the stop strings are searched for only in the newly exposed
text plus the longest stop string's length of what came before it. A push costs the length of
that window, not of the whole output.
"""

from __future__ import annotations

from bisect import bisect_right

from specinfer.tokenizer import TextTokenizer

REPLACEMENT_CHAR = "\ufffd"  # what the decoder shows for an incomplete (or invalid) UTF-8 sequence


def first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Character index of the earliest stop-string occurrence in `text`, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def held_back_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class AppendOnlyText:
    """A string that only grows: appending a piece or reading a slice costs that many characters."""

    def __init__(self):
        self._pieces: list[str] = []
        self._ends: list[int] = []  # _ends[i] = length of the text up to and including piece i

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __str__(self) -> str:
        return "".join(self._pieces)

    def append(self, piece: str) -> None:
        if piece:
            self._ends.append(len(self) + len(piece))
            self._pieces.append(piece)

    def slice(self, start: int, stop: int | None = None) -> str:
        """`str(self)[start:stop]` for 0 <= start."""
        stop = len(self) if stop is None else min(stop, len(self))
        if start >= stop:
            return ""
        first = bisect_right(self._ends, start)  # the piece holding character `start`
        base = self._ends[first] - len(self._pieces[first])
        last = bisect_right(self._ends, stop - 1)  # the piece holding character `stop - 1`
        return "".join(self._pieces[first:last + 1])[start - base:stop - base]


class TextState:
    """The growing output of one request: token ids, visible text, and the stop-sequence state.

    The decoded text is `_settled + _tail`: `_settled` is the text of `ids[:_read]` and never
    changes once written; `_tail` is the text the tokens after `_read` add, re-decoded on every
    push until it ends on a complete character. `ids[_prefix:_read]` are decoded along with the
    tail as context (a decoder may render a token differently at the start of its input).
    """

    def __init__(self, tokenizer: TextTokenizer, stops: tuple[str, ...] = (), stop_token_ids: tuple[int, ...] = ()):
        self.tokenizer = tokenizer
        self.stops = stops
        self.stop_token_ids = frozenset(stop_token_ids)
        self.ids: list[int] = []
        self.visible_lens = [0]  # visible_lens[k] = len(visible text after k tokens)
        self.is_stopped = False
        self._visible = AppendOnlyText()
        self._settled = AppendOnlyText()
        self._tail = ""
        self._prefix = 0
        self._read = 0
        self._prefix_text_len = 0  # len(decode(ids[_prefix:_read]))
        self._agreed = 0  # the visible text's first _agreed characters are _settled's
        self._max_stop_len = max((len(s) for s in stops), default=0)
        self._stop_text: str | None = None

    @classmethod
    def replay(cls, tokenizer: TextTokenizer, stops: tuple[str, ...], ids: tuple[int, ...] | list[int],
               stop_token_ids: tuple[int, ...] = ()) -> "TextState":
        state = cls(tokenizer, stops, stop_token_ids)
        for t in ids:
            if state.push(t):
                break
        return state

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def visible(self) -> str:
        """The text a client may hold now (costs its length: for the end of a request, not per token)."""
        return str(self._visible)

    def push(self, token_id: int) -> bool:
        """Adds one token; True if it completed a stop string or is a stop token (the caller must
        stop generating)."""
        if self.is_stopped:
            raise RuntimeError("push after a stop sequence matched")
        self.ids.append(int(token_id))
        if token_id in self.stop_token_ids:  # the text so far is final; the token's own is left out
            self.is_stopped = True
            self._stop_text = self._text(0)
            self._advance(len(self._stop_text))
            return True
        num_settled_before = len(self._settled)
        self._decode_window()
        if self.stops:
            # Every earlier occurrence would lie inside text already searched (settled before this
            # push), so only text that ends past it can hold a new one.
            start = max(0, num_settled_before - (self._max_stop_len - 1))
            pos = first_stop(self._text(start), self.stops)
            if pos is not None:
                self.is_stopped = True
                self._stop_text = self._text(0, start + pos)
                self._advance(start + pos)
                return True
        safe_len = len(self._settled) + len(self._tail.rstrip(REPLACEMENT_CHAR))
        held = 0
        if self.stops:
            held = held_back_len(self._text(max(0, safe_len - (self._max_stop_len - 1)), safe_len), self.stops)
        self._advance(safe_len - held)
        return False

    def _decode_window(self) -> None:
        window = self.tokenizer.decode(self.ids[self._prefix:])
        if len(window) > self._prefix_text_len and not window.endswith(REPLACEMENT_CHAR):
            self._settled.append(window[self._prefix_text_len:])
            self._tail = ""
            self._prefix, self._read = self._read, len(self.ids)
            self._prefix_text_len = len(self.tokenizer.decode(self.ids[self._prefix:self._read]))
        else:
            self._tail = window[self._prefix_text_len:]

    def _text(self, start: int, stop: int | None = None) -> str:
        """The decoded text so far, `[start:stop]`."""
        num_settled = len(self._settled)
        stop = num_settled + len(self._tail) if stop is None else stop
        head = self._settled.slice(start, stop) if start < num_settled else ""
        return head + self._tail[max(0, start - num_settled):max(0, stop - num_settled)]

    def _advance(self, candidate_len: int) -> None:
        """Shows the decoded text up to `candidate_len`, unless that would retract text a client
        may already hold (then the visible text stays as it is)."""
        num_visible = len(self._visible)
        if candidate_len >= num_visible and \
                self._text(self._agreed, num_visible) == self._visible.slice(self._agreed, num_visible):
            self._visible.append(self._text(num_visible, candidate_len))
            self._agreed = min(candidate_len, len(self._settled))
        self.visible_lens.append(len(self._visible))

    def text_at(self, num_tokens: int) -> str:
        """The visible text after the first `num_tokens` tokens."""
        return self._visible.slice(0, self.visible_lens[num_tokens])

    def text_since(self, num_chars: int, num_tokens: int) -> str:
        """`text_at(num_tokens)[num_chars:]`, at the cost of its length."""
        return self._visible.slice(num_chars, self.visible_lens[num_tokens])

    def final_text(self) -> str:
        """The complete output: cut before the stop string, or everything, nothing held back."""
        if self._stop_text is not None:
            return self._stop_text
        return self._text(0)
