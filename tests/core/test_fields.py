"""The declarative validator (kvbench.fields): types, ranges, allowed values, one message.

Also: every registered method config declares a rule for each of its fields, a plugin's config
and workload get their own allowed values in errors, and the defaults documented in
docs/methods.md equal the config dataclasses' defaults.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from kvbench import fields as kf
from kvbench.bench.workloads import HIGHER, Workload, param_fields
from kvbench.cache.method import CacheConfig
from kvbench.cache.registry import METHODS, get_method_class
from kvbench.fields import Field

DOCS = Path(__file__).resolve().parents[2] / "docs" / "methods.md"


def _refusal(rule: Field, value: object, name: str = "x", where: str = "w") -> str:
    with pytest.raises(ValueError) as info:
        rule.check(value, name, where)
    return str(info.value)


# ------------------------------------------------------------------ the message


def test_message_format_is_the_one_format() -> None:
    assert kf.message("s.yaml", "bits", 9, "1..8 or 16") == (
        "s.yaml: field 'bits': 9 is not allowed; allowed: 1..8 or 16"
    )
    assert kf.message("", "pairing", "halves", "['a']") == (
        "field 'pairing': 'halves' is not allowed; allowed: ['a']"
    )
    with pytest.raises(ValueError, match=r"^W: field 'n': 3 is not allowed; allowed: odd$"):
        kf.reject("W", "n", 3, "odd")


# ------------------------------------------------------------------ types


@pytest.mark.parametrize(
    ("kind", "good", "bad"),
    [
        (int, [0, 7, -3], [True, False, 3.0, "3", None, np.int64(3), [1]]),
        (float, [0, 1, 2.5, np.float64(0.5), -1e9], [True, "0.5", None, [0.5]]),
        (bool, [True, False], [0, 1, "true", None]),
        (str, ["", "a"], [b"a", 1, None, ["a"]]),
    ],
)
def test_types(kind: type, good: list[Any], bad: list[Any]) -> None:
    rule = Field(kind)
    for v in good:
        rule.check(v, "x")
    for v in bad:
        assert not rule.accepts(v), v


def test_bool_is_not_an_int_even_among_int_choices() -> None:
    rule = Field(choices=(0, 1, 2))
    assert rule.kind is int  # inferred from all-int choices
    assert rule.accepts(1) and rule.accepts(0)
    assert not rule.accepts(True) and not rule.accepts(False)
    assert not rule.accepts(1.0)  # 1.0 == 1, but not an int
    untyped = Field(None, choices=("a", 1))
    assert untyped.accepts(1) and not untyped.accepts(True)


# ------------------------------------------------------------------ ranges


def test_ranges_inclusive_and_open() -> None:
    closed = Field(float, low=0, high=1)
    assert [closed.accepts(v) for v in (-0.01, 0, 0.5, 1, 1.01)] == [0, 1, 1, 1, 0]
    half_open = Field(float, low=0.5, high=1, low_open=True)
    assert [half_open.accepts(v) for v in (0.5, 0.500001, 1, 1.000001)] == [0, 1, 1, 0]
    upper_open = Field(int, high=4, high_open=True)
    assert [upper_open.accepts(v) for v in (-100, 3, 4)] == [1, 1, 0]
    assert not closed.accepts(float("nan"))
    assert not Field(None, low=0).accepts("a")  # no comparison: refused, not TypeError
    assert not Field(None, low=0).accepts(np.array([1, 2]))  # ambiguous truth: refused
    assert not Field(None, choices=("a",)).accepts(np.array(["a", "a"]))
    assert Field(None, choices=("a",)).accepts(np.str_("a"))


@pytest.mark.parametrize(
    ("rule", "allowed"),
    [
        (Field(int, low=1), "integers >= 1"),
        (Field(int, low=1, high=8), "integers 1..8"),
        (Field(int, low=0, high=4, high_open=True), "integers in [0, 4)"),
        (Field(float, low=0, high=1), "numbers in [0, 1]"),
        (Field(float, low=0.5, high=1, low_open=True), "numbers in (0.5, 1]"),
        (Field(float, low=0, low_open=True), "numbers > 0"),
        (Field(float, high=3, high_open=True), "numbers < 3"),
        (Field(float), "numbers"),
        (Field(bool), "true or false"),
        (Field(str, nonempty=True), "non-empty strings"),
        (Field(int, low=1, optional=True), "None or integers >= 1"),
        (Field(int, shape="list", min_items=0, extra=("all",)), "'all' or a list of integers"),
        (Field(float, low=2, shape="one-or-list"), "numbers >= 2, or a non-empty list of them"),
        (Field(str, choices=("b", "a")), "['b', 'a']"),
        (Field(choices=(1, 2, 3, 4, 5, 6, 7, 8, 16)), "1..8 or 16"),
        (Field(choices=(2, 4)), "2 or 4"),
        (Field(choices=(1, 2, 3, 4, 8)), "1..4 or 8"),
        (Field(choices=(0, -1)), "-1 or 0"),
        (Field(str, text="a method name"), "a method name"),
    ],
)
def test_allowed_wording(rule: Field, allowed: str) -> None:
    assert rule.allowed() == allowed


def test_refusal_names_where_field_value_and_allowed() -> None:
    msg = _refusal(Field(int, low=1, high=8), 9, "bits", "s.yaml: methods[0] (kivi)")
    assert msg == (
        "s.yaml: methods[0] (kivi): field 'bits': 9 is not allowed; allowed: integers 1..8"
    )


# ------------------------------------------------------------------ choices, None, lists


def test_choices_optional_extra_and_lists() -> None:
    rule = Field(str, choices=("x", "y"))
    assert rule.accepts("x") and not rule.accepts("z") and not rule.accepts(None)
    assert Field(str, optional=True).accepts(None)
    layers = Field(int, shape="list", min_items=0, extra=("all",))
    assert layers.accepts("all") and layers.accepts([]) and layers.accepts([0, 3])
    assert not layers.accepts("most") and not layers.accepts([0, "1"]) and not layers.accepts(3)
    many = Field(str, choices=("a", "b"), shape="list")
    assert many.accepts(["a", "b"]) and many.accepts(("a",))
    assert not many.accepts([]) and not many.accepts(["a", "c"]) and not many.accepts("a")
    either = Field(float, low=2, shape="one-or-list")
    assert either.accepts(3) and either.accepts([2, 4.5]) and either.accepts((2,))
    assert not either.accepts([4, 1]) and not either.accepts([]) and not either.accepts(1.5)
    assert Field(str, nonempty=True, shape="list").accepts(["a"])
    assert not Field(str, nonempty=True, shape="list").accepts(["a", ""])


def test_validate_mapping_and_dataclass() -> None:
    rules = {"n": Field(int, low=1), "s": Field(str, choices=("a",))}
    kf.validate({"n": 1, "other": object()}, "here", rules)  # missing names are skipped
    with pytest.raises(
        ValueError, match=r"^here: field 's': 'b' is not allowed; allowed: \['a'\]$"
    ):
        kf.validate({"n": 1, "s": "b"}, "here", rules)
    with pytest.raises(TypeError, match="fields="):
        kf.validate({"n": 1}, "here")

    @dataclasses.dataclass
    class Cfg:
        n: int = kf.spec(1, int, low=1)
        free: Any = None  # no rule: not checked

    kf.validate(Cfg(n=2, free="anything"), "Cfg")
    with pytest.raises(
        ValueError, match=r"^Cfg: field 'n': 0 is not allowed; allowed: integers >= 1$"
    ):
        kf.validate(Cfg(n=0), "Cfg")
    assert list(kf.declared(Cfg)) == ["n"]


# ------------------------------------------------------------------ method configs


@dataclasses.dataclass(frozen=True)
class PluginConfig(CacheConfig):
    """A plugin's config: its own ``bits`` rule and its own ``value_bits`` rule."""

    bits: int = kf.spec(4, int, choices=(2, 4))
    value_bits: int = kf.spec(16, int, choices=(4, 16))


