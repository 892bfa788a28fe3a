"""Tokenizer loading (HF `tokenizer.json`, or a GGUF's, made from its metadata); the gateway's
streaming detokenizer is in services/gateway/stops.py.

SSMs must share the LLM's vocabulary (SpecInfer Section 3: the SSM proposes token ids that the
LLM verifies), so `check_same_vocab` compares the two tokenizers' vocabularies.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from specinfer.errors import UserError
from specinfer.model_source import ModelSource, resolve


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...] = (), bos_token_id: int | None = None):
        self.tok = tokenizer
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id

    @classmethod
    def from_dir(cls, model: str | Path | ModelSource, eos_token_ids: tuple[int, ...] = ()) -> "TextTokenizer":
        """The tokenizer of a checkpoint directory or a GGUF file (`model_source.resolve`)."""
        source = resolve(model)
        if source.tokenizer_file is None:
            raise source.no_tokenizer()
        tok = Tokenizer.from_file(str(source.tokenizer_file))
        bos = None
        cfg_path = source.meta_dir / "tokenizer_config.json"
        if cfg_path.is_file():
            cfg = json.loads(cfg_path.read_text())
            if cfg.get("add_bos_token") and cfg.get("bos_token"):
                bos_text = cfg["bos_token"] if isinstance(cfg["bos_token"], str) else cfg["bos_token"].get("content")
                bos = tok.token_to_id(bos_text)
        return cls(tok, eos_token_ids, bos)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not): a long text tokenizing
        # on one server thread does not stall every other thread of the process.
        ids = self.tok.encode_batch([text])[0].ids
        if self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


def check_same_vocab(llm_dir: str | Path, ssm_dir: str | Path) -> None:
    """Raises UserError if both models ship tokenizers with different vocabularies."""
    a, b = resolve(llm_dir).tokenizer_file, resolve(ssm_dir).tokenizer_file
    if a is None or b is None:
        return
    if Tokenizer.from_file(str(a)).get_vocab() != Tokenizer.from_file(str(b)).get_vocab():
        raise UserError(f"SSM {ssm_dir} has a different vocabulary from the LLM {llm_dir}")
