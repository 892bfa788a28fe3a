"""A client's request at the gateway, and the checks that need neither a tokenizer nor the store.

The parameters are `specinfer.params.GenerationParams` (converted from protobuf at the edge,
services/gateway/server.py), which validate themselves; `validate_request` adds what only the
gateway knows: ids, a non-empty prompt of a size the tokenizer may be given, and the
deployment's `RequestLimits`. A bad field raises `UserError` (gRPC INVALID_ARGUMENT) whose
message starts with the field's name. Every check here is cheap: sizes come before contents.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from specinfer.errors import UserError
from specinfer.limits import RequestLimits, check_id, check_ssm_names, check_text_size
from specinfer.params import GenerationParams


@dataclass(frozen=True)
class NewRequest:
    """A client's GenerateRequest, converted from protobuf at the edge."""

    prompt: str
    params: GenerationParams
    session_id: str = ""
    request_id: str = ""  # empty = server-assigned


def validate_request(req: NewRequest, limits: RequestLimits) -> NewRequest:
    """Checks every field that needs no tokenizer or store; returns it with max_new_tokens resolved."""
    if req.request_id:
        check_id(req.request_id)
    if req.session_id:
        check_id(req.session_id, "session_id")
    if not req.prompt:
        raise UserError("prompt: must be non-empty")
    check_text_size(req.prompt, "prompt", limits)  # before the tokenizer sees it
    check_ssm_names(req.params.ssm_names)
    return replace(req, params=req.params.checked(limits))
