"""Hub access rules shared by model and dataset loading: offline switches and a reachability probe.

Nothing here downloads; callers (:mod:`kvbench.hf.models`, :mod:`kvbench.data.loaders`) decide
what to try and fall back to local files.
"""

from __future__ import annotations

import functools
import os
import socket
from urllib.parse import urlparse


def _env_true(*names: str) -> bool:
    return any(os.environ.get(n, "").strip().lower() in {"1", "true", "yes", "on"} for n in names)


def offline_requested() -> bool:
    """True when ``KVBENCH_OFFLINE`` is set to 1/true/yes: skip every hub attempt."""
    return _env_true("KVBENCH_OFFLINE")


def hf_offline_env() -> bool:
    """True when HF_HUB_OFFLINE / HF_DATASETS_OFFLINE / TRANSFORMERS_OFFLINE is set: the hub
    libraries then read only their local cache, which fails fast when nothing is cached."""
    return _env_true("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


@functools.lru_cache(maxsize=4)
def _probe(host: str, port: int, timeout: float) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def hub_reachable(timeout: float | None = None) -> bool:
    """Whether the hub host (``$HF_ENDPOINT``, default huggingface.co:443) accepts a TCP connection.

    Cached per process. With a proxy configured (``HTTPS_PROXY``/``ALL_PROXY``) no direct probe is
    possible and True is returned. ``timeout`` in seconds defaults to ``$KVBENCH_HUB_TIMEOUT`` or 2.
    """
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (80 if url.scheme == "http" else 443)
    t = float(timeout if timeout is not None else os.environ.get("KVBENCH_HUB_TIMEOUT", 2.0))
    return _probe(url.hostname or "huggingface.co", port, t)
