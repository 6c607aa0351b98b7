"""Reach a Ray cluster and size the work for it: :func:`connect` (with the token-authentication
diagnosis, :func:`auth_cause`), and the per-worker resource request (:func:`request_for`) checked
against the cluster's nodes (:func:`check_capacity`) before anything is submitted."""

from __future__ import annotations

import logging
import socket
from types import ModuleType
from typing import Any

from kvbench.bench.runner import PlannedRun
from kvbench.bench.suite import Suite

INSTALL_HINT = (
    "pip install -e '.[ray]' in the kvbench clone (kvbench is not on the package index; make env "
    "installs it), or pip install 'ray>=2.40,<3' into kvbench's environment"
)
#: seconds to reach a cluster's head (``--address``) before giving up
CONNECT_TIMEOUT_S = 15.0
RAY_PORT, CLIENT_PORT = 6379, 10001


class RayUnavailableError(RuntimeError):
    """``--executor ray`` without Ray installed; names the extra to install."""


class ClusterConnectError(RuntimeError):
    """The Ray cluster at ``--address`` cannot be reached (nothing was run or written)."""


class ClusterAuthError(ClusterConnectError):
    """The Ray cluster at ``--address`` uses token authentication (``RAY_AUTH_MODE=token``) and
    this process has no valid token; the message says how to pass it."""


#: what Ray's token-authentication failures say: ``ray.exceptions.AuthenticationError`` (Ray
#: >= 2.50) and the gRPC status a head answers a request without a valid token with, which
#: ``ray.init`` wraps in a bare "Failed to connect to Ray cluster at ..."
AUTH_MARKERS = ("unauthenticated", "authentication token", "authenticationerror")


def import_ray() -> ModuleType:
    """``import ray`` or :class:`RayUnavailableError` naming :data:`INSTALL_HINT`."""
    try:
        import ray
    except ImportError as exc:
        raise RayUnavailableError(
            f"--executor ray needs Ray, which is not installed here ({exc}); "
            f"install it with: {INSTALL_HINT}"
        ) from None
    return ray


def auth_cause(exc: BaseException) -> BaseException | None:
    """The token-authentication failure in ``exc``'s chain (``__cause__``/``__context__``):
    a ``ray.exceptions.AuthenticationError`` or an error whose text names the missing or
    invalid token (:data:`AUTH_MARKERS`); ``None`` when the failure is something else."""
    import ray.exceptions

    # (Ray's AuthenticationError exists from Ray 2.50; its errors may carry a ``message``)
    auth_type = getattr(ray.exceptions, "AuthenticationError", ())
    seen: set[int] = set()
    err: BaseException | None = exc
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = f"{type(err).__name__} {getattr(err, 'message', '')} {err}".lower()
        if isinstance(err, auth_type) or any(m in text for m in AUTH_MARKERS):
            return err
        err = err.__cause__ or err.__context__
    return None


def auth_message(address: str | None, cause: BaseException) -> str:
    """The :class:`ClusterAuthError` text: the cluster needs a token, and the variables and
    file through which Ray reads it."""
    said = str(getattr(cause, "message", "") or cause).strip().splitlines()
    first = said[0][:200] if said else type(cause).__name__
    return (
        f"the Ray cluster at --address {address!r} requires token authentication "
        f"(RAY_AUTH_MODE=token, the default of recent Ray releases) and this process has no "
        f"valid token (Ray: {first}). Pass the cluster's token (print it on the head node with "
        "`ray get-auth-token`): export RAY_AUTH_MODE=token and either RAY_AUTH_TOKEN=<token> "
        "or the token in the file ~/.ray/auth_token (another file: RAY_AUTH_TOKEN_PATH=<file>) "
        "before `kvbench run`; docs/cluster.md#token-authentication"
    )


def _host_port(address: str) -> tuple[str, int]:
    client = address.startswith("ray://")
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        host, port = rest, str(CLIENT_PORT if client else RAY_PORT)
    return host.strip("[]"), int(port)


