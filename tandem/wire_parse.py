"""Typed parsing of control messages (tandem/wire.py): JSON objects into frozen dataclasses, checking keys
and value types, so a malformed message is a ProtocolError naming the field, never a crash deeper in.
Wire types: int, float, str, bool, enums, lists/tuples (fixed ones like tuple[int, float] too), dicts,
nested message dataclasses, Optional of these, and bytes (base64 text on the wire).
"""

from __future__ import annotations

import base64
import binascii
import enum
import functools
import hashlib
import json
import types
import typing
from dataclasses import MISSING, fields, is_dataclass

from tandem.status import ProtocolError


class WireError(ProtocolError):
    """A control message is malformed. The message names the field and what was expected."""


def to_base64(value) -> str:
    """json.dumps' `default`: bytes fields (e.g. TrtllmParams.opaque_state) travel as base64 text."""
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    raise TypeError(f"{type(value).__name__} is not a wire type")


def json_object(raw, what: str) -> dict:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as e:
        raise WireError(f"{what} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise WireError(f"{what} must be a JSON object, got {type(data).__name__}")
    return data


def parse(cls, data):
    """Build dataclass `cls` from a JSON object (dict, bytes or str), checking keys and value types.

    Constructing the dataclass runs its own checks (e.g. SamplingParams' ranges), so what comes out
    is a valid message, a WireError (a ProtocolError) naming the field, or the InvalidArgument of those
    checks.
    """
    if isinstance(data, (bytes, str)):
        data = json_object(data, cls.__name__)
    if not isinstance(data, dict):
        raise WireError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
    hints, known = _schema(cls)
    unknown = set(data) - set(known)
    if unknown:
        raise WireError(f"{cls.__name__}: unknown fields {sorted(unknown)}; allowed: {sorted(known)}")
    kwargs = {}
    for name, f in known.items():
        if name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise WireError(f"{cls.__name__}: missing field {name!r}")
            continue
        kwargs[name] = _check(f"{cls.__name__}.{name}", data[name], hints[name])
    return cls(**kwargs)


def fingerprint(*roots) -> str:
    """A short digest of the message schema reachable from `roots` (message classes and enums): every
    dataclass's name and fields with their types, nested ones and enum values included. Two processes
    can read each other's messages when their fingerprints match; any change to a message (a field
    added, renamed or retyped, a status or role added) changes it, with nobody having to remember to."""
    seen, lines, todo = set(), [], list(roots)
    while todo:
        t = todo.pop()
        if t in seen:
            continue
        seen.add(t)
        if isinstance(t, type) and issubclass(t, enum.Enum):
            lines.append(f"{t.__name__} = {sorted(str(m.value) for m in t)}")
            continue
        hints, known = _schema(t)
        lines.append(f"{getattr(t, 'TYPE', '')} {t.__name__}(" + ", ".join(
            f"{name}: {_type_name(hints[name], todo)}" for name in known) + ")")
    return hashlib.sha256("\n".join(sorted(lines)).encode()).hexdigest()[:12]


def _type_name(hint, todo: list) -> str:
    """`hint` as text (list[int], Destination | None, ...), queueing the message classes and enums it names."""
    args = typing.get_args(hint)
    if args:
        origin = typing.get_origin(hint)
        inner = [_type_name(a, todo) for a in args]
        if origin in (typing.Union, types.UnionType):
            return " | ".join(inner)
        return f"{getattr(origin, '__name__', origin)}[{', '.join(inner)}]"
    if is_dataclass(hint) or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        todo.append(hint)
    return "None" if hint is type(None) else "..." if hint is Ellipsis else getattr(hint, "__name__", str(hint))


@functools.cache
def _schema(cls) -> tuple[dict, dict]:
    """(field name -> type hint, field name -> Field) of a message class: resolved once per class, not
    per message (get_type_hints evaluates every annotation string; a token reply would pay it each time)."""
    return typing.get_type_hints(cls), {f.name: f for f in fields(cls)}


_PLAIN = frozenset({int, float, str, bool})


@functools.cache
def _shape(hint) -> tuple:
    """(the hint without Optional, its origin, its args, whether None is allowed), once per hint."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin not in (typing.Union, types.UnionType):
        return hint, origin, args, False
    inner = next(a for a in args if a is not type(None))
    return inner, typing.get_origin(inner), typing.get_args(inner), type(None) in args


def _check(where: str, value, hint):
    hint, origin, args, optional = _shape(hint)
    if type(value) is hint and hint in _PLAIN:  # the common case: a JSON scalar of the declared type
        return value
    if value is None and optional:
        return None
    if is_dataclass(hint):
        return parse(hint, value)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            raise WireError(f"{where}: {value!r} is not one of {[m.value for m in hint]}") from None
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise WireError(f"{where}: expected a list, got {type(value).__name__}")
        if origin is tuple and Ellipsis not in args:  # a fixed tuple, e.g. tuple[int, float]: item by item
            if len(value) != len(args):
                raise WireError(f"{where}: expected a list of {len(args)} items, got {len(value)}")
            return tuple(_check(where, v, a) for v, a in zip(value, args))
        if args[0] is int:  # token id lists are long: one pass, no per-item recursion
            if not all(type(v) is int for v in value):
                raise WireError(f"{where}: expected a list of integers")
            items = value
        else:
            items = [_check(where, v, args[0]) for v in value]
        return items if origin is list else tuple(items)
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise WireError(f"{where}: expected an object, got {type(value).__name__}")
        return value
    if hint is bytes:
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise WireError(f"{where}: expected base64 text, got {type(value).__name__}") from None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and (not isinstance(value, hint) or (hint is int and isinstance(value, bool))):
        raise WireError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
    return value
