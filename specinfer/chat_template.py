"""Chat templates: a checkpoint's `chat_template`, rendered in a Jinja sandbox.

The template comes from the checkpoint's `tokenizer_config.json` (`chat_template`: a string, or
a list of named templates of which "default" is used) or a `chat_template.jinja` file beside
it, the way Hugging Face tokenizers ship them (a GGUF's `tokenizer.chat_template`, through the
files `specinfer.model_source` makes of its metadata); or from a file the gateway is given
(`--chat-template`, as vLLM takes it), which overrides the checkpoint's, so a base model that
ships none can serve chat. Its `bos_token` and `eos_token` are still the checkpoint's. It is
checked when the gateway starts: a missing, unreadable or invalid file stops it there. It is
rendered with Jinja's
`ImmutableSandboxedEnvironment`: a template can format the messages but cannot call into Python,
reach attributes outside the sandbox or mutate its inputs. It is never executed as code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specinfer.errors import UserError
from specinfer.model_source import resolve

TEMPLATE_FILE = "chat_template.jinja"


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _special_token(cfg: dict, name: str) -> str:
    value = cfg.get(name) or ""
    return value.get("content", "") if isinstance(value, dict) else str(value)


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str = ""
    eos_token: str = ""

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ChatTemplate | None":
        """The model's template (a checkpoint directory's, or a GGUF's `tokenizer.chat_template`),
        or None when it has none; UserError if it is unreadable."""
        model_dir = resolve(model_dir).meta_dir
        cfg = _tokenizer_config(model_dir)
        source = cfg.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": "..."}]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not source and (model_dir / TEMPLATE_FILE).is_file():
            source = (model_dir / TEMPLATE_FILE).read_text()
        if not source or not isinstance(source, str):
            return None
        return cls(source, _special_token(cfg, "bos_token"), _special_token(cfg, "eos_token"))

    @classmethod
    def from_file(cls, path: Path, model_dir: Path | None, flag: str = "--chat-template") -> "ChatTemplate":
        """A template file overriding the checkpoint's (the special tokens stay the checkpoint's);
        UserError naming `flag` when the file is missing, unreadable, empty or does not compile."""
        try:
            source = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise UserError(f"{flag}: cannot read the chat template {path}: {reason}") from None
        if not source.strip():
            raise UserError(f"{flag}: the chat template {path} is empty")
        cfg = _tokenizer_config(resolve(model_dir).meta_dir) if model_dir is not None else {}
        template = cls(source, _special_token(cfg, "bos_token"), _special_token(cfg, "eos_token"))
        try:
            _compile(source)
        except TemplateError as exc:
            raise UserError(f"{flag}: the chat template {path} does not compile: {exc}") from None
        return template

    def compile(self):
        """The compiled template; UserError naming the problem when it does not compile."""
        try:
            return _compile(self.source)
        except TemplateError as exc:
            raise UserError(f"the model's chat template does not compile: {exc}") from None


def _tokenizer_config(model_dir: Path) -> dict:
    cfg_path = model_dir / "tokenizer_config.json"
    try:
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise UserError(f"{cfg_path}: cannot read the tokenizer config: {exc}") from None
    return cfg if isinstance(cfg, dict) else {}


def _compile(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


class ChatRenderer:
    """Renders message lists with one compiled template (compiled once, at start-up)."""

    def __init__(self, template: ChatTemplate | None):
        self.template = template
        self._compiled, self._error = None, None
        if template is not None:
            try:
                self._compiled = template.compile()
            except UserError as exc:
                self._error = str(exc)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`; UserError when the model has no usable template or the
        template refuses the conversation (its `raise_exception`)."""
        if self.template is None:
            raise UserError("messages: this model has no chat template (no chat_template in its "
                            "tokenizer_config.json): start the gateway with --chat-template FILE, or use "
                            "/v1/completions with a plain prompt")
        if self._compiled is None:
            raise UserError(f"messages: {self._error}")
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.template.bos_token, eos_token=self.template.eos_token)
        except TemplateError as exc:
            raise UserError(f"messages: the model's chat template refused them: {exc}") from None
