"""``bits``: nominal average key/value bits (docs/methods.md#average-bits) of each configuration; needs no model.

Parameters: ``head_dim`` (default 128), ``tokens`` (quantized tokens T_q, default 32768).
This is how PN-Mix Table 10 and the "K bits" columns of Tables 2/3 are reproduced.
"""

from __future__ import annotations

from kvbench.bench.context import RunContext
from kvbench.bench.workloads import LOWER
from kvbench.cache.method import Method
from kvbench.fields import Field

from . import Result, Workload


class Bits(Workload):
    type = "bits"
    METRICS = {"nominal_key_bits": LOWER, "nominal_value_bits": LOWER}
    needs_model = False
    accepts_random_weights = True  # formula and geometry only
    builds_caches = False  # no cache is built: nothing to calibrate
    shape_forward = False
    layer_cache = False  # only the bit formula; peers have one too
    PARAMS = {"head_dim": 128, "tokens": 32768}
    FIELDS = {"head_dim": Field(int, low=1), "tokens": Field(int, low=1)}

    def run(self, ctx: RunContext, method: Method) -> Result:
        r = method.average_bits(head_dim=self.spec["head_dim"], tokens=self.spec["tokens"])
        return Result({"nominal_key_bits": r["key_bits"], "nominal_value_bits": r["value_bits"]})
