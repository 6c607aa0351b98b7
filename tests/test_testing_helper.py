"""``kvbench.testing.check_method``: passes built-ins and the example plugin, and each
deliberately broken method fails the check that guards what it broke
(docs/plugins.md#testing-a-plugin).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
import torch

import kvbench
from kvbench.cache.blocks import AffineBlock, PerTokenCodec
from kvbench.cache.layer import LayerCache
from kvbench.cache.method import CacheConfig, MethodConfig
from kvbench.cache.quant import pack_bits
from kvbench.testing import check_method, half_step_bound

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"bits": 2, "group_size": 4, "residual_length": 4, "num_sink_tokens": 2, "value_bits": 2}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("full", {}),
        ("kivi", SMALL),
        ("kivi", {"bits": 4, "group_size": 8, "residual_length": 16}),
        ("per-token", {"bits": 3, "residual_length": 5, "value_bits": 4, "group_size": 8}),
        ("example-sign", {"bits": 2, "residual_length": 3, "group_size": 16}),
        ("example-sign", {}),  # the defaults: R = G = 128, 4-bit keys
    ],
)
def test_builtins_and_the_example_plugin_pass(name: str, config: dict) -> None:
    got = check_method(kvbench.get_method(name, **config), bad_configs=[{"value_bits": 9}])
    assert got.padding_checked
    assert got.attend_error <= 1e-5
    if name == "full":
        assert got.quantized_tokens == (0, 0) and got.key_error == got.value_error == 0.0
    else:
        assert got.quantized_tokens[0] > 0 and 0 < got.key_error <= got.key_bound


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["kivi", "example-sign"])
def test_half_precision_caches_pass(name: str, dtype: torch.dtype) -> None:
    """``attend`` returns the query's dtype and the dequantized keys are rounded to it: the
    tolerances follow the dtype (8-bit keys: the rounding is larger than half a step)."""
    config = {"bits": 8, "group_size": 8, "residual_length": 8, "scale_dtype": "bfloat16"}
    got = check_method(kvbench.get_method(name, **config), dtype=dtype)
    assert got.quantized_tokens[0] > 0


def test_a_method_without_keys_values_is_checked_through_attend_only() -> None:
    """QJL's keys are sketches (``keys_values=False``): no round trip, no reference attention;
    bytes and padding (stored tensors, attention of a padded row) are still checked."""
    m = kvbench.get_method("qjl", group_size=4, residual_length=4, value_bits=2)
    got = check_method(m)
    assert got.padding_checked and got.quantized_tokens[0] > 0
    assert got.key_error == got.attend_error == 0.0  # not measured


def test_float_codes_pass_their_own_round_trip_bound() -> None:
    """fp8 codes are not uniform integers: the derived 8-bit half step (max|x| / 254) is too
    tight for e4m3's 3 mantissa bits, so the caller states the bound."""
    m = kvbench.get_method("fp8", residual_length=4)
    with pytest.raises(AssertionError, match=r"'fp8'\): round trip: dequantized keys"):
        check_method(m)
    # e4m3 rounds to 3 mantissa bits: at most 2^-4 of |x|, |x| <= 40 for these keys
    got = check_method(m, round_trip_atol={"key": 40 / 16, "value": 5 / 16})  # |v| <= 5
    assert got.key_bound == 2.5 and 0 < got.key_error <= 2.5


def test_the_token_counts_of_a_small_kivi_by_hand() -> None:
    got = check_method(kvbench.get_method("kivi", **SMALL))
    # prompt N_s + 2 max(R, G) + 1 = 2 + 8 + 1 = 11, decode max(R, G) + 1 = 5: 16 tokens.
    # keys (R-blocks): 2 sinks; prefill 9 -> 8 quantized, 1 residual; the 3rd decode token
    # fills the residual to 4 and flushes it -> 12; 2 residual at the end.
    # values (sliding R): 16 - 2 sinks - 4 window = 10.
    assert (got.prompt_tokens, got.decode_tokens) == (11, 5)
    assert got.quantized_tokens == (12, 10)


def test_half_step_bound_by_hand() -> None:
    x = torch.tensor([-3.0, 1.0, 2.5])
    eps = 2.0**-23  # float32: the dequantized value's rounding, eps * max|x|
    assert half_step_bound(x, 2) == pytest.approx(1.01 * 3.0 / 2 + 3 * eps, rel=1e-12)
    assert half_step_bound(x, 4) == pytest.approx(1.01 * 3.0 / 14 + 3 * eps, rel=1e-12)
    assert half_step_bound(x, 1) == pytest.approx(1.01 * 3.0 + 3 * eps, rel=1e-12)
    assert half_step_bound(x.bfloat16(), 4) == pytest.approx(1.01 * 3 / 14 + 3 / 128, rel=1e-12)
    assert half_step_bound(x, 16) == 0.0


def test_the_bound_is_that_of_a_real_two_bit_code() -> None:
    """A 2-bit per-token absmax code of [-3, 3]: codes -1, 0, 1 at scale 3; 1.4 rounds to 0
    with error 1.4, within the half step 1.5, and 1.6 to 3 with error 1.4 as well."""
    x = torch.tensor([[[[-3.0, 1.4, 1.6, 3.0]]]])
    block = PerTokenCodec(2, torch.float32, symmetric=True, channel_group=4).encode(x)
    err = float((block.dequantize(torch.float32) - x).abs().max())
    assert err == pytest.approx(1.4, abs=1e-6)
    assert err <= half_step_bound(x, 2) and err > 1.5 * 0.9


def test_the_example_plugins_own_tests_pass() -> None:
    plugin = ROOT / "examples" / "kvbench-example-plugin"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "tests"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=plugin,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "4 passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-3000:]


