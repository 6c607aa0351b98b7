"""The one registry type (:mod:`kvbench.registry`) and the tables built on it: workload types
(:data:`kvbench.bench.workloads.WORKLOADS`) and texts/task sets (:data:`kvbench.data.catalog.TEXTS`,
:data:`kvbench.data.catalog.ROWS`).

Right values: the rules of the module docstring of kvbench/registry.py, checked on a registry of
a made-up entry-point group whose fake entry points count their loads; expected messages are
written out by hand.  The method registry's own tests are in tests/core/test_baseline_methods.py.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from kvbench import registry
from kvbench.bench.workloads import (
    HIGHER,
    LOWER,
    WORKLOADS,
    Workload,
    WorkloadRegistrationError,
    metric_direction,
)
from kvbench.data import catalog
from kvbench.registry import CODE_DIST, Registry, RegistryError, UnknownName

GROUP = "kvbench-tests.widgets"


@dataclass
class FakeDist:
    name: str

    @property
    def metadata(self) -> dict[str, str]:
        return {"Name": self.name}


@dataclass
class FakeEP:
    """Duck-typed entry point (name, value, dist, load()) that counts its loads."""

    name: str
    value: str
    dist: FakeDist
    target: object = None
    loads: int = 0

    def load(self) -> object:
        self.loads += 1
        if isinstance(self.target, Exception):
            raise self.target
        return self.target


def ep(name: str, target: object, dist: str = "kvbench") -> FakeEP:
    return FakeEP(name, f"{dist.replace('-', '_')}.mod:{name}", FakeDist(dist), target)


def check_int(name: str, obj: object) -> str:
    """Accepts an int and returns ``"name:obj"`` (so a test sees that ``get`` returns what
    ``check`` returned, not the raw object)."""
    if not isinstance(obj, int):
        raise TypeError(f"{obj!r} is not an int")
    return f"{name}:{obj}"


@pytest.fixture
def widgets(monkeypatch) -> Callable[..., Registry[str]]:
    """``widgets(*eps, listing=None)``: a fresh registry of group :data:`GROUP` whose entry
    points are ``eps`` (other groups see none)."""
    installed: list[FakeEP] = []
    monkeypatch.setattr(
        registry, "entry_points", lambda group: list(installed) if group == GROUP else []
    )

    def make(*eps: FakeEP, listing: Callable[[list[str]], str] | None = None) -> Registry[str]:
        installed[:] = eps
        return Registry("widget", GROUP, check_int, listing)

    return make


# ------------------------------------------------------------------ unknown names


def test_unknown_name_did_you_mean_and_the_registered_names(widgets) -> None:
    reg = widgets(ep("alpha", 1), ep("beta", 2))
    with pytest.raises(UnknownName) as err:
        reg.get("alpah", "suite.yaml: widgets[0]")
    assert str(err.value) == (
        "suite.yaml: widgets[0]: unknown widget 'alpah'; did you mean 'alpha'? "
        "(registered: ['alpha', 'beta'])"
    )
    assert isinstance(err.value, ValueError)


def test_unknown_name_without_a_close_match(widgets) -> None:
    reg = widgets(ep("alpha", 1), ep("beta", 2))
    with pytest.raises(UnknownName) as err:
        reg.get("zzz")
    assert str(err.value) == "unknown widget 'zzz' (registered: ['alpha', 'beta'])"


@pytest.mark.parametrize("name", [["alpha"], 3, None])
def test_a_name_that_is_not_a_string_is_unknown(widgets, name) -> None:
    reg = widgets(ep("alpha", 1))
    with pytest.raises(UnknownName, match=rf"^unknown widget {re.escape(repr(name))}[;( ]"):
        reg.get(name)


def test_listing_formats_the_registered_names(widgets) -> None:
    reg = widgets(ep("alpha", 1), ep("beta", 2), listing=lambda names: f"{len(names)}: {names}")
    with pytest.raises(UnknownName) as err:
        reg.get("gamma")
    assert str(err.value) == "unknown widget 'gamma' (2: ['alpha', 'beta'])"


def test_a_group_without_kvbench_entry_points_says_the_install_is_broken(widgets) -> None:
    reg = widgets(ep("alpha", 1, dist="some-plugin"))
    with pytest.raises(UnknownName) as err:
        reg.get("beta")
    assert f"no entry point of kvbench itself in group {GROUP!r}" in str(err.value)
    assert "pip install -e ." in str(err.value)
    reg = widgets(ep("alpha", 1, dist="some-plugin"), ep("gamma", 3))
    with pytest.raises(UnknownName) as err:
        reg.get("beta")
    assert "kvbench itself" not in str(err.value)
    code_only: Registry[int] = Registry("thing")  # no group: nothing is installed by pip
    with pytest.raises(UnknownName) as err:
        code_only.get("beta")
    assert str(err.value) == "unknown thing 'beta' (registered: [])"


# ------------------------------------------------------------------ lazy loading


def test_entry_points_load_only_when_their_name_is_used(widgets) -> None:
    alpha, beta = ep("alpha", 1), ep("beta", 2)
    reg = widgets(alpha, beta)
    assert reg.names() == ["alpha", "beta"] and list(reg) == ["alpha", "beta"]
    assert "alpha" in reg and "gamma" not in reg
    assert reg.entries()["beta"].value == "kvbench.mod:beta"
    assert reg.loaded() == {}
    assert (alpha.loads, beta.loads) == (0, 0)
    assert reg.get("alpha") == "alpha:1"  # what check returned
    assert reg.get("alpha") == "alpha:1"
    assert (alpha.loads, beta.loads) == (1, 0)  # once, and only the name asked for
    assert reg.loaded() == {"alpha": "alpha:1"}


def test_entry_points_are_read_once_until_refresh(widgets, monkeypatch) -> None:
    reg = widgets(ep("alpha", 1))
    assert reg.names() == ["alpha"]
    later = [ep("alpha", 1), ep("beta", 2)]
    monkeypatch.setattr(registry, "entry_points", lambda group: later)
    assert reg.names() == ["alpha"]
    assert sorted(reg.entries(refresh=True)) == ["alpha", "beta"]
    assert reg.get("beta") == "beta:2"


# ------------------------------------------------------------------ built-ins, clashes, failures


@pytest.mark.parametrize("plugin_first", [True, False])
def test_a_plugin_reusing_a_builtin_name_is_ignored_with_a_warning(widgets, plugin_first) -> None:
    builtin = ep("alpha", 1)
    evil = ep("alpha", RuntimeError("must not load"), dist="evil-plugin")
    reg = widgets(*([evil, builtin] if plugin_first else [builtin, evil]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entries = reg.entries()
    assert [str(w.message) for w in caught] == [
        "kvbench: plugin distribution 'evil-plugin' registers widget 'alpha', a built-in name "
        "(distribution 'kvbench'); the built-in wins"
    ]
    assert entries["alpha"].dist == "kvbench" and entries["alpha"].clash == []
    assert reg.get("alpha") == "alpha:1" and evil.loads == 0


def test_two_plugins_with_one_name_is_an_error_naming_both(widgets) -> None:
    a, b = ep("twin", 1, dist="plugin-b"), ep("twin", 2, dist="plugin-a")
    reg = widgets(a, b, ep("alpha", 3))
    with pytest.raises(RegistryError) as err:
        reg.get("twin")
    assert str(err.value) == (
        "widget 'twin' is registered by several plugins: plugin-a, plugin-b; uninstall all but one"
    )
    assert (a.loads, b.loads) == (0, 0)
    assert reg.get("alpha") == "alpha:3"  # the other names are unaffected


def test_one_distribution_seen_twice_on_the_path_is_no_clash(widgets) -> None:
    # the same install twice (kvbench itself: no "built-in reused" warning either), and two
    # versions of one plugin (different values): the first on the path wins
    old = FakeEP("beta", "plugin_a.v1:beta", FakeDist("plugin-a"), 2)
    new = FakeEP("beta", "plugin_a.v2:beta", FakeDist("plugin-a"), 3)
    reg = widgets(ep("alpha", 1), ep("alpha", 1), old, new)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entries = reg.entries()
    assert caught == []
    assert entries["alpha"].clash == [] and entries["beta"].clash == []
    assert reg.get("alpha") == "alpha:1"
    assert reg.get("beta") == "beta:2" and new.loads == 0


def test_a_plugin_that_fails_to_import_is_isolated(widgets) -> None:
    cause = ModuleNotFoundError("No module named 'broken_mod'")
    broken = FakeEP("broken", "broken_mod:Thing", FakeDist("broken-plugin"), cause)
    reg = widgets(broken, ep("alpha", 1))
    with pytest.raises(RegistryError) as err:
        reg.get("broken")
    assert str(err.value) == (
        "widget 'broken' from distribution 'broken-plugin' failed to load (broken_mod:Thing): "
        "ModuleNotFoundError: No module named 'broken_mod'"
    )
    assert err.value.__cause__ is cause
    assert reg.entries()["broken"].error == "ModuleNotFoundError: No module named 'broken_mod'"
    assert reg.get("alpha") == "alpha:1"
    assert reg.loaded() == {"alpha": "alpha:1"}


def test_check_rejects_an_entry_point_naming_its_distribution(widgets) -> None:
    odd = ep("odd", "eleven", dist="odd-plugin")
    reg = widgets(odd, ep("alpha", 1))
    with pytest.raises(RegistryError) as err:
        reg.get("odd")
    assert str(err.value) == "widget 'odd' from 'odd-plugin': 'eleven' is not an int"
    assert isinstance(err.value.__cause__, TypeError)
    assert reg.entries()["odd"].error == "'eleven' is not an int"
    assert reg.get("alpha") == "alpha:1"


# ------------------------------------------------------------------ registering in code


def test_register_as_a_decorator() -> None:
    funcs: Registry[Callable[[int], int]] = Registry("function")

    @funcs.register("double")
    def double(x: int) -> int:
        return 2 * x

    assert double(3) == 6  # the decorator hands back the function itself
    assert funcs.get("double") is double
    entry = funcs.entries()["double"]
    assert entry.dist == CODE_DIST and entry.builtin
    assert entry.value == f"{__name__}:test_register_as_a_decorator.<locals>.double"


def test_register_as_a_call_before_and_after_the_entry_points_are_read(widgets) -> None:
    reg = widgets(ep("alpha", 1))
    assert reg.register("early", 5) == 5  # before any read
    assert reg.names() == ["alpha", "early"]
    assert reg.register("late", 6) == 6  # after: the cached table learns it too
    assert reg.names() == ["alpha", "early", "late"]
    assert reg.get("early") == "early:5" and reg.get("late") == "late:6"  # checked


def test_check_rejects_a_registration_and_nothing_is_registered(widgets) -> None:
    reg = widgets(ep("alpha", 1))
    with pytest.raises(TypeError, match="'six' is not an int"):
        reg.register("six", "six")
    with pytest.raises(TypeError, match="'seven' is not an int"):
        reg.register("seven")("seven")
    assert reg.names() == ["alpha"]


def test_code_hides_an_entry_point_until_unregister(widgets) -> None:
    alpha = ep("alpha", 1)
    reg = widgets(alpha)
    reg.register("alpha", 7)
    assert reg.get("alpha") == "alpha:7" and alpha.loads == 0
    reg.unregister("alpha")
    assert reg.get("alpha") == "alpha:1"


def test_unregister_forgets_a_code_name(widgets) -> None:
    reg = widgets(ep("alpha", 1))
    reg.register("gamma", 3)
    assert "gamma" in reg
    reg.unregister("gamma")
    assert "gamma" not in reg and reg.names() == ["alpha"]
    with pytest.raises(UnknownName, match="unknown widget 'gamma'"):
        reg.get("gamma")
    reg.unregister("never-registered")  # a no-op
    assert reg.names() == ["alpha"]


# ------------------------------------------------------------------ workload types


@pytest.fixture
def scratch_workloads():
    """Names registered in code by a test are unregistered after it."""
    names: list[str] = []
    yield names
    for name in names:
        WORKLOADS.unregister(name)


def test_a_workload_registered_in_code(scratch_workloads) -> None:
    scratch_workloads.append("tmp_score")

    @WORKLOADS.register("tmp_score")
    class TmpScore(Workload):
        type = "tmp_score"
        METRICS = {"tmp_score_value": HIGHER}

    assert WORKLOADS.get("tmp_score") is TmpScore and "tmp_score" in WORKLOADS.names()
    assert metric_direction("tmp_score_value") == HIGHER
    assert metric_direction("tmp_score_value_ratio") == HIGHER  # derived suffix


def test_builtin_workload_types_come_from_the_entry_points() -> None:
    entries = WORKLOADS.entries()
    assert entries["bits"].dist == "kvbench"
    assert entries["bits"].value == "kvbench.bench.workloads.bits:Bits"
    assert WORKLOADS.get("bits").__name__ == "Bits"


def test_unknown_workload_type_did_you_mean() -> None:
    with pytest.raises(UnknownName, match=r"^s.yaml: unknown workload type 'fidelty'; did you "):
        WORKLOADS.get("fidelty", "s.yaml")


def test_workload_registration_checks(scratch_workloads) -> None:
    scratch_workloads.append("tmp_bad")

    class NoMetrics(Workload):
        type = "tmp_bad"

    class BadDirection(Workload):
        METRICS = {"tmp_m": "up"}

    with pytest.raises(WorkloadRegistrationError, match="is not a kvbench.bench.workloads.Workl"):
        WORKLOADS.register("tmp_bad", dict)
    with pytest.raises(WorkloadRegistrationError, match="is not a kvbench.bench.workloads.Workl"):
        WORKLOADS.register("tmp_bad", WORKLOADS.get("bits")({}))  # an instance, not a type
    with pytest.raises(WorkloadRegistrationError) as err:
        WORKLOADS.register("tmp_bad", NoMetrics)
    assert str(err.value) == (
        "workload 'tmp_bad' (test_workload_registration_checks.<locals>.NoMetrics) declares no "
        "METRICS; every metric needs a direction, one of ('lower', 'higher', 'none')"
    )
    with pytest.raises(WorkloadRegistrationError) as err:
        WORKLOADS.register("tmp_bad", BadDirection)
    assert str(err.value) == (
        "workload 'tmp_bad': unknown direction(s) {'tmp_m': 'up'}; "
        "allowed: ('lower', 'higher', 'none')"
    )
    assert "tmp_bad" not in WORKLOADS


def test_workload_directions_must_agree_with_loaded_workloads(scratch_workloads) -> None:
    scratch_workloads.append("tmp_bits")
    WORKLOADS.get("bits")  # declares nominal_key_bits: lower

    class Contrary(Workload):
        METRICS = {"nominal_key_bits": HIGHER}

    with pytest.raises(WorkloadRegistrationError) as err:
        WORKLOADS.register("tmp_bits", Contrary)
    assert str(err.value) == (
        "workload 'tmp_bits' and 'bits' declare different directions for "
        "{'nominal_key_bits': ('higher', 'lower')} (theirs second)"
    )

    class Agrees(Workload):
        METRICS = {"nominal_key_bits": LOWER}

    class Changes(Workload):
        METRICS = {"tmp_own": HIGHER}

    assert WORKLOADS.register("tmp_bits", Agrees) is Agrees
    WORKLOADS.register("tmp_bits", Changes)  # replacing its own name is no contradiction

    class OwnContrary(Workload):
        METRICS = {"tmp_own": LOWER}

    WORKLOADS.register("tmp_bits", OwnContrary)
    assert WORKLOADS.get("tmp_bits") is OwnContrary


# ------------------------------------------------------------------ texts and task sets


def test_texts_and_task_sets_are_registries_of_their_kind() -> None:
    assert catalog.TEXTS.names() == ["essays", "essays-calib", "wikitext2"]
    assert catalog.TEXTS.get("wikitext2").hub_id == "Salesforce/wikitext"
    assert catalog.ROWS.get("mgsm_de").config == "de"
    assert catalog.known_names()[:4] == ["essays", "essays-calib", "wikitext2", "aime24"]
    with pytest.raises(TypeError, match="kind='text'"):
        catalog.TEXTS.register("gsm8k", catalog.ROWS.get("gsm8k"))
    with pytest.raises(TypeError, match="name='essays'"):
        catalog.TEXTS.register("essays", catalog.TEXTS.get("wikitext2"))
    assert catalog.TEXTS.get("essays").name == "essays"


def test_unknown_text_and_task_set_names_did_you_mean() -> None:
    with pytest.raises(UnknownName) as err:
        catalog.TEXTS.get("wikitxt2")
    assert str(err.value) == (
        "unknown text dataset 'wikitxt2'; did you mean 'wikitext2'? "
        "(registered: ['essays', 'essays-calib', 'wikitext2'])"
    )
    with pytest.raises(UnknownName) as err:
        catalog.ROWS.get("math50")
    assert str(err.value) == (
        "unknown task dataset 'math50'; did you mean 'math500'? (choose one of ['aime24', "
        "'aime25', 'amc23', 'gsm8k', 'math500'] or mgsm_XX with XX in ['bn', 'de', 'en', 'es', "
        "'fr', 'ja', 'ru', 'sw', 'te', 'th', 'zh'])"
    )
    with pytest.raises(UnknownName, match=r"^unknown dataset 'essay'; did you mean 'essays'"):
        catalog.spec("essay")


def test_a_workload_without_its_hooks_cannot_be_built() -> None:
    """``run`` (every workload) and ``load`` / ``score`` (task workloads) are abstract: a class
    that lacks one fails when it is instantiated, naming the missing hook."""
    from kvbench.bench.tasks.workload import TaskWorkload

    class NoRun(Workload):
        METRICS = {"x": HIGHER}

    class NoScore(TaskWorkload):
        def load(self, ctx):
            return [], {}

    with pytest.raises(TypeError, match="abstract method '?run\\b"):
        NoRun({})
    with pytest.raises(TypeError, match="abstract method '?score\\b"):
        NoScore({})
    with pytest.raises(TypeError, match="abstract method"):
        Workload({})
