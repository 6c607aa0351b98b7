"""The one registry type of kvbench: :class:`Registry` maps names to objects of one type ``T``.

Every name-to-thing table of kvbench is a ``Registry``; the tables and the rules they follow
(lazy entry points, "did you mean", built-in names winning over plugins, clashing or broken
plugins) are in docs/design.md#registries.  An unknown name in the registry of an entry-point
group without kvbench's own entry points also says that the install is broken.

This module imports nothing else of kvbench, so every layer may use it.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Generic, TypeVar, overload

T = TypeVar("T")

#: the distribution name of kvbench's own entry points
BUILTIN_DIST = "kvbench"
#: the distribution recorded for objects registered in code
CODE_DIST = "<code>"


class RegistryError(RuntimeError):
    """A registered name cannot be used: its plugin failed to load, its object has the wrong
    type, or several plugins claim it.  The message names the distribution(s)."""


class UnknownName(ValueError):
    """A name that no entry point and no ``register`` call provides."""


@dataclass
class Entry(Generic[T]):
    """One registered name: where it comes from and, once loaded, its object.

    ``value``: ``"module:attr"`` of an entry point, or the object's qualified name;
    ``dist``: the distribution that declares it (:data:`CODE_DIST` for ``register`` calls);
    ``error``: why loading failed (``None`` before a load or after a good one);
    ``clash``: other distributions that declare the same name."""

    name: str
    value: str
    dist: str
    entry_point: EntryPoint | None = None
    obj: T | None = None
    error: str | None = None
    clash: list[str] = field(default_factory=list)

    @property
    def builtin(self) -> bool:
        return self.dist in (BUILTIN_DIST, CODE_DIST)


def did_you_mean(name: object, names: Iterable[str], n: int = 3, cutoff: float = 0.5) -> str:
    """``"; did you mean 'a' or 'b'?"`` naming up to ``n`` close matches of ``name`` among
    ``names`` (:func:`difflib.get_close_matches`), or ``""`` when none is close."""
    close = difflib.get_close_matches(str(name), list(names), n=n, cutoff=cutoff)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


class Registry(Generic[T]):
    """Names -> objects of one type.

    Parameters
    ----------
    kind:
        What a name names, for messages (``"method"``, ``"workload type"``, ...).
    group:
        The entry-point group read lazily, or ``None`` for a registry filled in code only.
    check:
        ``check(name, obj) -> T``: validates a loaded or registered object and returns it (may
        return a wrapped object); raises ``TypeError``/``ValueError`` saying what is wrong.
        Default: accept anything.
    listing:
        ``listing(names) -> str``: how an unknown-name message lists the registered names
        (sorted).  Default: ``"registered: [...]"``.
    """

    def __init__(
        self,
        kind: str,
        group: str | None = None,
        check: Callable[[str, object], T] | None = None,
        listing: Callable[[list[str]], str] | None = None,
    ) -> None:
        self.kind = kind
        self.group = group
        self._check = check
        self._listing = listing or (lambda names: f"registered: {names}")
        self._entries: dict[str, Entry[T]] | None = None
        self._code: dict[str, Entry[T]] = {}

    # -- filling -----------------------------------------------------------------------------

    @overload
    def register(self, name: str) -> Callable[[T], T]: ...

    @overload
    def register(self, name: str, obj: T) -> T: ...

    def register(self, name: str, obj: T | None = None) -> Callable[[T], T] | T:
        """Register ``obj`` as ``name`` (replacing an earlier code registration of the name; an
        entry point of the same name is hidden until :meth:`unregister`).

        Usable as a decorator: ``@REGISTRY.register("name")``.  Returns ``obj``.

        Raises ``TypeError``/``ValueError`` from the registry's ``check`` (nothing is
        registered then)."""
        if obj is None:
            return lambda o: self._add(name, o)
        return self._add(name, obj)

    def _add(self, name: str, obj: T) -> T:
        checked = self._check(name, obj) if self._check is not None else obj
        # any object may be registered: a class or function has these names, an instance not
        value = f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"
        entry: Entry[T] = Entry(name, value, CODE_DIST, obj=checked)
        self._code[name] = entry
        if self._entries is not None:
            self._entries[name] = entry
        return obj

    def unregister(self, name: str) -> None:
        """Forget a name registered in code (tests); entry points stay."""
        self._code.pop(name, None)
        self._entries = None

    # -- reading -----------------------------------------------------------------------------

    def entries(self, refresh: bool = False) -> dict[str, Entry[T]]:
        """Every name -> its :class:`Entry` (nothing loaded by this call)."""
        if self._entries is not None and not refresh:
            return self._entries
        found: dict[str, Entry[T]] = {}
        seen: set[tuple[str, str, str]] = set()
        for ep in entry_points(group=self.group) if self.group else ():
            dist = ep.dist.metadata["Name"] if ep.dist is not None else "<unknown>"
            key = (ep.name, ep.value, dist)
            if key in seen:  # the same distribution visible twice on sys.path
                continue
            seen.add(key)
            new: Entry[T] = Entry(ep.name, ep.value, dist, ep)
            old = found.get(ep.name)
            if old is None:
                found[ep.name] = new
            elif old.builtin or new.builtin:
                keep, drop = (old, new) if old.builtin else (new, old)
                warnings.warn(
                    f"kvbench: plugin distribution {drop.dist!r} registers {self.kind} "
                    f"{ep.name!r}, a built-in name (distribution {keep.dist!r}); the built-in wins",
                    stacklevel=3,
                )
                found[ep.name] = keep
            elif old.dist != new.dist:
                old.clash.append(new.dist)
        found.update(self._code)
        self._entries = found
        return found

    def names(self) -> list[str]:
        """Every registered name, sorted."""
        return sorted(self.entries())

    def __contains__(self, name: object) -> bool:
        return name in self.entries()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def get(self, name: str, where: str = "") -> T:
        """The object registered as ``name``, loading its entry point on first use.

        ``where``: a prefix for messages (``"suite.yaml: methods[2]"``).

        Raises
        ------
        UnknownName
            No such name (the message has close matches and every registered name).
        RegistryError
            The plugin failed to import, its object failed ``check``, or several plugins
            claim the name."""
        entries = self.entries()
        if not isinstance(name, str) or name not in entries:  # a suite may hold any YAML value
            hint = did_you_mean(name, entries)
            if self.group and not any(e.dist == BUILTIN_DIST for e in entries.values()):
                hint += (
                    f"; no entry point of kvbench itself in group {self.group!r}: the install "
                    "is broken (rerun `pip install -e .` in the kvbench checkout)"
                )
            pre = f"{where}: " if where else ""
            raise UnknownName(
                f"{pre}unknown {self.kind} {name!r}{hint} ({self._listing(sorted(entries))})"
            )
        return self.load(entries[name])

    def load(self, entry: Entry[T]) -> T:
        """Load ``entry``'s object (once) and return it; see :meth:`get` for the errors."""
        if entry.clash:
            raise RegistryError(
                f"{self.kind} {entry.name!r} is registered by several plugins: "
                f"{', '.join(sorted({entry.dist, *entry.clash}))}; uninstall all but one"
            )
        if entry.obj is None:
            assert entry.entry_point is not None
            try:
                obj = entry.entry_point.load()
            except Exception as exc:  # noqa: BLE001 - any import failure: RegistryError
                # what it catches: any error importing the plugin's module or object (a missing
                # dependency, a bug at import); kept in entry.error (list views show it) and
                # re-raised as RegistryError naming the plugin and its distribution
                entry.error = f"{type(exc).__name__}: {exc}"
                raise RegistryError(
                    f"{self.kind} {entry.name!r} from distribution {entry.dist!r} failed to "
                    f"load ({entry.value}): {entry.error}"
                ) from exc
            try:
                entry.obj = self._check(entry.name, obj) if self._check is not None else obj
            except (TypeError, ValueError) as exc:
                entry.error = str(exc)
                raise RegistryError(
                    f"{self.kind} {entry.name!r} from {entry.dist!r}: {entry.error}"
                ) from exc
            entry.error = None
        return entry.obj

    def loaded(self) -> dict[str, T]:
        """The names loaded so far -> their objects (nothing is loaded by this call)."""
        return {n: e.obj for n, e in self.entries().items() if e.obj is not None}
