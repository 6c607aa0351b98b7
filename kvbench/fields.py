"""Declared fields: the type, range and allowed values of a config field or workload parameter.

One rule per field, declared next to it, and one message for every value a rule refuses::

    "<where>: field '<name>': <value!r> is not allowed; allowed: <what the rule allows>"

A method config declares its fields with :func:`spec` (a ``dataclasses.field`` carrying a
:class:`Field` in its metadata); a workload maps its parameters to :class:`Field` objects in
``FIELDS``.  :func:`validate` checks a config instance or a parameter mapping against them;
rules that relate two fields (ratios summing to at most 1, one width below another) stay as
code in the config's ``__post_init__`` or the workload's ``check`` and raise through
:func:`reject`, so that every refusal reads the same.

Types follow YAML and Python, not numpy: ``int`` is an ``int`` that is not a ``bool``; ``float``
is an ``int`` or a ``float`` (``numpy.float64`` is a float), never a ``bool``; ``bool`` is a
``bool``; ``str`` a ``str``.  A subclass of a config that only changes a field's default keeps
the rule of the nearest base that declares one; a subclass that declares its own :func:`spec`
replaces it, and its errors name its own allowed values.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NoReturn, TypeVar

#: the metadata key under which :func:`spec` stores a field's :class:`Field`
METADATA_KEY = "kvbench.field"

Kind = type[int] | type[float] | type[str] | type[bool] | None
Shape = Literal["one", "list", "one-or-list"]
T = TypeVar("T")


def message(where: str, name: str, value: object, allowed: str) -> str:
    """The one refusal message: ``"<where>: field '<name>': <value!r> is not allowed; allowed:
    <allowed>"`` (no ``"<where>: "`` when ``where`` is empty)."""
    pre = f"{where}: " if where else ""
    return f"{pre}field {name!r}: {value!r} is not allowed; allowed: {allowed}"


def reject(where: str, name: str, value: object, allowed: str) -> NoReturn:
    """Raise ``ValueError(message(where, name, value, allowed))``: for rules that relate
    several fields and are written as code."""
    raise ValueError(message(where, name, value, allowed))


def describe_choices(choices: tuple[object, ...]) -> str:
    """``(1, 2, ..., 8, 16)`` -> ``"1..8 or 16"``; ``(2, 4)`` -> ``"2 or 4"``; other values as a
    Python list in the declared order (``"['a', 'b']"``)."""
    ints = [c for c in choices if type(c) is int]
    if not choices or len(ints) != len(choices):
        return repr(list(choices))
    parts: list[str] = []
    # consecutive values share ``value - position``: one group per run of consecutive ints
    for _, group in itertools.groupby(enumerate(sorted(set(ints))), lambda p: p[1] - p[0]):
        run = [v for _, v in group]
        parts += [f"{run[0]}..{run[-1]}"] if len(run) >= 3 else [str(v) for v in run]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


def _same(value: object, choice: object) -> bool:
    """``value == choice`` as a plain bool, bools apart from numbers (``True`` is not ``1``); a
    comparison that fails (an array of several values) is False."""
    if isinstance(value, bool) != isinstance(choice, bool):
        return False
    try:
        return bool(value == choice)
    except (TypeError, ValueError):  # an array's ambiguous truth
        return False


def _bound(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high}"
    return ""


