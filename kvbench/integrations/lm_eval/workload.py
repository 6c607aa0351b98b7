"""``lm_eval``: lm-evaluation-harness tasks run through kvbench's lm-eval backend.

Suite entry::

    - {type: lm_eval, tasks: [gsm8k_local], num_fewshot: 5, limit: 50}

Per method configuration, lm-eval's ``simple_evaluate`` runs ``tasks`` with
:class:`kvbench.integrations.lm_eval.backend.KVBenchLM` on the suite's model (one request at a time, a
fresh cache of the method per request; protocol in ``docs/lm-eval.md``).  Metrics, named
``lm_eval.<task>.<lm-eval key>`` with lm-eval's own key (``exact_match,strict-match``,
``exact_match_stderr,strict-match``, ``acc,none``...), include every number of lm-eval's
``results`` (and ``groups``), plus ``lm_eval.<task>.kv_quantized_fraction`` and overall
``kv_quantized_fraction``: over every scored or generated position, the share of the tokens
before it that were read from quantized storage (0 when every context is shorter than the
method's full-precision residual), and ``nominal_key_bits`` / ``nominal_value_bits``.

The manifest holds lm-eval's version, task versions, configs, n-shot, sample counts and
higher-is-better flags; the per-sample log (lm-eval's samples, each with kvbench's per-request
entries) goes to ``<run_id>.samples.jsonl`` beside the record.

Parameters: ``tasks`` (list of lm-eval task or group names; required), ``num_fewshot`` (null =
the task's), ``limit`` (examples per task; ``--limit`` caps it), ``chunk`` (tokens per step
when scoring log-likelihoods; 1 = exact decode), ``protocol`` (``write-then-attend``, default,
or ``in-chunk-full``: docs/design.md#protocols; recorded, with the method's
``prefill_attention``, in the manifest's ``protocol`` text), ``include_path`` (extra task
folders),
``gen_kwargs`` (mapping that overrides the tasks' generation settings, e.g. ``{max_gen_toks:
64}``), ``apply_chat_template``, ``fewshot_as_multiturn``, ``system_instruction``,
``bootstrap_iters`` (lm-eval's, for stderr of non-mean aggregations).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbench.bench.context import RunContext
from kvbench.bench.metrics import LM_EVAL_DIRECTIONS
from kvbench.bench.workloads import LOWER, NONE, Result, Workload, reject
from kvbench.cache.method import Method
from kvbench.fields import Field
from kvbench.hf.cache import DEFAULT_PROTOCOL, STEP_PROTOCOL_FIELD
from kvbench.jsontypes import JSONValue

if TYPE_CHECKING:
    from kvbench.integrations.lm_eval.coverage import RequestEntry


def _number(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


class LMEval(Workload):
    type = "lm_eval"
    #: ``lm_eval.<task>.<metric>[,<filter>]`` take lm-eval's own direction of ``<metric>``;
    #: standard errors, coverage and counts are informational
    METRICS = {
        **{f"lm_eval.*.{m}": d for m, d in LM_EVAL_DIRECTIONS.items()},
        **{f"lm_eval.*.{m},*": d for m, d in LM_EVAL_DIRECTIONS.items()},
        "lm_eval.*_stderr*": NONE,
        "lm_eval.*.kv_quantized_fraction": NONE,
        "kv_quantized_fraction": NONE,
        "num_requests": NONE,
        "nominal_key_bits": LOWER,
        "nominal_value_bits": LOWER,
    }
    layer_cache = False  # any transformers cache: peers run through make_hf_cache
    PARAMS = {
        "tasks": ...,
        "num_fewshot": None,
        "limit": None,
        "chunk": 1,
        "protocol": DEFAULT_PROTOCOL,
        "include_path": None,
        "gen_kwargs": None,
        "apply_chat_template": False,
        "fewshot_as_multiturn": False,
        "system_instruction": None,
        "bootstrap_iters": 100000,
    }
    LIST_PARAMS = frozenset({"tasks", "include_path"})
    FIELDS = {
        "tasks": Field(str, shape="one-or-list", text="an lm-eval task name or a non-empty list"),
        "num_fewshot": Field(int, low=0, optional=True),
        "limit": Field(int, low=0, optional=True),
        "chunk": Field(int, low=1),
        "protocol": STEP_PROTOCOL_FIELD,
        "include_path": Field(
            str, shape="one-or-list", min_items=0, optional=True, text="a folder or a list"
        ),
        "apply_chat_template": Field(bool),
        "fewshot_as_multiturn": Field(bool),
        "bootstrap_iters": Field(int, low=0),
    }

    @classmethod
    def check(cls, spec: dict[str, JSONValue], pre: str) -> None:
        for k in ("tasks", "include_path"):
            if isinstance(spec[k], str):
                spec[k] = [spec[k]]
        if spec["gen_kwargs"] is not None and not isinstance(spec["gen_kwargs"], dict):
            reject(pre, "gen_kwargs", spec["gen_kwargs"], "None or a mapping ({max_gen_toks: 64})")

    def prepare(self, ctx: RunContext) -> None:
        """Check lm-eval, build the task manager and load every task once (so a dataset that
        cannot be loaded here fails before any method runs: ``FileNotFoundError`` naming the
        task and the local-YAML route)."""
        from kvbench.integrations.lm_eval import require_lm_eval

        require_lm_eval()
        from kvbench.integrations.lm_eval.tasks import hub_guard, local_task_names, task_manager

        key = ("lm_eval", tuple(self.spec["tasks"]), tuple(self.spec["include_path"] or ()))
        if key not in ctx.shared.extra:
            tm = task_manager(self.spec["tasks"], self.spec["include_path"] or ())
            unknown = [t for t in self.spec["tasks"] if t not in tm.all_tasks]
            if unknown:
                raise ValueError(
                    f"lm_eval workload: unknown task(s) {unknown}; kvbench's local tasks: "
                    f"{sorted(local_task_names())}; "
                    "see `lm-eval ls tasks` (or pass include_path)"
                )
            with hub_guard():
                tm.load_task_or_group(self.spec["tasks"])
            ctx.shared.extra[key] = tm
        self.task_manager = ctx.shared.extra[key]

    def limit(self, ctx: RunContext) -> int | None:
        lim = self.spec["limit"]
        if ctx.limit is not None:
            lim = ctx.limit if lim is None else min(lim, ctx.limit)
        return lim

    def run(self, ctx: RunContext, method: Method) -> Result:
        import lm_eval
        from lm_eval.utils import handle_non_serializable

        from kvbench.integrations.lm_eval.backend import KVBenchLM
        from kvbench.integrations.lm_eval.coverage import per_task, quantized_fraction
        from kvbench.integrations.lm_eval.tasks import LOADED, hub_guard, serial_bootstrap

        lm = KVBenchLM(
            pretrained=ctx.model,
            tokenizer=ctx.tokenizer,
            method=method,
            chunk=self.spec["chunk"],
            protocol=self.spec["protocol"],
        )
        s = self.spec
        with hub_guard(), serial_bootstrap():
            out = lm_eval.simple_evaluate(
                model=lm,
                tasks=list(s["tasks"]),
                num_fewshot=s["num_fewshot"],
                limit=self.limit(ctx),
                task_manager=self.task_manager,
                log_samples=True,
                gen_kwargs=dict(s["gen_kwargs"]) if s["gen_kwargs"] else None,
                apply_chat_template=s["apply_chat_template"],
                fewshot_as_multiturn=s["fewshot_as_multiturn"],
                system_instruction=s["system_instruction"],
                bootstrap_iters=s["bootstrap_iters"],
                random_seed=ctx.seed,
                numpy_random_seed=1234 + ctx.seed,
                torch_random_seed=1234 + ctx.seed,
                fewshot_random_seed=1234 + ctx.seed,
            )
        metrics: dict[str, float] = {}
        for section in ("results", "groups"):
            for task, vals in (out.get(section) or {}).items():
                for k, v in vals.items():
                    x = _number(v)
                    if x is not None and k not in ("sample_len",):
                        metrics[f"lm_eval.{task}.{k}"] = x
        log = lm.request_log
        for task, f in per_task(log).items():
            if f is not None:  # None: a cache that is not kvbench's (peer), not measured
                metrics[f"lm_eval.{task}.kv_quantized_fraction"] = f
        f = quantized_fraction(log) if log else None
        if f is not None:
            metrics["kv_quantized_fraction"] = f
        metrics["num_requests"] = float(len(log))
        bits = method.average_bits(head_dim=ctx.model_info.get("head_dim", 128))
        metrics["nominal_key_bits"] = bits["key_bits"]
        metrics["nominal_value_bits"] = bits["value_bits"]
        samples = []
        entries_by_doc: dict[tuple[str | None, int | None], list[RequestEntry]] = {}
        for e in log:
            entries_by_doc.setdefault((e["task"], e["doc_id"]), []).append(e)
        for task, rows in (out.get("samples") or {}).items():
            for row in rows:
                samples.append(
                    {"task": task, **row, "kvbench": entries_by_doc.get((task, row["doc_id"]), [])}
                )
        import json

        samples = [json.loads(json.dumps(r, default=handle_non_serializable)) for r in samples]
        info = {
            "lm_eval": json.loads(
                json.dumps(
                    {
                        "version": _version("lm_eval"),
                        "tasks": s["tasks"],
                        "limit": self.limit(ctx),
                        "versions": out.get("versions"),
                        "n-shot": out.get("n-shot"),
                        "n-samples": out.get("n-samples"),
                        "higher_is_better": out.get("higher_is_better"),
                        "configs": out.get("configs"),
                        "task_hashes": out.get("task_hashes"),
                        "lm_eval_config": out.get("config"),
                    },
                    default=handle_non_serializable,
                )
            ),
            "datasets": dict(LOADED),
            "protocol": (
                "kvbench lm-eval backend: batch 1, fresh cache per request; generate_until "
                "prefills the prompt and decodes every token through the cache; loglikelihood "
                f"prefills the context but its last token, then feeds {s['chunk']} token(s) per "
                f"step through the cache; decode protocol {lm.cache_protocol}"
                f", prefill_attention {method.config.prefill_attention}"
            ),
            "samples_file": "samples.jsonl",
        }
        return Result(metrics, None, info, files={"samples.jsonl": samples})


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None
