"""The plugin's own tests: the method is registered and meets kvbench's method contract
(``kvbench.testing.check_method``: round trip, bytes, attention, padding, config refusals).

Run from the plugin folder after installing it into kvbench's environment:
``python -m pytest tests``."""

from __future__ import annotations

import pytest

import kvbench
from kvbench.testing import check_method
from kvbench_example_plugin import SignMagnitude


def test_registered_under_its_entry_point() -> None:
    assert type(kvbench.get_method("example-sign")) is SignMagnitude


@pytest.mark.parametrize(
    "config",
    [
        {"bits": 2, "residual_length": 3, "group_size": 16},
        {"bits": 8, "residual_length": 8, "group_size": 8, "value_bits": 4},
        {"bits": 4, "residual_length": 4, "group_size": 32, "num_sink_tokens": 2},
    ],
)
def test_method_contract(config: dict) -> None:
    got = check_method(
        SignMagnitude(**config),
        bad_configs=[{"bits": 0}, {"bits": 1}, {"bits": 9}, {"residual_length": -1}],
    )
    assert got.quantized_tokens[0] > 0