@dataclass(frozen=True)
class Field:
    """What one field allows.

    Attributes
    ----------
    kind : ``int``, ``float``, ``str``, ``bool`` or ``None`` (any type; then ``choices`` or
        ``text`` say what is allowed).  With ``choices`` of ints only and no kind, ``int``.
    choices : the allowed values (compared after the type check, so ``2.0`` is not ``2``).
    low, high : inclusive bounds (``low_open`` / ``high_open``: exclusive).
    optional : ``None`` is allowed too.
    extra : other values allowed as they are (``("all",)`` beside a list of layer indices).
    shape : ``"one"`` (a single value), ``"list"`` (a list or tuple of such values, at least
        ``min_items`` long) or ``"one-or-list"``.
    min_items : the shortest list ``shape`` allows (default 1).
    nonempty : a string (or each string) must not be empty.
    text : what is allowed, in words, instead of the generated description.
    """

    kind: Kind = None
    choices: tuple[object, ...] | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    optional: bool = False
    extra: tuple[object, ...] = ()
    shape: Shape = "one"
    min_items: int = 1
    nonempty: bool = False
    text: str = ""

    def __post_init__(self) -> None:
        if self.choices is not None:
            object.__setattr__(self, "choices", tuple(self.choices))
            if self.kind is None and all(type(c) is int for c in self.choices):
                object.__setattr__(self, "kind", int)

    # ------------------------------------------------------------------ checking
    def _one(self, value: object) -> bool:
        k = self.kind
        if k is not None and not isinstance(value, int | float if k is float else k):
            return False
        if k in (int, float) and isinstance(value, bool):
            return False
        if self.nonempty and isinstance(value, str) and not value:
            return False
        if self.choices is not None and not any(_same(value, c) for c in self.choices):
            return False
        above = operator.gt if self.low_open else operator.ge
        below = operator.lt if self.high_open else operator.le
        try:
            return bool(
                (self.low is None or above(value, self.low))
                and (self.high is None or below(value, self.high))
            )
        except (TypeError, ValueError):  # not comparable, or an array's ambiguous truth
            return False

    def accepts(self, value: object) -> bool:
        """Whether ``value`` satisfies this rule."""
        if value is None:
            return self.optional
        if any(type(value) is type(e) and _same(value, e) for e in self.extra):
            return True
        many = isinstance(value, list | tuple)
        if self.shape == "one" or (self.shape == "one-or-list" and not many):
            return self._one(value)
        return many and len(value) >= self.min_items and all(self._one(v) for v in value)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ wording
    def allowed(self) -> str:
        """What the rule allows, in the words of the error message."""
        if self.text:
            return self.text
        if self.choices is not None:
            one = describe_choices(self.choices)
        elif self.kind is bool:
            one = "true or false"
        else:
            noun = {int: "integers", float: "numbers", str: "strings", None: "values"}[self.kind]
            if self.nonempty:
                noun = "non-empty " + noun
            rng = _bound(self.low, self.high, self.low_open, self.high_open)
            if self.kind is int and rng.startswith("in [") and not self.high_open:
                rng = f"{self.low}..{self.high}"
            one = f"{noun} {rng}".strip()
        some = "a non-empty list" if self.min_items == 1 else "a list"
        if self.min_items > 1:
            some = f"a list of at least {self.min_items}"
        if self.shape == "list":
            one = f"{some} of {one}"
        elif self.shape == "one-or-list":
            one = f"{one}, or {some} of them"
        pre = [repr(e) for e in self.extra] + (["None"] if self.optional else [])
        return " or ".join([*pre, one])

    def check(self, value: object, name: str, where: str = "") -> None:
        """``ValueError`` (:func:`message`) unless :meth:`accepts` ``value``."""
        if not self.accepts(value):
            reject(where, name, value, self.allowed())


def spec(default: T, kind: Kind = None, **rule: Any) -> T:
    """A dataclass field with ``default`` whose :class:`Field` (``kind`` and ``rule``: the
    keyword arguments of :class:`Field`) :func:`validate` checks.

    Typed as its default like ``dataclasses.field``, so ``bits: int = spec(2, int, ...)``
    type-checks."""
    return dataclasses.field(default=default, metadata={METADATA_KEY: Field(kind, **rule)})


@functools.cache
def declared(cls: type) -> dict[str, Field]:
    """Field name -> :class:`Field` of the dataclass ``cls``: each field's own :func:`spec`, or
    that of the nearest base class declaring the same name; fields without one are left out."""
    out: dict[str, Field] = {}
    for f in dataclasses.fields(cls):
        for klass in cls.__mro__:
            own = getattr(klass, "__dataclass_fields__", {}).get(f.name)  # a base may be none
            if own is not None and METADATA_KEY in own.metadata:
                out[f.name] = own.metadata[METADATA_KEY]
                break
    return out


class FieldErrors(ValueError):
    """Two or more fields refused at once by :func:`validate`: ``messages`` holds each
    :func:`message` in declaration order (the text is them joined, one per line), so that a
    caller collecting errors (a suite's validator) lists every one."""

    def __init__(self, messages: list[str]) -> None:
        self.messages = messages
        super().__init__("\n".join(messages))


def validate(
    obj: object | Mapping[str, object], where: str = "", fields: Mapping[str, Field] | None = None
) -> None:
    """Check every declared field of ``obj`` (a dataclass instance; ``fields`` default:
    :func:`declared` of its class) or of a mapping (``fields`` required; names missing from the
    mapping are skipped).

    Raises
    ------
    ValueError
        :func:`message` of the field whose value its rule refuses, where one is;
        :class:`FieldErrors` (a ``ValueError``) with every refused field's, in declaration
        order, where several are.
    """
    if isinstance(obj, Mapping):
        if fields is None:
            raise TypeError("validate(mapping) needs fields=")
        values = {name: obj[name] for name in fields if name in obj}
    else:
        fields = declared(type(obj)) if fields is None else fields
        values = {name: getattr(obj, name) for name in fields}
    refused: list[ValueError] = []
    for name, value in values.items():
        try:
            fields[name].check(value, name, where)
        except ValueError as exc:
            refused.append(exc)
    if len(refused) == 1:
        raise refused[0]
    if refused:
        raise FieldErrors([str(e) for e in refused])
