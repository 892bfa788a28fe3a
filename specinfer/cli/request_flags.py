"""The request flags `specinfer generate` and `specinfer client generate` share: the logits
processors (penalties, min_p) and structured output (a JSON Schema file, a regular expression,
choices, a grammar file), read into the same domain types whichever command sends them.

A bad value is a UserError naming the flag (the commands print it on one line, exit code 2).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specinfer.errors import UserError
from specinfer.params import Constraint, SamplingParams
from specinfer.serving.shared_flags import add_declared, add_exclusive, constraint_flags, processor_flags

PROCESSOR_FLAGS = {"frequency_penalty": "--frequency-penalty", "presence_penalty": "--presence-penalty",
                   "repetition_penalty": "--repetition-penalty", "min_p": "--min-p"}
CONSTRAINT_FLAGS = {"json_schema": "--json-schema", "regex": "--regex", "choice": "--choice", "grammar": "--grammar"}


def add_request_flags(p: argparse.ArgumentParser) -> None:
    """The logits processors, and structured output: one of --json-schema, --regex, --choice
    (repeatable) or --grammar."""
    add_declared(p, *processor_flags())
    add_exclusive(p, *constraint_flags())


def processor_values(args: argparse.Namespace) -> dict[str, float]:
    return {name: getattr(args, name) for name in PROCESSOR_FLAGS}


def sampling_from_flags(args: argparse.Namespace, **sampling) -> SamplingParams:
    """SamplingParams of `sampling` and the processor flags; a bad value names its flag."""
    try:
        return SamplingParams(**sampling, **processor_values(args))
    except UserError as exc:
        message = str(exc)
        for name, flag in {**PROCESSOR_FLAGS, "temperature": "--temperature", "top_p": "--top-p",
                           "top_k": "--top-k"}.items():
            if message.startswith(f"sampling.{name}:"):
                message = flag + message[len(f"sampling.{name}"):]
        raise UserError(message) from None


def _read(path: Path, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise UserError(f"{flag}: cannot read {path}: {reason}") from None


def constraint_fields(args: argparse.Namespace) -> dict:
    """The structured-output flag given, as the Python client's keyword argument (with the
    files read): {} when none is."""
    if getattr(args, "json_schema", None) is not None:
        text = _read(args.json_schema, "--json-schema")
        try:
            json.loads(text)
        except ValueError as exc:
            raise UserError(f"--json-schema: {args.json_schema} is not valid JSON ({exc})") from None
        return {"json_schema": text}
    if getattr(args, "regex", None) is not None:
        return {"regex": args.regex}
    if getattr(args, "choice", None):
        return {"choice": list(args.choice)}
    if getattr(args, "grammar", None) is not None:
        return {"grammar": _read(args.grammar, "--grammar")}
    return {}


def constraint_from_flags(args: argparse.Namespace) -> Constraint | None:
    """The domain constraint of the structured-output flags; a bad one names its flag."""
    fields = constraint_fields(args)
    if not fields:
        return None
    ((kind, value),) = fields.items()
    try:
        return Constraint(kind, choices=tuple(value)) if kind == "choice" else Constraint(kind, value)
    except UserError as exc:
        raise UserError(f"{CONSTRAINT_FLAGS[kind]}: {str(exc).removeprefix(kind + ':').strip()}") from None
