"""Model shapes: a transformers model built from a config alone, with seeded random weights.

Bytes at rest, transient peaks and decode-step latency of a KV cache depend on the model's
shape (layers, KV heads, head_dim, RoPE), not on its weights' values; accuracy does.  A suite's
``model: {shape: llama-3.1-8b}`` builds the model class of a preset config kept in the
repository (``kvbench/hf/presets/<name>.json``, the published ``config.json`` of the hub id it
names) or, with the hub reachable, any hub id's config (``AutoConfig.from_pretrained``).

* ``materialize=False``: the model is built on the ``meta`` device (no memory; only shapes and
  the config are used, e.g. by the memory workload, which draws K/V of the shape from
  :mod:`kvbench.bench.synthetic_kv`, ``rope-outliers``);
* ``materialize=True``: built on the target device with transformers' own initialization
  (``_init_weights``: normal with ``initializer_range``) under ``torch.manual_seed(seed)``
  inside a forked RNG, so the same seed gives the same weights and the caller's RNG is left
  as it was.

``layers: N`` builds a slice: the first N decoder layers (all layers have one shape), recorded
as ``shape_layers`` with the full count in ``shape_num_hidden_layers``.  Records carry
``random_weights: True``; workloads whose results depend on the weights
(``Workload.accepts_random_weights = False``) refuse such a model before it loads.  Each preset's
geometry is in its JSON file (names: :func:`preset_names`; docs/design.md#model-shapes).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from contextlib import nullcontext
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from kvbench.hf.info import model_info, parse_dtype

if TYPE_CHECKING:  # annotations only: transformers is imported where a model is built
    from transformers import PretrainedConfig, PreTrainedModel

SOURCE_SHAPE = "shape (config only, seeded random weights)"
RANDOM_WEIGHTS_NOTE = "random weights: accuracy is meaningless; bytes and latency are not"


class ShapeError(ValueError):
    """An unknown shape, an unreachable hub for a hub id, or a bad slice."""


class Preset(TypedDict):
    """One ``presets/*.json`` file, plus the ``sha256`` of its text."""

    name: str
    hub_id: str
    aliases: list[str]
    note: str
    #: the published ``config.json`` (``model_type`` and the fields given to transformers'
    #: ``AutoConfig.for_model``)
    config: dict[str, Any]
    sha256: str


@cache
def _presets() -> dict[str, Preset]:
    """``{name or alias: preset mapping}`` read from the package's ``presets/*.json``."""
    out: dict[str, Preset] = {}
    for entry in resources.files("kvbench.hf").joinpath("presets").iterdir():
        if not entry.name.endswith(".json"):
            continue
        text = entry.read_text()
        preset = json.loads(text)
        preset["sha256"] = hashlib.sha256(text.encode()).hexdigest()
        for name in [preset["name"], *preset.get("aliases", [])]:
            out[name] = preset
    return out


def preset_names() -> list[str]:
    """Names accepted by ``shape:`` (presets and their aliases), sorted."""
    return sorted(_presets())


def preset(name: str) -> Preset:
    """The preset mapping ``{name, hub_id, aliases, note, config, sha256}`` of ``name``.

    Raises :class:`ShapeError` listing the known presets."""
    try:
        return _presets()[name]
    except KeyError:
        raise ShapeError(
            f"unknown model shape {name!r}; known presets: {preset_names()} "
            "(or a Hugging Face id when the hub is reachable)"
        ) from None


def check_shape_spec(shape: object, layers: object = None) -> None:
    """Cheap validation of a suite's ``model: {shape, layers}`` (no transformers import, no
    hub): ``shape`` must be a preset name or contain ``/`` (a hub id, checked when loaded);
    for a preset, ``layers`` must be an integer in ``[1, num_hidden_layers]``.  Raises
    :class:`ShapeError`."""
    if not isinstance(shape, str) or (shape not in _presets() and "/" not in shape):
        preset(str(shape))  # raises, naming the presets
    if layers is None:
        return
    full = preset(shape)["config"]["num_hidden_layers"] if shape in _presets() else 1 << 30
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= full:
        bound = f"[1, {full}] ({shape} has {full} layers)" if shape in _presets() else ">= 1"
        raise ShapeError(f"layers={layers!r} must be an integer in {bound}")


def _hub_config(spec: str) -> PretrainedConfig:
    from transformers import AutoConfig

    from kvbench.data.hub import hf_offline_env, hub_reachable, offline_requested

    why = None
    if offline_requested():
        why = "KVBENCH_OFFLINE=1"
    else:
        lfo = hf_offline_env() or not hub_reachable()
        try:
            return AutoConfig.from_pretrained(spec, local_files_only=lfo)
        except Exception as exc:  # noqa: BLE001 - any hub failure: in the ShapeError below
            # what it catches: any failure to read the config (hub unreachable, unknown id, no
            # access, not in the HF cache); reported in the ShapeError raised below
            where = "HF cache only, hub unreachable" if lfo else "hub"
            why = f"{where}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    raise ShapeError(
        f"model shape {spec!r} is not a preset and its config could not be read ({why}); "
        f"known presets: {preset_names()}"
    )


def shape_config(
    shape: str, layers: int | None = None
) -> tuple[PretrainedConfig, dict[str, str | int | bool | None]]:
    """The transformers config of ``shape`` (a preset name or a hub id), sliced to ``layers``.

    Returns
    -------
    (config, info) : ``info`` has ``shape``, ``shape_source`` (``"preset"`` or ``"hub"``),
        ``shape_hub_id``, ``shape_config_sha256`` (presets: of the JSON file),
        ``shape_num_hidden_layers`` (the full model's), ``shape_layers`` (built),
        ``shape_slice`` (``"first N of L layers"`` or ``None``) and ``random_weights: True``.

    Raises
    ------
    ShapeError
        Unknown preset offline (the message lists the presets), or ``layers`` not an integer
        in ``[1, num_hidden_layers]``.
    """
    from transformers import AutoConfig

    if shape in _presets():
        p = preset(shape)
        d = dict(p["config"])
        config = AutoConfig.for_model(d.pop("model_type"), **d)
        info = {"shape_source": "preset", "shape_hub_id": p["hub_id"]}
        info["shape_config_sha256"] = p["sha256"]
    elif "/" in shape:
        config = _hub_config(shape)
        info = {"shape_source": "hub", "shape_hub_id": shape, "shape_config_sha256": None}
    else:
        preset(shape)  # raises, naming the presets
    full = config.num_hidden_layers
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= full:
            raise ShapeError(
                f"layers={layers!r} must be an integer in [1, {full}] ({shape} has {full} layers)"
            )
        config.num_hidden_layers = layers
        # model-specific config attributes (absent from most model types)
        if isinstance(getattr(config, "layer_types", None), list):  # per-layer list
            config.layer_types = config.layer_types[:layers]
        if getattr(config, "max_window_layers", None) is not None:
            config.max_window_layers = min(config.max_window_layers, layers)
    n = config.num_hidden_layers
    info.update(
        {
            "shape": shape,
            "shape_num_hidden_layers": full,
            "shape_layers": n,
            "shape_slice": f"first {n} of {full} layers" if n < full else None,
            "random_weights": True,
        }
    )
    return config, info


class ByteTokenizer:
    """Tokenizer stand-in for a shape model: token ids are the text's UTF-8 bytes (0..255).

    With random weights the ids' meaning is irrelevant; they only need to be deterministic and
    inside the vocabulary.  Callable like a Hugging Face tokenizer
    (``tok(text)["input_ids"]``), with ``decode``, ``eos_token_id`` and ``name_or_path``."""

    name_or_path = "utf-8 bytes (shape model)"
    eos_token = None
    eos_token_id = None
    pad_token_id = None
    chat_template = None

    def __call__(
        self, text: str, add_special_tokens: bool = False, **_: object
    ) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}

    def encode(self, text: str, add_special_tokens: bool = False, **_: object) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: torch.Tensor | Iterable[int], **_: object) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def build_shape_model(
    shape: str,
    layers: int | None = None,
    seed: int = 0,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    materialize: bool = True,
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, ByteTokenizer, dict[str, object]]:
    """Build ``AutoModelForCausalLM.from_config`` of :func:`shape_config`.

    Parameters
    ----------
    shape, layers : see :func:`shape_config`.
    seed : weight seed (materialized models): the same seed gives bit-identical weights.
    dtype, device : parameter dtype and the device a materialized model lives on.
    materialize : False builds on the ``meta`` device (no storage; ``info['device']`` is
        ``"meta"``), True on ``device`` with seeded random weights.
    attn_implementation : passed to ``from_config`` (e.g. kvbench's registered function).

    Returns
    -------
    (model, tokenizer, info) : eval-mode model, a :class:`ByteTokenizer`, and ``info`` with
        ``model_id`` (``"shape:<shape>"``, ``"shape:<shape>[layers=N]"`` for a slice; the
        suite's model id too), ``source`` (:data:`SOURCE_SHAPE`), ``weights_seed``,
        ``materialized``, ``dtype``, ``device``, the fields of :func:`shape_config` and of
        :func:`kvbench.hf.info.model_info` (whose ``num_hidden_layers`` is the slice's).

    Raises
    ------
    ShapeError
        See :func:`shape_config`.
    """
    from transformers import AutoModelForCausalLM

    config, info = shape_config(shape, layers)
    torch_dtype = parse_dtype(dtype)
    kw: dict[str, object] = {"dtype": torch_dtype}
    if attn_implementation:
        kw["attn_implementation"] = attn_implementation
    target = torch.device("meta") if not materialize else torch.device(device)
    cuda = [target] if target.type == "cuda" else []
    rng = torch.random.fork_rng(devices=cuda) if materialize else nullcontext()
    with rng, target:
        if materialize:
            torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, **kw)
    model.eval()
    info = {
        "model_id": f"shape:{shape}" + (f"[layers={layers}]" if layers is not None else ""),
        "path": None,
        "source": SOURCE_SHAPE,
        "note": RANDOM_WEIGHTS_NOTE,
        "weights_seed": seed if materialize else None,
        "materialized": bool(materialize),
        "dtype": str(torch_dtype).removeprefix("torch."),
        "device": str(target),
        "attn_implementation": model.config._attn_implementation,
        "tokenizer": ByteTokenizer.name_or_path,
        **info,
        **model_info(model),
    }
    return model, ByteTokenizer(), info