def connect(address: str | None, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    """Connect this process to Ray; returns whether a local Ray instance was started here
    (which the caller shuts down).  An already initialized Ray (e.g. ``ray.init`` in a test or a
    notebook) is used as is.  ``address``: ``None`` (start a local instance on this machine),
    ``"auto"`` (the cluster started on this node with ``ray start``), ``HOST:PORT`` (the head's
    GCS port, 6379) or ``ray://HOST:PORT`` (Ray Client, 10001).

    Raises
    ------
    RayUnavailableError
        Ray is not installed.
    ClusterConnectError
        ``HOST:PORT`` not reachable within ``timeout_s`` seconds (a TCP probe of the head before
        Ray's own, longer retry loop), or Ray refusing the address (``auto`` with no cluster).
    ClusterAuthError
        The cluster uses token authentication and this process has no valid token
        (:func:`auth_cause` found it in Ray's error); the message names ``RAY_AUTH_MODE``,
        ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` and ``~/.ray/auth_token``.
    """
    ray = import_ray()
    if address is not None and address not in ("auto", "local"):
        host, port = _host_port(address)
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
        except OSError as exc:
            raise ClusterConnectError(
                f"cannot reach a Ray cluster at --address {address!r} ({host}:{port}) within "
                f"{timeout_s:g} s: {exc}; start its head with `ray start --head` and pass the "
                "address it prints (docs/cluster.md)"
            ) from None
    if ray.is_initialized():
        return False
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
    except Exception as exc:  # whatever ray.init raises (its AuthenticationError subclasses
        # none of the three below): a token failure is raised as ClusterAuthError, a connection
        # failure as ClusterConnectError, anything else as it is
        cause = auth_cause(exc)
        if cause is not None:
            raise ClusterAuthError(auth_message(address, cause)) from None
        if not isinstance(exc, (ConnectionError, RuntimeError, ValueError)):
            raise
        raise ClusterConnectError(
            f"cannot connect to Ray at --address {address!r}: {exc}"
        ) from None
    return address in (None, "local")


# ------------------------------------------------------------------ what one worker requests
def request_for(suite: Suite, model_spec: dict[str, Any] | None) -> dict[str, float]:
    """The Ray resource request of one worker of ``model_spec``: the suite's ``resources:``
    with defaults ``num_cpus: 1`` and ``num_gpus: 1`` for a ``cuda`` model (else 0), in Ray's
    names (``CPU``, ``GPU``, ``memory``, custom names).

    Raises ``ValueError`` for a CUDA model with ``num_gpus: 0`` (a Ray worker without a GPU
    request sees no GPU)."""
    res = dict(suite.resources or {})
    spec = model_spec or {}
    cuda = str(spec.get("device", "cpu")).startswith("cuda")
    gpus = res.get("num_gpus", 1 if cuda else 0)
    if cuda and gpus == 0:
        raise ValueError(
            f"{suite.path}: model {spec['id']!r} runs on {spec['device']!r}, but "
            "resources.num_gpus is 0: a Ray worker sees only the GPUs it requests; "
            "set resources.num_gpus (e.g. 1)"
        )
    req = {"CPU": float(res.get("num_cpus", 1)), "GPU": float(gpus)}
    if "memory" in res:
        req["memory"] = float(res["memory"])
    req.update({k: float(v) for k, v in (res.get("custom") or {}).items()})
    return {k: v for k, v in req.items() if v > 0}


def actor_options(req: dict[str, float]) -> dict[str, float | dict[str, float]]:
    """Ray's actor options (``num_cpus``, ``num_gpus``, ``memory``, ``resources``) of request
    ``req`` (:func:`request_for`)."""
    custom = {k: v for k, v in req.items() if k not in ("CPU", "GPU", "memory")}
    opts: dict[str, float | dict[str, float]] = {
        "num_cpus": req.get("CPU", 0.0),
        "num_gpus": req.get("GPU", 0.0),
    }
    if "memory" in req:
        opts["memory"] = req["memory"]
    if custom:
        opts["resources"] = custom
    return opts


def worker_threads(threads: int | None, cpus: float) -> int | None:
    """Torch threads of a worker that requests ``cpus`` CPUs: the suite's ``threads`` capped at
    ``cpus``, or ``cpus`` when the suite sets none (``threads`` as is below one CPU)."""
    if threads and cpus >= 1:
        return min(int(threads), int(cpus))
    if not threads and cpus >= 1:
        return int(cpus)
    return threads


# ------------------------------------------------------------------ what the cluster holds
def slots(nodes: list[dict[str, float]], req: dict[str, float]) -> int:
    """How many workers of request ``req`` the nodes' total resources hold at once."""
    total = 0
    for res in nodes:
        fit = [int(res.get(k, 0.0) // v + 1e-9) for k, v in req.items() if v > 0]
        total += min(fit) if fit else 1
    return total


def check_capacity(
    ray: ModuleType, suite: Suite, groups: list[list[PlannedRun]]
) -> dict[int, tuple[dict[str, float], int]]:
    """Per model index: (request, slots on the cluster).  Raises ``ValueError`` naming the
    first run and the request when no node of the cluster can hold one worker of a model
    (before anything is submitted)."""
    nodes: list[dict[str, float]] = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    out: dict[int, tuple[dict[str, float], int]] = {}
    for group in groups:
        spec = group[0].model_spec
        req = request_for(suite, spec)
        n = slots(nodes, req)
        if n == 0:
            largest = {k: max((r.get(k, 0.0) for r in nodes), default=0.0) for k in req}
            raise ValueError(
                f"{suite.path}: run {group[0].title!r} (model "
                f"{(spec or {}).get('id', 'none')!r}) requests {req} per worker, more than any "
                f"node of the Ray cluster has (largest per resource: {largest}); lower "
                "'resources' in the suite or add a node that has them"
            )
        out[group[0].model_index] = (req, n)
    return out