@dataclasses.dataclass(frozen=True)
class DefaultsOnlyConfig(PluginConfig):
    """Changes defaults only: keeps the rules of :class:`PluginConfig`."""

    bits: int = 2
    group_size: int = 32
    residual_length: int = 32


def test_plugin_config_errors_name_its_own_allowed_values() -> None:
    with pytest.raises(ValueError) as info:
        PluginConfig(bits=3)
    assert str(info.value) == "PluginConfig: field 'bits': 3 is not allowed; allowed: 2 or 4"
    with pytest.raises(ValueError) as info:
        PluginConfig(value_bits=8)  # the core would allow 8
    assert str(info.value) == (
        "PluginConfig: field 'value_bits': 8 is not allowed; allowed: 4 or 16"
    )
    assert "1..8 or 16" not in str(info.value)
    assert PluginConfig(value_bits=4).value_bits == 4


def test_subclass_changing_a_default_keeps_the_base_rule() -> None:
    assert DefaultsOnlyConfig().bits == 2
    with pytest.raises(
        ValueError, match=r"^DefaultsOnlyConfig: field 'bits': 8 .*allowed: 2 or 4$"
    ):
        DefaultsOnlyConfig(bits=8)
    with pytest.raises(ValueError, match=r"field 'group_size': 0 .*allowed: integers >= 1$"):
        DefaultsOnlyConfig(group_size=0)  # CacheConfig's rule, inherited through two levels
    assert kf.declared(DefaultsOnlyConfig)["bits"] is kf.declared(PluginConfig)["bits"]


