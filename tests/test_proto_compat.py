"""specinfer.v1 is add-only: every field and enum value recorded in proto_v1_fields.txt keeps its
name, number, type and cardinality (new ones may be added; record them there)."""

from __future__ import annotations

from pathlib import Path

from specinfer.v1 import specinfer_pb2 as pb

RECORDED = Path(__file__).with_name("proto_v1_fields.txt")


def fields_of(fd) -> set[str]:
    out = set()
    for name, m in fd.message_types_by_name.items():
        for f in m.fields:
            out.add(f"{name}.{f.name} = {f.number} type={f.type} repeated={int(f.is_repeated)}")
    for name, e in fd.enum_types_by_name.items():
        for v in e.values:
            out.add(f"{name}.{v.name} = {v.number}")
    return out


def test_every_recorded_field_is_still_there_unchanged():
    recorded = {line for line in RECORDED.read_text().splitlines() if line}
    current = fields_of(pb.DESCRIPTOR)
    assert not recorded - current, sorted(recorded - current)
    assert len(recorded) > 100  # the record is the whole contract, not a sample of it


def test_an_old_clients_bytes_parse_as_the_same_request():
    """A GenerateRequest as an older client serializes it: the new fields read as unset."""
    old = pb.GenerateRequest(prompt="def add(", max_tokens=8, stop=["\n"], session_id="s1")
    req = pb.GenerateRequest.FromString(old.SerializeToString())
    assert req == old and not req.HasField("n") and not req.HasField("logprobs") and not req.stop_token_ids
