"""Method registry over the entry-point group ``kvbench.methods``.

Built-in methods are declared in kvbench's own ``pyproject.toml`` exactly like third-party
plugins.  Entry points are loaded lazily (on first use of a name).  Rules (docs/design.md#concepts):

* a plugin that fails to import is reported with its distribution name and does not break the
  others (``kvbench list`` shows the error);
* an unknown name gets a "did you mean";
* a plugin that reuses a built-in's name is ignored with a warning naming both distributions;
* two plugins with one name are an error naming both.
"""

from __future__ import annotations

import difflib
import warnings
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from kvbench.kv.method import Method

GROUP = "kvbench.methods"
BUILTIN_DIST = "kvbench"


class MethodLoadError(RuntimeError):
    """A registered method could not be imported; names the distribution."""


@dataclass
class MethodEntry:
    """One registered name: where it comes from and, once loaded, its class."""

    name: str
    value: str
    dist: str
    entry_point: EntryPoint | None = None
    cls: type[Method] | None = None
    error: str | None = None
    clash: list[str] = field(default_factory=list)

    @property
    def builtin(self) -> bool:
        return self.dist == BUILTIN_DIST

    def load(self) -> type[Method]:
        if self.clash:
            raise MethodLoadError(
                f"method {self.name!r} is registered by several plugins: "
                f"{', '.join(sorted({self.dist, *self.clash}))}; uninstall all but one"
            )
        if self.cls is None:
            try:
                obj = self.entry_point.load()
            except Exception as exc:  # noqa: BLE001 - any plugin failure is reported, not raised
                self.error = f"{type(exc).__name__}: {exc}"
                raise MethodLoadError(
                    f"method {self.name!r} from distribution {self.dist!r} failed to load "
                    f"({self.value}): {self.error}"
                ) from exc
            if not (isinstance(obj, type) and issubclass(obj, Method)):
                self.error = f"{self.value} is not a kvbench.kv.method.Method subclass"
                raise MethodLoadError(f"method {self.name!r} from {self.dist!r}: {self.error}")
            self.cls = obj
        return self.cls


_ENTRIES: dict[str, MethodEntry] | None = None


def _dist_name(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else "<unknown>"


def discover(refresh: bool = False) -> dict[str, MethodEntry]:
    """All registered names -> entries (nothing imported yet)."""
    global _ENTRIES
    if _ENTRIES is not None and not refresh:
        return _ENTRIES
    found: dict[str, MethodEntry] = {}
    seen: set[tuple[str, str, str]] = set()
    for ep in entry_points(group=GROUP):
        dist = _dist_name(ep)
        key = (ep.name, ep.value, dist)
        if key in seen:  # the same distribution visible twice on sys.path
            continue
        seen.add(key)
        new = MethodEntry(ep.name, ep.value, dist, ep)
        old = found.get(ep.name)
        if old is None:
            found[ep.name] = new
        elif old.builtin or new.builtin:
            keep, drop = (old, new) if old.builtin else (new, old)
            warnings.warn(
                f"kvbench: plugin distribution {drop.dist!r} registers method {ep.name!r}, a "
                f"built-in name (distribution {keep.dist!r}); the built-in wins",
                stacklevel=2,
            )
            found[ep.name] = keep
        elif old.dist != new.dist:
            old.clash.append(new.dist)
    _ENTRIES = found
    return found


def get_method_class(name: str) -> type[Method]:
    """The class registered as ``name``.

    Raises
    ------
    ValueError
        Unknown name (with close matches and the full list).
    MethodLoadError
        The plugin failed to import, or two plugins claim the name.
    """
    entries = discover()
    if name not in entries:
        close = difflib.get_close_matches(name, list(entries), n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"unknown method {name!r}{hint} (registered: {sorted(entries)})")
    cls = entries[name].load()
    return cls


def get_method(name: str, **config: Any) -> Method:
    """Build the method registered as ``name`` with config fields ``config``.

    Unknown config fields raise ``ValueError`` naming them and the allowed fields.
    """
    cls = get_method_class(name)
    method = cls(cls.Config.from_dict(config, where=f"method {name!r}"))
    method.name = name
    return method


def list_methods() -> list[dict[str, Any]]:
    """One dict per registered name: ``name, distribution, description, capabilities, error``.

    Loads every entry point; failures are reported in ``error`` instead of raised.
    """
    out = []
    for name, entry in sorted(discover().items()):
        row: dict[str, Any] = {
            "name": name,
            "distribution": entry.dist,
            "entry_point": entry.value,
            "description": "",
            "capabilities": {},
            "error": None,
        }
        try:
            cls = entry.load()
            row["description"] = cls.description
            row["capabilities"] = cls.capabilities.to_dict()
        except MethodLoadError as exc:
            row["error"] = str(exc)
        out.append(row)
    return out