def test_cross_field_rule_raises_through_the_same_message() -> None:
    with pytest.raises(ValueError) as info:
        PluginConfig(group_size=32, residual_length=48)
    assert str(info.value) == (
        "PluginConfig: field 'residual_length': 48 is not allowed; allowed: a positive multiple "
        "of group_size=32 (per-channel key groups hold G tokens)"
    )


def _configs() -> dict[str, type]:
    """kvbench's own methods' configs (a plugin's own rules: tests/test_readme_plugin.py)."""
    return {n: get_method_class(n).Config for n, e in METHODS.entries().items() if e.builtin}


@pytest.mark.parametrize("name", sorted(_configs()))
def test_every_method_config_declares_every_field(name: str) -> None:
    config = _configs()[name]
    names = [f.name for f in dataclasses.fields(config)]
    assert sorted(kf.declared(config)) == sorted(names), f"{config.__name__}: fields without a rule"
    default = config()  # the defaults pass their own rules
    for f in dataclasses.fields(config):
        assert kf.declared(config)[f.name].accepts(getattr(default, f.name)), f.name


# ------------------------------------------------------------------ workloads


class _PluginWorkload(Workload):
    type = "plugin_fields_probe"
    METRICS: ClassVar[dict[str, str]] = {"score": HIGHER}
    PARAMS: ClassVar[dict[str, Any]] = {"mode": "fast", "steps": 4, "ratio": 0.5, "flag": True}
    FIELDS: ClassVar[dict[str, Field]] = {"mode": Field(str, choices=("fast", "exact"))}


class _ChildWorkload(_PluginWorkload):
    type = "plugin_fields_child"
    FIELDS: ClassVar[dict[str, Field]] = {"steps": Field(int, low=2, high=9)}


