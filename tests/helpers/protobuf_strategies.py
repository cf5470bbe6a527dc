"""Hypothesis strategies for arbitrary protobuf messages, built from their descriptors.

Every field may be set to any value its wire type allows (unknown enum numbers, NaN and
infinities, control characters and astral-plane text, empty and long lists), one member per
oneof at most, and proto3 `optional` fields may be absent. This is what a hostile or buggy
client can send through a generated stub; `raw_messages` adds what only a hand-made client
can (bytes that are no valid message at all).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

_INTS = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _mostly(plausible: st.SearchStrategy[Any], *hostile: st.SearchStrategy[Any]
            ) -> st.SearchStrategy[Any]:
    """Plausible values two times in three, so that examples with several fields still get
    past validation often enough to exercise what lies behind it."""
    return st.one_of(plausible, plausible, *hostile) if len(hostile) == 1 else st.one_of(
        plausible, plausible, st.one_of(*hostile))


def _integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted(v for v in {lo, hi, 0, 1, -1, 2**31 - 1, 2**32 - 1} if lo <= v <= hi)
    return _mostly(st.integers(max(lo, 0), min(hi, 64)), st.sampled_from(edges),
                   st.integers(lo, hi))


def _text() -> st.SearchStrategy[str]:
    ident = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=12)
    return _mostly(ident, st.text(max_size=24), st.text(alphabet="ab\x00\n", max_size=8),
                   st.integers(257, 4096).map(lambda n: "r" * n))


def _scalar(field: FieldDescriptor, depth: int, max_list: int) -> st.SearchStrategy[Any]:
    t = field.type
    if t in _INTS:
        return _integers(*_INTS[t])
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return _mostly(st.floats(0.0, 1.0, exclude_min=True),
                       st.floats(width=32 if t == FieldDescriptor.TYPE_FLOAT else 64))
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        return _text()
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=32)
    if t == FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return _mostly(st.sampled_from(known), _integers(-(2**31), 2**31 - 1))
    if t == FieldDescriptor.TYPE_MESSAGE:
        return _message(field.message_type, depth + 1, max_list)
    raise NotImplementedError(f"field type {t} of {field.full_name}")


def _field_values(desc: Descriptor, depth: int, max_list: int
                  ) -> dict[str, st.SearchStrategy[Any]]:
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in desc.fields:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, value = field.message_type.fields_by_name["key"], \
                field.message_type.fields_by_name["value"]
            fields[field.name] = st.dictionaries(_scalar(key, depth, max_list),
                                                 _scalar(value, depth, max_list), max_size=3)
        elif field.is_repeated and field.type in _INTS:
            # Mostly all small (token ids that exist), else anything at all.
            fields[field.name] = _mostly(
                st.lists(st.integers(0, 200), max_size=max_list),
                st.lists(_scalar(field, depth, max_list), max_size=max_list))
        elif field.is_repeated:
            fields[field.name] = st.lists(_scalar(field, depth, max_list), max_size=max_list)
        else:
            fields[field.name] = _scalar(field, depth, max_list)
    return fields


def _assign(msg: Message, name: str, value: Any) -> None:
    msg.ClearField(name)
    if isinstance(value, Message):
        getattr(msg, name).CopyFrom(value)
    elif isinstance(value, dict):
        getattr(msg, name).update(value)
    elif isinstance(value, list):
        getattr(msg, name).extend(value)
    else:
        setattr(msg, name, value)


def _message(desc: Descriptor, depth: int, max_list: int) -> st.SearchStrategy[Message]:
    cls = message_factory.GetMessageClass(desc)
    if depth > 3:
        return st.just(cls())
    fields = _field_values(desc, depth, max_list)
    oneofs = [[f.name for f in o.fields] for o in desc.oneofs if not o.name.startswith("_")]
    in_oneof = {n for names in oneofs for n in names}

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        msg = cls()
        chosen = {draw(st.sampled_from([None, *names])) for names in oneofs}
        for name, strategy in fields.items():
            if name in in_oneof and name not in chosen:
                continue
            if name not in in_oneof and not draw(st.booleans()):
                continue  # absent (proto3 optional) or left at its default
            _assign(msg, name, draw(strategy))
        return msg

    return build()


def _mutated(desc: Descriptor, depth: int, max_list: int) -> Any:
    """A function drawing a copy of `base` with about one field in six cleared or replaced
    by an arbitrary value (set sub-messages are mutated the same way, recursively). The
    simplest draw changes nothing, so hypothesis starts from the valid request."""
    fields = _field_values(desc, depth, max_list)
    subs = {f.name: _mutated(f.message_type, depth + 1, max_list) for f in desc.fields
            if f.type == FieldDescriptor.TYPE_MESSAGE and not f.is_repeated}

    def mutate(draw: st.DrawFn, base: Message) -> Message:
        msg = type(base)()
        msg.CopyFrom(base)
        for name, strategy in fields.items():
            if name in subs and msg.HasField(name) and draw(st.booleans()):
                getattr(msg, name).CopyFrom(subs[name](draw, getattr(msg, name)))
            elif draw(st.integers(0, 5)) == 5:
                if draw(st.integers(0, 3)) == 0:
                    msg.ClearField(name)
                else:
                    _assign(msg, name, draw(strategy))
        return msg

    return mutate


def messages(cls: type[Message], like: st.SearchStrategy[Message] | None = None,
             max_list: int = 12) -> st.SearchStrategy[Message]:
    """Instances of the generated message class `cls`: arbitrary ones, and when `like` draws
    plausible (valid) messages, mostly those with a few fields made arbitrary, so examples
    get past validation often enough to reach what lies behind it."""
    anything = _message(cls.DESCRIPTOR, 0, max_list)
    if like is None:
        return anything
    mutate = _mutated(cls.DESCRIPTOR, 0, max_list)

    @st.composite
    def near(draw: st.DrawFn) -> Message:
        return mutate(draw, draw(like))

    return _mostly(near(), anything)


def raw_messages(cls: type[Message]) -> st.SearchStrategy[bytes]:
    """Wire bytes: valid serializations with a string field's UTF-8 broken, or noise."""

    def break_utf8(msg: Message) -> bytes:
        data = msg.SerializeToString()
        # A string field with a byte that is never valid UTF-8: field 1, wire type 2.
        return b"\x0a\x02\xff\xfe" + data

    return st.one_of(messages(cls).map(break_utf8), st.binary(max_size=64))
