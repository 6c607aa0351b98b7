"""Checks a suite passes before any model loads: field types and ranges, dtype and device
availability, the output folder's writability, threads that fit the machine.

Every error is a ``ValueError`` whose message starts with ``<file>: <entry>:`` (``seed``,
``model``, ``methods[2] (kivi[bits=9])``, ``workloads[1] (fidelity)``) and names the field and
the allowed values.  A suite's checks collect their errors (:class:`Problems`) and refuse once
with all of them (:class:`SuiteErrors`, a ``ValueError``).  Data names, hub and local
availability of models and datasets are checked by the pre-flight of assets, not here.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol, cast

from kvbench import fields as kf
from kvbench.fields import Field, FieldErrors
from kvbench.registry import did_you_mean

#: model dtypes the loaders accept
MODEL_DTYPES = ("float32", "float16", "bfloat16")
#: the form of a model entry's fields (:func:`check_devices` checks the device exists here)
MODEL_FIELDS = {
    "id": Field(str, nonempty=True, text="a model id or a local folder"),
    "dtype": Field(str, choices=MODEL_DTYPES),
    "device": Field(str, text="a string such as 'cpu' or 'cuda:0'"),
}


class SuiteErrors(ValueError):
    """Every error found in one suite, refused at once.

    ``errors`` holds the messages in the order they were found (a repeated one once), each
    ``"<file>: <entry>: ..."``.  The text is the message itself when there is one error, else a
    header and one line per error, the file name said once::

        suite.yaml: 3 errors:
          methods[1]: unknown method 'kivii'; did you mean 'kivi'? (registered: [...])
          methods[5] (kivi): KIVIConfig: field 'bits': 9 is not allowed; allowed: 1..8 or 16
          workloads[0] (fidelity): tokens=9000 exceeds the maximum context of ..., 8192 tokens ...
    """

    def __init__(self, path: str, errors: Sequence[str]) -> None:
        self.path = path
        self.errors = list(dict.fromkeys(errors))
        super().__init__(format_errors(path, self.errors))


def format_errors(path: str, errors: Sequence[str]) -> str:
    """The text of :class:`SuiteErrors`: the one message, or ``"<path>: N errors:"`` and each
    message on its own indented line without its leading ``"<path>: "``."""
    if len(errors) == 1:
        return errors[0]
    pre = f"{path}: "
    lines = [e[len(pre) :] if e.startswith(pre) else e for e in errors]
    return f"{path}: {len(errors)} errors:\n" + "\n".join("  " + line for line in lines)


def messages(exc: Exception) -> list[str]:
    """The refusals an exception carries: each field's of a :class:`kvbench.fields.FieldErrors`,
    else its one message."""
    return list(exc.messages) if isinstance(exc, FieldErrors) else [str(exc)]


class Problems:
    """Collects the errors of a suite's checks, so that one refusal names every bad field.

    Each check runs in ``with problems.catch():``: a ``ValueError`` it raises is recorded (the
    messages of a :class:`SuiteErrors` one by one) and the code after the block goes on.
    :meth:`raise_if_any` then raises :class:`SuiteErrors` with all of them."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.errors: list[str] = []

    @contextmanager
    def catch(self) -> Iterator[None]:
        """Record a ``ValueError`` raised in the block instead of letting it through."""
        try:
            yield
        except SuiteErrors as exc:
            self.errors.extend(exc.errors)
        except ValueError as exc:
            self.errors.extend(messages(exc))

    def raise_if_any(self) -> None:
        """Raise :class:`SuiteErrors` with every recorded error, if there is one."""
        if self.errors:
            raise SuiteErrors(self.path, self.errors)


class SuiteModels(Protocol):
    """What :func:`check_devices` reads of a :class:`kvbench.bench.suite.Suite`."""

    @property
    def path(self) -> str: ...

    @property
    def models(self) -> Sequence[Mapping[str, object] | None]: ...


class MethodEntry(Protocol):
    """What :func:`check_methods_for_model` reads of a :class:`kvbench.bench.suite.MethodSpec`."""

    @property
    def name(self) -> str: ...

    @property
    def config(self) -> Mapping[str, object]: ...

    @property
    def label(self) -> str: ...

    @property
    def where(self) -> str: ...


def check_keys(
    entry: Mapping[str, object], allowed: Iterable[str], where: str, kind: str = ""
) -> None:
    """``ValueError`` ``"<where>: unknown <kind> key(s) [...]; allowed: [...]"`` (with "did you
    mean") when ``entry`` has a key outside ``allowed``."""
    names = sorted(allowed)
    unknown = sorted(set(entry) - set(names))
    if unknown:
        raise ValueError(
            f"{where}: unknown {kind + ' ' if kind else ''}key(s) {unknown}; allowed: {names}"
            + did_you_mean(unknown[0], names, n=2, cutoff=0.6)
        )


def check_entry(
    entry: object,
    where: str,
    allowed: Iterable[str],
    required: str | None = None,
    kind: str = "",
    shape: str | None = None,
) -> dict[str, object]:
    """``entry`` as a mapping that holds ``required`` (when given) and only ``allowed`` keys
    (:func:`check_keys`).  Otherwise ``ValueError`` ``"<where>: <shape>"``, ``shape``
    defaulting to "must be a mapping [with '<required>']"."""
    if not isinstance(entry, dict) or (required is not None and required not in entry):
        with_key = f" with {required!r}" if required is not None else ""
        raise ValueError(f"{where}: {shape or 'must be a mapping' + with_key}")
    check_keys(entry, allowed, where, kind)
    return entry


def check_int(value: object, where: str, field: str, low: int = 0) -> int:
    """``value`` as an int >= ``low`` (bools and strings rejected; :mod:`kvbench.fields`)."""
    Field(int, low=low).check(value, field, where)
    return cast(int, value)


