"""The method registry: :data:`METHODS`, a :class:`kvbench.registry.Registry` over the
entry-point group ``kvbench.methods``.

Built-in methods are declared in kvbench's own ``pyproject.toml`` exactly like third-party
plugins; the registry's rules (lazy loading, "did you mean", built-in names win, clashes and
load failures named by distribution) are :mod:`kvbench.registry`'s.
"""

from __future__ import annotations

from kvbench.cache.method import Method
from kvbench.registry import Registry, RegistryError

GROUP = "kvbench.methods"
#: the method every other is measured against (full precision): runs first, its records are the
#: tables' first rows and the reference of latency ratios and of the headline's bytes
BASELINE = "full"


def _method_class(name: str, obj: object) -> type[Method]:
    if not (isinstance(obj, type) and issubclass(obj, Method)):
        raise TypeError(f"{obj!r} is not a kvbench.cache.method.Method subclass")
    return obj


#: every method name -> its :class:`~kvbench.cache.method.Method` subclass
METHODS: Registry[type[Method]] = Registry("method", GROUP, _method_class)


def get_method_class(name: str) -> type[Method]:
    """The class registered as ``name``.

    Raises
    ------
    ValueError
        Unknown name (with close matches and the full list).
    RegistryError
        The plugin failed to import, or two plugins claim the name.
    """
    return METHODS.get(name)


def get_method(name: str, **config: object) -> Method:
    """Build the method registered as ``name`` with config fields ``config``.

    Unknown config fields raise ``ValueError`` naming them and the allowed fields.
    """
    cls = get_method_class(name)
    method = cls(cls.Config.from_dict(config, where=f"method {name!r}"))
    method.name = name
    return method


def list_methods() -> list[dict[str, str | dict[str, bool] | None]]:
    """One dict per registered name: ``name, distribution, entry_point, description,
    capabilities, error``.  Loads every entry point; failures are reported in ``error``
    instead of raised."""
    out = []
    for name, entry in sorted(METHODS.entries().items()):
        row: dict[str, str | dict[str, bool] | None] = {
            "name": name,
            "distribution": entry.dist,
            "entry_point": entry.value,
            "description": "",
            "capabilities": {},
            "error": None,
        }
        try:
            cls = METHODS.load(entry)
            row["description"] = cls.description
            row["capabilities"] = cls.capabilities.to_dict()
        except RegistryError as exc:
            row["error"] = str(exc)
        out.append(row)
    return out