def test_workload_fields_declared_inherited_and_inferred() -> None:
    rules = param_fields(_ChildWorkload)
    assert rules["mode"].allowed() == "['fast', 'exact']"  # from the base's FIELDS
    assert rules["steps"].allowed() == "integers 2..9"  # the subclass's own
    assert rules["ratio"].allowed() == "None or numbers"  # from the default 0.5
    assert rules["flag"].allowed() == "None or true or false"  # from the default True
    with pytest.raises(ValueError) as info:
        _ChildWorkload.validate({"type": "plugin_fields_child", "mode": "slow"}, "p.yaml")
    assert str(info.value) == (
        "p.yaml: field 'mode': 'slow' is not allowed; allowed: ['fast', 'exact']"
    )
    with pytest.raises(ValueError, match=r"^p\.yaml: field 'steps': 1 is not allowed"):
        _ChildWorkload.validate({"type": "plugin_fields_child", "steps": 1}, "p.yaml")
    with pytest.raises(ValueError, match=r"field 'flag': 1 is not allowed; allowed: None or true"):
        _ChildWorkload.validate({"type": "plugin_fields_child", "flag": 1}, "p.yaml")
    spec = _ChildWorkload.validate({"type": "plugin_fields_child", "steps": 9}, "p.yaml")
    assert spec == {
        "type": "plugin_fields_child",
        "mode": "fast",
        "steps": 9,
        "ratio": 0.5,
        "flag": True,
    }


# ------------------------------------------------------------------ docs/methods.md defaults

#: "`name="value"` (default", "`name`: `value` (default", "`name` (`value` default"
_CLAIMS = re.compile(
    r'`(?P<a>[a-z0-9_]+)="?(?P<av>[^`"]+)"?`\s+\((?:[^)]*,\s*)?default'
    r"|`(?P<b>[a-z0-9_]+)`:\s+`(?P<bv>[^`]+)`\s+\((?:[^)]*,\s*)?default"
    r"|`(?P<c>[a-z0-9_]+)`\s+\(`(?P<cv>[^`]+)`\s+default"
)


def _sections() -> list[tuple[str, str]]:
    text = DOCS.read_text(encoding="utf-8")
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def _documented_defaults() -> list[tuple[str, type, str, str]]:
    """(section, config class, field, documented value) for every default claim in a section
    that names a registered config class."""
    by_name = {c.__name__: c for c in _configs().values()}
    out = []
    for title, body in _sections():
        configs = [by_name[n] for n in re.findall(r"`(\w+Config)`", body) if n in by_name]
        for m in _CLAIMS.finditer(body):
            field = m.group("a") or m.group("b") or m.group("c")
            value = m.group("av") or m.group("bv") or m.group("cv")
            for config in configs:
                if field in {f.name for f in dataclasses.fields(config)}:
                    out.append((title, config, field, value))
    return out


def test_documented_defaults_equal_the_code() -> None:
    claims = _documented_defaults()
    found = {(c.__name__, f) for _, c, f, _ in claims}
    # the parser reaches the claims this test exists for (a broken pattern fails here)
    assert {("Int8BlockConfig", "q4_rule"), ("Int4BlockConfig", "q4_rule")} <= found
    assert len(claims) >= 15, claims
    wrong = [
        (title, config.__name__, field, value, repr(getattr(config(), field)))
        for title, config, field, value in claims
        if str(getattr(config(), field)) != value
    ]
    assert not wrong, wrong


def test_int_block_q4_rule_default_is_llamacpp_in_code_and_docs() -> None:
    for name in ("int4-block", "int8-block"):
        assert get_method_class(name).Config().q4_rule == "llamacpp"
    section = dict(_sections())["int8-block and int4-block"]
    assert '`q4_rule="llamacpp"` (default)' in section
    assert '`q4_rule="absmax7"` (default)' not in section


@pytest.mark.parametrize("kind", ["fidelity", "memory"])
def test_drawn_geometry_needs_whole_query_groups(kind):
    """Both K/V-source workloads refuse query heads that are not a multiple of the KV heads."""
    from kvbench.bench.workloads import WORKLOADS

    cls = WORKLOADS.get(kind)
    spec = {"type": kind, "source": "synthetic", "num_heads": 8, "num_kv_heads": 3}
    with pytest.raises(ValueError, match=r"field 'num_heads': 8 .*multiples of num_kv_heads=3"):
        cls.validate(spec, "s.yaml")
    assert cls.validate({**spec, "num_heads": 9}, "s.yaml")["num_heads"] == 9
