"""The NaN/Inf policy (kvbench.cache.finite): every built-in method's layer cache and a plugin's
refuse non-finite keys/values at prefill and append with a message naming the layer, the side
and the count; ``nonfinite("propagate")`` / ``KVBENCH_NONFINITE=propagate`` store them."""

from __future__ import annotations

import pytest
import torch

from kvbench.cache import finite
from kvbench.cache.blocks import PerTokenCodec
from kvbench.cache.method import CacheConfig, Capabilities, Method
from kvbench.cache.registry import get_method, list_methods
from kvbench.cache.schedule import SlidingSchedule

H, D, P = 2, 64, 96
BUILTINS = [
    r["name"]
    for r in list_methods()
    if r["error"] is None
    and r["capabilities"].get("layer_cache", True)
    and r["distribution"] == "kvbench"
]


def _method(name: str) -> Method:
    m = get_method(name)
    if m.needs_calibration:
        g = torch.Generator().manual_seed(0)
        keys = {i: torch.randn(1, H, 256, D, generator=g) for i in (0, 3, 4)}
        values = {i: torch.randn(1, H, 256, D, generator=g) for i in (0, 3, 4)}
        m.calibrate(keys, values, source="random")
    return m


def _kvq(t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, H, t, D, generator=g) for _ in range(3))


def _prefill(layer, k, v, q) -> None:
    layer.prefill(k, v, queries=torch.cat([q, q], dim=1))  # H_q = 2 H_kv


def test_builtins_are_all_covered() -> None:
    assert {"kivi", "per-token", "full", "fp8", "int4-block", "turboquant-mse"} <= set(BUILTINS)


@pytest.mark.parametrize("name", BUILTINS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_prefill_refuses_nonfinite_keys(name: str, bad: float) -> None:
    layer = _method(name).new_layer(3, H, D)
    q, k, v = _kvq(P)
    k[0, 1, 5, 7] = bad
    k[0, 0, 9, 0] = bad
    kind = "NaN" if bad != bad else "Inf"
    nan, inf = (2, 0) if kind == "NaN" else (0, 2)
    msg = rf"layer 3: prefill got non-finite input \(keys: {nan} NaN and {inf} Inf of {k.numel()}"
    with pytest.raises(ValueError, match=msg):
        _prefill(layer, k, v, q)


@pytest.mark.parametrize("name", BUILTINS)
def test_append_refuses_nonfinite_values(name: str) -> None:
    layer = _method(name).new_layer(4, H, D)
    q, k, v = _kvq(P)
    _prefill(layer, k, v, q)
    _, k1, v1 = _kvq(1, seed=1)
    v1[0, 0, 0, 3] = float("inf")
    with pytest.raises(ValueError, match=r"layer 4: append .*values: 0 NaN and 1 Inf of 128"):
        layer.append(k1, v1)


@pytest.mark.parametrize("name", ["kivi", "per-token", "full", "fp8"])
def test_propagate_opt_out_stores_and_outputs_nan(name: str) -> None:
    layer = _method(name).new_layer(0, H, D)
    q, k, v = _kvq(P)
    v[0, 0, 10, :] = float("nan")
    with finite.nonfinite("propagate"):
        _prefill(layer, k, v, q)
    _, vq = layer.keys_values(torch.float32)
    assert torch.isnan(vq).any()


def test_environment_opt_out(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = get_method("kivi").new_layer(0, H, D)
    q, k, v = _kvq(P)
    k[0, 0, 0, 0] = float("nan")
    monkeypatch.setenv(finite.ENV, "propagate")
    _prefill(layer, k, v, q)
    monkeypatch.setenv(finite.ENV, "ignore")
    with pytest.raises(ValueError, match=r"KVBENCH_NONFINITE='ignore' .* allowed: \['raise'"):
        finite.policy()


class Plugin(Method):
    """A third-party method with its own new_layer (no registry entry needed)."""

    Config = CacheConfig
    capabilities = Capabilities()

    def key_codec(self, layer_idx: int, head_dim: int):
        return PerTokenCodec(4, torch.float16, channel_group=head_dim)

    def key_schedule(self):
        return SlidingSchedule(self.config.residual_length)

    def new_layer(self, layer_idx, num_kv_heads, head_dim, *args, **kwargs):
        from kvbench.cache.layer import LayerCache

        return LayerCache(self.key_codec(layer_idx, head_dim), None, self.key_schedule())


def test_plugin_with_own_new_layer_inherits_the_policy() -> None:
    layer = Plugin().new_layer(layer_idx=7, num_kv_heads=H, head_dim=D)
    q, k, v = _kvq(P)
    k[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"layer 7: prefill .*keys: 1 NaN and 0 Inf"):
        _prefill(layer, k, v, q)
