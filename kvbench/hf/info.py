"""What a model is, read from its config: attention geometry and the dtype it is loaded in.

Shared by :mod:`kvbench.hf.models` (checkpoints) and :mod:`kvbench.hf.shapes` (config-only
models with random weights), so neither imports the other for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # annotations only: importing this module does not load transformers
    from transformers import PretrainedConfig, PreTrainedModel

#: what :func:`model_info` returns (names, counts, ``rope_theta``)
ModelInfo = dict[str, str | int | float | None]

ROTATE_HALF_TYPES = frozenset(
    "llama mistral mixtral qwen2 qwen2_moe qwen3 qwen3_moe gemma gemma2 "
    "gemma3_text phi3 gpt_neox olmo olmo2 granite smollm3".split()
)
INTERLEAVED_TYPES = frozenset({"gptj", "codegen"})


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype named by ``dtype``.

    Parameters
    ----------
    dtype : a torch dtype, a name (``"float32"``, ``"torch.bfloat16"``) or a short name
        (``"fp32"``, ``"fp16"``, ``"bf16"``).

    Raises
    ------
    ValueError
        ``dtype`` names no torch dtype.
    """
    name = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(str(dtype), str(dtype))
    # a dtype named by a string: torch's attribute of that name, if it has one
    out = dtype if isinstance(dtype, torch.dtype) else getattr(torch, name.split(".")[-1], None)
    if not isinstance(out, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use float32, float16 or bfloat16")
    return out


def model_info(model: PreTrainedModel | PretrainedConfig) -> ModelInfo:
    """Attention geometry of a model (or its config) for KV-cache accounting.

    Returns
    -------
    dict with ``model_type``, ``num_hidden_layers``, ``num_attention_heads`` (query heads),
    ``num_key_value_heads``, ``head_dim``, ``max_position_embeddings``, ``vocab_size``,
    ``rope_theta`` (float or None) and ``rope_layout``: ``"rotate_half"`` (llama/qwen/mistral
    style: dims i and i + head_dim/2 pair up), ``"interleaved"`` (GPT-J style) or ``"unknown"``.
    """
    # the remaining getattr read attributes that only some transformers configs have
    cfg = getattr(model, "config", model)  # a model's, or the config itself
    cfg = getattr(cfg, "text_config", None) or cfg  # multimodal wrappers
    heads = cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = theta if theta is not None else getattr(cfg, "rope_theta", None)
    mtype = cfg.model_type
    layout = (
        "rotate_half"
        if mtype in ROTATE_HALF_TYPES
        else "interleaved"
        if mtype in INTERLEAVED_TYPES
        else "unknown"
    )
    return {
        "model_type": mtype,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", None),
        "vocab_size": getattr(cfg, "vocab_size", None),
        "rope_theta": float(theta) if theta is not None else None,
        "rope_layout": layout,
    }
