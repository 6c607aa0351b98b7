"""The ``--output_path`` folder of a ``--model kvbench`` run, named after what changes its scores.

lm-eval names the results folder after ``pretrained`` only, so every method would write into
one ``default/`` folder.  :func:`output_folder_name` adds the method and its configuration:
``pretrained=default,method=kivi,bits=2,value_bits=2`` -> ``default__kivi-bits2-value_bits2``.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

#: model arguments that do not change the scores (left out of the name)
NOT_IN_NAME = frozenset(
    {"pretrained", "method", "method_config", "device", "min_quantized_fraction", "tokenizer"}
)
#: longest folder name; a longer one keeps this many characters less 11, then a hash
MAX_NAME = 160


def _piece(value: object) -> str:
    if isinstance(value, (dict, list, tuple)):
        value = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(value)).strip("_") or "_"


def _parse(model_args: str | dict[str, object] | None) -> dict[str, object]:
    if isinstance(model_args, dict):
        return dict(model_args)
    from lm_eval.utils import simple_parse_args_string

    return simple_parse_args_string(model_args or "")


def output_folder_name(model_args: str | dict[str, object] | None) -> str:
    """``<model>__<method>[-<field><value>...]`` for lm-eval's ``model_args`` (a
    ``k=v,...`` string or a mapping).

    ``<model>`` is ``pretrained`` (default ``default``); ``<method>`` is ``method`` (else the
    ``method_config`` file's ``method:``, else ``full``); the fields are the ``method_config``
    file's fields (``calibration`` included) overridden by every other model argument except
    :data:`NOT_IN_NAME`, sorted by name.  Characters other than letters, digits, ``.``, ``_``
    and ``-`` become ``_``; a name over :data:`MAX_NAME` characters is cut and ends in a hash
    of the whole name, so two configurations never share a folder.

    Raises ``ValueError`` for a ``method_config`` that is not a YAML mapping file (as the
    backend does)."""
    from kvbench.integrations.lm_eval.backend import read_method_config

    args = _parse(model_args)
    fields: dict[str, object] = {}
    if args.get("method_config"):
        fields = read_method_config(Path(str(args["method_config"])))
    method = args.get("method") or fields.pop("method", None) or "full"
    fields.pop("method", None)
    fields.update({k: v for k, v in args.items() if k not in NOT_IN_NAME})
    model = _piece(args.get("pretrained") or "default")
    name = f"{model}__{_piece(method)}" + "".join(
        f"-{_piece(k)}{_piece(fields[k])}" for k in sorted(fields)
    )
    if len(name) > MAX_NAME:
        digest = hashlib.sha256(name.encode()).hexdigest()[:10]
        name = f"{name[: MAX_NAME - 11]}-{digest}"
    return name