def free_cpus() -> int:
    """CPUs this process may use and that are not busy: the affinity mask's size minus the
    1-minute load average of the other processes (at least 1)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0]
    except (AttributeError, OSError):
        busy = 0.0
    return max(1, min(n, int(n - busy + 0.5)))


def check_threads(value: object, where: str) -> int | None:
    """``threads:``: ``None``/``auto`` (the runner picks :func:`free_cpus`) or an integer >= 1."""
    if value is None or value == "auto":
        return None
    return check_int(value, where, "threads", 1)


def check_calibration(
    block: object, where: str, default: Mapping[str, str | int]
) -> dict[str, object]:
    """``calibration: {text: NAME, tokens: N}`` filled from ``default``; the text's name is
    checked with the data (pre-flight), its type and the token count here."""
    if block is None:
        return dict(default)
    shape = "calibration must be a mapping {text: NAME, tokens: N}"
    out = {**default, **check_entry(block, where, default, kind="calibration", shape=shape)}
    problems = Problems(where)
    with problems.catch():
        Field(str, nonempty=True, text="a text name").check(out["text"], "calibration.text", where)
    with problems.catch():
        check_int(out["tokens"], where, "calibration.tokens", 16)
    problems.raise_if_any()
    return out


def device_problem(device: object) -> str | None:
    """Why ``device`` cannot be used by this torch here, or ``None``."""
    import torch

    if not isinstance(device, str):
        return kf.message("", "device", device, "a string such as 'cpu' or 'cuda:0'")
    kind, _, index = device.partition(":")
    if kind == "cpu" and not index:
        return None
    if kind == "cuda":
        if not torch.cuda.is_available():
            built = "a CUDA build of torch" if torch.version.cuda else "torch without CUDA"
            return f"device={device!r}: no CUDA device is available ({built}); use 'cpu'"
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            here = ", ".join(f"cuda:{i}" for i in range(torch.cuda.device_count()))
            return kf.message("", "device", device, f"cuda, {here}, cpu")
        return None
    if kind == "mps" and not index:
        ok = getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()
        return None if ok else f"device={device!r}: MPS is not available here; use 'cpu'"
    return kf.message("", "device", device, "cpu, cuda, cuda:N, mps")


def check_model(model: Mapping[str, object], where: str) -> None:
    """A model entry's ``id``, ``dtype`` and ``device`` (its form; :func:`check_devices`
    checks that it exists here, at run time).  :class:`SuiteErrors` names every bad field."""
    problems = Problems(where)
    with problems.catch():
        MODEL_FIELDS["id"].check(model["id"], "id", where)
    dtype = MODEL_FIELDS["dtype"]
    if not dtype.accepts(model["dtype"]):
        msg = kf.message(where, "dtype", model["dtype"], dtype.allowed())
        problems.errors.append(msg + did_you_mean(model["dtype"], MODEL_DTYPES, n=2, cutoff=0.6))
    with problems.catch():
        MODEL_FIELDS["device"].check(model["device"], "device", where)
    problems.raise_if_any()


def check_devices(suite: SuiteModels) -> None:
    """Every model's device exists here (a suite for CUDA fails on a CPU-only torch before any
    model loads).  :class:`SuiteErrors` names every model whose device cannot be used."""
    problems = Problems(suite.path)
    for i, model in enumerate(suite.models):
        why = model is not None and device_problem(model["device"])
        if why:
            where = "model" if len(suite.models) == 1 else f"models[{i}]"
            problems.errors.append(f"{suite.path}: {where}: {why}")
    problems.raise_if_any()


def check_labels(labels: list[tuple[str, str]], path: str) -> None:
    """Two method entries with one label would make their records indistinguishable:
    :class:`SuiteErrors` names every such pair."""
    problems = Problems(path)
    seen: dict[str, str] = {}
    for where, label in labels:
        if label in seen and seen[label] != where:
            problems.errors.append(
                f"{path}: {seen[label]} and {where} have the same label {label!r}; "
                "give one of them a distinct 'label:'"
            )
        seen.setdefault(label, where)
    problems.raise_if_any()


def check_output(out: str | Path) -> None:
    """The result folder exists or can be made, is a folder, and takes a file.

    Raises ``ValueError`` naming the folder and the reason (a file in the way, read-only)."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise ValueError(f"--out {p}: is a file, not a folder; choose another --out")
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".kvbench-write-check.", dir=p)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise ValueError(
            f"--out {p}: cannot write records there ({exc.strerror or exc}); choose a writable "
            "folder with --out"
        ) from None


def check_methods_for_model(
    methods: Sequence[MethodEntry], info: dict[str, object], path: str
) -> None:
    """Build one layer of every method on the loaded model's shape (``head_dim``,
    ``num_key_value_heads``), so a config that does not fit the model (a ``value_group_size``
    that does not divide ``head_dim``) fails before the first run.  :class:`SuiteErrors` names
    every entry that does not fit."""
    from kvbench.cache.registry import get_method

    d, h = info.get("head_dim"), info.get("num_key_value_heads") or info.get("num_kv_heads")
    if not isinstance(d, int) or not isinstance(h, int) or not d or not h:
        return
    problems = Problems(path)
    for spec in methods:
        try:
            m = get_method(spec.name, **spec.config).for_model(info)
            if m.capabilities.layer_cache and not m.needs_calibration:  # not fitted yet
                m.new_layer(0, h, d)
                m.average_bits(head_dim=d, tokens=1024)
        except (ValueError, TypeError) as exc:
            problems.errors.append(f"{path}: {spec.where} ({spec.label}): {exc}")
    problems.raise_if_any()