# ----------------------------------------------------------------- broken methods
def kivi_class() -> type:
    return type(kvbench.get_method("kivi"))


def broken(name: str, layer: type[LayerCache] | None = None, **members: object) -> kvbench.Method:
    """A small KIVI whose layer class is ``layer`` and with ``members`` overridden."""
    base = kivi_class()
    body = dict(members)
    if layer is not None:

        def new_layer(self, layer_idx, num_kv_heads, head_dim, dtype=torch.float32, device="cpu"):
            return self.layer_cache(layer_idx, num_kv_heads, head_dim, cls=layer)

        body["new_layer"] = new_layer
    cls = type(f"Broken{name}", (base,), body)
    m = cls(**SMALL)
    m.name = name
    return m


class LyingBytes(LayerCache):
    def nbytes(self) -> dict[str, int]:
        out = super().nbytes()
        out["codes"] -= 1  # "forgets" a byte of codes
        out["key_total"] -= 1
        out["total"] -= 1
        return out


class ViewSinks(LayerCache):
    def prefill(self, keys, values, queries=None, lengths=None) -> None:
        super().prefill(keys, values, queries)
        n = self.k.sinks.shape[2]  # the sinks kept as a view: the whole prompt stays allocated
        self.k.sinks = keys[:, :, :n]


class OffAttend(LayerCache):
    def attend(self, query, scaling=None, lengths=None) -> torch.Tensor:
        return super().attend(query, scaling, lengths) * 1.001


class PadBlind(LayerCache):
    pass


def _drop_lengths(self, keys, values, queries=None, lengths=None) -> None:
    LayerCache.prefill(self, keys, values, queries)  # stores the pads as tokens


PadBlind.prefill = _drop_lengths  # set after the class: not wrapped by the padded prefill


@dataclasses.dataclass
class TripleScaleCodec(PerTokenCodec):
    """Stores the right codes but a scale three times too large."""

    def encode(self, x: torch.Tensor) -> AffineBlock:
        block = super().encode(x)
        return dataclasses.replace(block, scale=block.scale * 3)


def triple_scale_codec(self, layer_idx: int, head_dim: int) -> TripleScaleCodec:
    return TripleScaleCodec(2, torch.float16, channel_group=head_dim)


def shared_state_method() -> kvbench.Method:
    """Symmetric per-token keys whose scale drifts (by 1e-6 per flush) with a flush counter kept
    on the codec class: hidden state shared by every cache of the method, so a padded row's
    stored scales depend on the rows flushed before it (its round trip stays within bounds)."""

    @dataclasses.dataclass
    class DriftingCodec(PerTokenCodec):
        flushes: ClassVar[list[int]] = [0]

        def encode(self, x: torch.Tensor) -> AffineBlock:
            DriftingCodec.flushes[0] += 1
            half = 2 ** (self.bits - 1)
            amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-6)  # [B, H, n, 1]
            scale = (amax / (half - 1) * (1 + 1e-6 * DriftingCodec.flushes[0])).to(self.scale_dtype)
            codes = torch.round(x / scale).clamp(1 - half, half - 1) + half
            b, h, n, d = x.shape
            return AffineBlock(
                pack_bits(codes.to(torch.uint8), self.bits), scale, None, [1] * n, self.bits, d,
                symmetric=True,
            )  # fmt: skip

    def key_codec(self, layer_idx: int, head_dim: int) -> DriftingCodec:
        return DriftingCodec(4, torch.float32, symmetric=True, channel_group=head_dim)

    return broken("shared-state", key_codec=key_codec, key_schedule=per_token_sched)


@dataclasses.dataclass(frozen=True)
class LaxConfig(CacheConfig):
    bits: int = 2

    @classmethod
    def from_dict(cls, values, where: str = "") -> MethodConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})  # drops typos silently


@pytest.mark.parametrize(
    ("method", "check", "says"),
    [
        (lambda: broken("lying", LyingBytes), "bytes", "nbytes()['codes'] = "),
        (lambda: broken("view", ViewSinks), "bytes", "are views of allocations"),
        (lambda: broken("off-attend", OffAttend), "attend", "differs from attention over"),
        (lambda: broken("pad-blind", PadBlind), "padding", "did not cache each row apart"),
        (
            lambda: broken("triple", key_codec=triple_scale_codec, key_schedule=per_token_sched),
            "round trip",
            "dequantized keys are up to",
        ),
        (shared_state_method, "padding", "stores other tensors than the row alone"),
        (lambda: broken("lax", Config=LaxConfig), "config", "accepted an unknown field"),
    ],
    ids=[
        "nbytes-lies",
        "view-storage",
        "attend-off",
        "pads-stored",
        "dequantize-wrong",
        "shared-state",
        "lax",
    ],  # fmt: skip
)
def test_a_broken_method_fails_the_right_check(method, check: str, says: str) -> None:
    m = method()
    with pytest.raises(AssertionError) as e:
        check_method(m)
    msg = str(e.value)
    assert msg.startswith(f"check_method({m.name!r}): {check}: "), msg
    assert says in msg, msg


def per_token_sched(self) -> object:
    from kvbench.cache.schedule import SlidingSchedule

    return SlidingSchedule(self.config.residual_length)


def test_bad_configs_must_be_refused_naming_the_field() -> None:
    m = kvbench.get_method("example-sign", residual_length=2)
    check_method(m, bad_configs=[{"bits": 0}, {"bits": 9}], prompt_tokens=5, decode_tokens=1)
    with pytest.raises(AssertionError, match=r"config: .*accepted the bad config \{'bits': 3\}"):
        check_method(m, bad_configs=[{"bits": 3}])
