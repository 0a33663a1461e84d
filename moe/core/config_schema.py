"""Turning plain dicts (parsed YAML) into typed config dataclasses, with every problem reported.

Each component owns a dataclass next to its code. This module only knows how to fill a dataclass
from a dict: it checks unknown keys, types, ``Literal`` choices, and calls the dataclass's own
``problems()`` method for value checks. All problems are collected and raised at once as a
:class:`~moe.core.errors.ConfigError`, each naming the dotted key, so a user fixes a config in
one pass.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

from moe.core.errors import ConfigError

T = TypeVar("T")


class ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` without YAML 1.1's base-60 numbers: ``0:30`` and ``24:00:00`` stay the
    strings they look like (as YAML 1.2 reads them) instead of silently becoming 30 and 86400,
    which would turn a SLURM time limit of 30 seconds into 30 minutes."""


ConfigLoader.yaml_implicit_resolvers = {
    first: [
        (
            tag,
            re.compile(r"(?![^:]*:)" + rx.pattern, rx.flags)
            if tag in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
            else rx,
        )
        for tag, rx in resolvers
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def load_yaml(text: str) -> Any:
    """Parse config YAML safely (no Python objects) and without base-60 numbers."""
    return yaml.load(text, Loader=ConfigLoader)  # a SafeLoader subclass: no Python objects


class _Invalid:
    """What a conversion returns when the value could not be converted (its problem recorded):
    distinct from None, which an optional field may legitimately hold."""

    def __repr__(self) -> str:
        return "<invalid>"


INVALID: Any = _Invalid()


def describe_type(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(describe_type(a) for a in get_args(tp))
    if origin in (list, tuple):
        args = get_args(tp)
        return f"a list of {describe_type(args[0])}" if args else "a list"
    if origin is dict:
        return "a mapping"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str, problems: list[str]) -> Any:
    """Convert ``value`` to type ``tp``, or record a problem and return INVALID."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        return _convert_union(value, tp, key, problems)
    if origin is Literal:
        if value in get_args(tp):
            return value
        problems.append(f"{key}: {value!r} is not allowed; expected {describe_type(tp)}")
        return INVALID
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        if not isinstance(value, dict):
            problems.append(f"{key}: expected a mapping, got {value!r}")
            return INVALID
        return _build(typing.cast(type, tp), value, key, problems)
    if origin in (list, tuple, dict):
        return _convert_collection(value, tp, key, problems)
    return _convert_scalar(value, tp, key, problems)


def _convert_union(value: Any, tp: Any, key: str, problems: list[str]) -> Any:
    """The first member type of ``tp`` that takes ``value`` without a problem."""
    args = get_args(tp)
    if value is None and type(None) in args:
        return None
    for arg in args:
        if arg is type(None):
            continue
        trial: list[str] = []
        out = _convert(value, arg, key, trial)
        if not trial:
            return out
    problems.append(f"{key}: expected {describe_type(tp)}, got {value!r}")
    return INVALID


def _convert_collection(value: Any, tp: Any, key: str, problems: list[str]) -> Any:
    """A list, tuple or dict, every item converted (each bad item is its own problem)."""
    origin = get_origin(tp)
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(f"{key}: expected a mapping, got {value!r}")
            return INVALID
        _, val_tp = get_args(tp) or (str, Any)
        out = {str(k): _convert(v, val_tp, f"{key}.{k}", problems) for k, v in value.items()}
        return INVALID if any(v is INVALID for v in out.values()) else out
    if not isinstance(value, (list, tuple)):
        problems.append(f"{key}: expected {describe_type(tp)}, got {value!r}")
        return INVALID
    (item_tp,) = get_args(tp)[:1] or (Any,)
    items = [_convert(v, item_tp, f"{key}[{i}]", problems) for i, v in enumerate(value)]
    if any(v is INVALID for v in items):
        return INVALID
    return tuple(items) if origin is tuple else items


def _convert_scalar(value: Any, tp: Any, key: str, problems: list[str]) -> Any:
    """bool, int, float or str; a bool is never taken as a number."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        problems.append(f"{key}: expected true or false, got {value!r}")
        return INVALID
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        problems.append(f"{key}: expected an integer, got {value!r}")
        return INVALID
    if tp is float:
        return _convert_float(value, key, problems)
    if tp is str:
        if isinstance(value, str):
            return value
        problems.append(f"{key}: expected a string, got {value!r}")
        return INVALID
    raise TypeError(f"unsupported config field type {tp!r} at {key}")


def _convert_float(value: Any, key: str, problems: list[str]) -> Any:
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        # YAML 1.1 reads "1e-3" as a string; accept numeric strings for floats only.
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None:
        problems.append(f"{key}: expected a number, got {value!r}")
        return INVALID
    if not math.isfinite(number):
        # No setting means anything at NaN or infinity, and comparisons with NaN are all
        # false: a range check of the section would let it through.
        problems.append(f"{key}: expected a finite number, got {value!r}")
        return INVALID
    return number


def _build(cls: type[T], data: dict, prefix: str, problems: list[str]) -> T:
    """Fill ``cls`` from ``data``, recording every problem. The object is built, and its own
    ``problems()`` (checks of values, also across its sub-sections) run, whenever every field
    could be converted: a value problem in one section does not hide those of another, nor the
    checks that span sections. Only a field that cannot be converted at all (a wrong type, a
    missing required key) leaves nothing to check further: INVALID is returned."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(typing.cast(Any, cls)) if f.init}
    for name in data:
        if name not in fields:
            close = difflib.get_close_matches(str(name), list(fields), n=1)
            hint = f"; did you mean {_join(prefix, close[0])!r}?" if close else ""
            allowed = ", ".join(sorted(fields))
            problems.append(f"{_join(prefix, name)}: unknown key{hint} (allowed: {allowed})")
    kwargs = {}
    complete = True
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], _join(prefix, name), problems)
            complete &= kwargs[name] is not INVALID
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            problems.append(f"{_join(prefix, name)}: required key is missing")
            complete = False
    if not complete:
        return INVALID
    obj = cls(**kwargs)
    check = getattr(obj, "problems", None)
    if check is not None:
        problems.extend(f"{_join(prefix, p)}" for p in check())
    return obj


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else str(name)


def minimums(obj: Any, **bounds: float) -> list[str]:
    """Problems for fields below their lower bound (``name: must be >= b, got v``); a field set
    to None (an optional value left out) passes."""
    out = []
    for name, bound in bounds.items():
        value = getattr(obj, name)
        if value is not None and value < bound:
            out.append(f"{name}: must be >= {bound}, got {value}")
    return out


def from_dict(
    cls: type[T],
    data: dict | None,
    source: str | None = None,
    checks: Callable[[T], list[str]] | None = None,
) -> T:
    """Build ``cls`` from ``data``; raise ConfigError listing every problem. ``checks`` adds
    the problems a caller finds in the built object (a scheduler's own limits): reported in
    the same error as the config's own."""
    problems: list[str] = []
    if data is not None and not isinstance(data, dict):
        raise ConfigError([f"top level: expected a mapping, got {type(data).__name__}"], source)
    obj = _build(cls, data or {}, "", problems)
    if obj is not INVALID and checks is not None:
        problems.extend(checks(obj))
    if problems:
        raise ConfigError(problems, source)
    return obj


def dotted_get(d: dict, dotted: str, absent: Any = None) -> Any:
    """The value at ``dotted`` (``a.b.c``) in nested dicts, or ``absent`` where a key is
    missing."""
    for k in dotted.split("."):
        d = d.get(k, absent) if isinstance(d, dict) else absent
    return d


def to_dict(obj: Any) -> Any:
    """Plain-data form of a config dataclass (for YAML, JSON and TensorBoard)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


ROLE = "role"
"""Field metadata key: what a field is to a checkpoint. Declare every field of the model config
and of the fine-tuning section with :func:`arch`, :func:`fixed` or :func:`runtime`; the resume
checks, the exporters, upcycling and the config reference read this one classification, and
nothing lists the fields again."""

ARCH, FIXED, RUNTIME = "arch", "fixed", "runtime"


def arch(default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    """A field that changes the function a trained model computes: the shapes of its weights,
    or what its forward pass computes at evaluation. A checkpoint resumes only with the same
    value (``model.init_from`` starts a different model from its weights) and every exporter
    must hold the value or refuse it."""
    return dataclasses.field(default=default, metadata={ROLE: ARCH}, **kw)


def fixed(default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    """A field that leaves the computed function unchanged but decides which parameters train
    (a router trained or frozen, the experts ESFT selects): the optimizer's state depends on
    it, so a checkpoint resumes only with the same value."""
    return dataclasses.field(default=default, metadata={ROLE: FIXED}, **kw)


def runtime(default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    """A field that leaves a trained model's function and its trained parameters unchanged:
    initialization, noise applied in training only, loss coefficients, a kernel choice. It may
    change on resume."""
    return dataclasses.field(default=default, metadata={ROLE: RUNTIME}, **kw)


def leaf_fields(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """(dotted path, field) of every leaf field of a config dataclass; the fields of nested
    config sections are listed instead of the section itself."""
    hints = typing.get_type_hints(cls)
    out: list[tuple[str, dataclasses.Field]] = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += leaf_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, f))
    return out


def field_roles(cls: type) -> dict[str, str]:
    """Dotted path -> role (:data:`ARCH`, :data:`FIXED` or :data:`RUNTIME`) of every leaf field
    of ``cls``. Raises TypeError naming each field declared without one."""
    fields = leaf_fields(cls)
    unclassified = [path for path, f in fields if ROLE not in f.metadata]
    if unclassified:
        raise TypeError(
            f"{cls.__name__}: fields {unclassified} are not classified; declare "
            "each with arch(...) (changes the computed function), fixed(...) "
            "(decides which parameters train) or runtime(...) "
            "(moe/core/config_schema.py)"
        )
    return {path: f.metadata[ROLE] for path, f in fields}


def function_classes(cls: type) -> dict[str, bool]:
    """Dotted path -> whether the field changes the computed function, for every leaf field of
    ``cls`` (raises TypeError naming each unclassified field)."""
    return {path: role == ARCH for path, role in field_roles(cls).items()}


def function_keys(cls: type) -> list[str]:
    """Dotted paths of the fields of ``cls`` that change the computed function."""
    return [path for path, changes in function_classes(cls).items() if changes]


def resume_keys(cls: type) -> list[str]:
    """Dotted paths of the fields of ``cls`` a run resumes only with its checkpoint's values:
    those that change the computed function or decide which parameters train."""
    return [path for path, role in field_roles(cls).items() if role != RUNTIME]
