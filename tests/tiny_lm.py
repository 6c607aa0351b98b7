"""A tiny offline language model for workload tests: a byte-level BPE trained on the essays and
a seeded random 2-layer Llama with GQA (4 query heads, 2 KV heads) on it."""

from __future__ import annotations

import functools

import pytest
import torch


@functools.cache
def _tokenizer():
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kvbench.bench.tasks.haystack import haystack_sentences

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    bpe.train_from_iterator(haystack_sentences("essay")[:600], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")


def toy_llama(max_positions: int = 256, dtype: torch.dtype = torch.float32):
    """A seeded random Llama without a tokenizer (ids 0..95): 2 layers, 4 query heads over 2 KV
    heads (GQA), head_dim 16, in ``dtype``, with kvbench's attention; a new model each call."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvbench.hf.attention import use_kvbench_attention

    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=96,
        intermediate_size=96,
        max_position_embeddings=max_positions,
    )
    torch.manual_seed(0)
    return use_kvbench_attention(LlamaForCausalLM(cfg).eval().to(dtype))


@functools.cache
def tiny_lm(head_dim: int = 16):
    """``(model, tokenizer, model_info)``; ``head_dim`` 32 fits llama.cpp blocks of 32 channels."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvbench.hf.attention import use_kvbench_attention

    tok = _tokenizer()
    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        vocab_size=len(tok),
        intermediate_size=128,
        max_position_embeddings=4096,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = use_kvbench_attention(LlamaForCausalLM(cfg).eval())
    info = {"max_position_embeddings": 4096, "head_dim": head_dim}
    return model, tok, info
