"""Token ids to streamable text, with stop sequences applied at the text level.

Generation ends *before* the first occurrence of any stop string. While streaming, the visible
text holds back (a) a trailing incomplete UTF-8 character and (b) any suffix that could still
grow into a stop string, so no stop text ever reaches the client.

The visible text after k tokens is a pure function of the first k token ids (tokens are pushed
one at a time, always), so a resumed stream can rebuild exactly the text a client already holds
at a given token offset: `text_at(k)`.
"""

from __future__ import annotations

from specinfer.tokenizer import TextTokenizer


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


class TextState:
    """The growing output of one request: token ids, visible text, and the stop-sequence state."""

    def __init__(self, tokenizer: TextTokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stops = stops
        self.ids: list[int] = []
        self.visible = ""
        self.visible_lens = [0]  # visible_lens[k] = len(visible text after k tokens)
        self.is_stopped = False
        self._stop_text: str | None = None

    @classmethod
    def replay(cls, tokenizer: TextTokenizer, stops: tuple[str, ...], ids: tuple[int, ...] | list[int]) -> "TextState":
        state = cls(tokenizer, stops)
        for t in ids:
            if state.push(t):
                break
        return state

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def push(self, token_id: int) -> bool:
        """Adds one token; True if it completed a stop string (the caller must stop generating)."""
        if self.is_stopped:
            raise RuntimeError("push after a stop sequence matched")
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids)
        pos = first_stop(text, self.stops) if self.stops else None
        if pos is not None:
            self.is_stopped = True
            self._stop_text = text[:pos]
            self._advance(self._stop_text)
            return True
        safe = text.rstrip("\ufffd")
        self._advance(safe[: len(safe) - held_back_len(safe, self.stops)] if self.stops else safe)
        return False

    def _advance(self, candidate: str) -> None:
        if candidate.startswith(self.visible):  # never retract text a client may already hold
            self.visible = candidate
        self.visible_lens.append(len(self.visible))

    def text_at(self, num_tokens: int) -> str:
        """The visible text after the first `num_tokens` tokens."""
        return self.visible[: self.visible_lens[num_tokens]]

    def final_text(self) -> str:
        """The complete output: cut before the stop string, or everything, nothing held back."""
        if self._stop_text is not None:
            return self._stop_text
        return self.tokenizer.decode(self.ids)
