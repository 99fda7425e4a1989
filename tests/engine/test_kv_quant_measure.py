"""The KV-quantization measure (tests/measure/kv_quant.py) still runs and counts right:
its budget table, and its agreement figures on hand-made runs."""

from __future__ import annotations

import pytest
from measure import kv_quant


def test_the_budget_table_counts_more_blocks_quantized() -> None:
    rows = kv_quant.budget_table(256)
    float32 = [r for r in rows if r.startswith("| float32 |")]
    assert [r.split("|")[2].strip() for r in float32] == [
        "float32 KV",
        "8-bit KV (groups of 64)",
        "4-bit KV (groups of 64)",
    ]
    # 46080 bytes a token in float32; 8-bit: 30 layers x 2 x 3 heads x (64 + 2 x 4) bytes.
    assert [r.split("|")[3].strip() for r in float32] == ["46080", "12960", "7200"]
    assert float32[1].endswith("| 3.55x |")


def test_agreement_counts_tokens_before_the_first_divergence() -> None:
    plain = [[(1, -0.5), (2, -1.0), (3, -0.2)], [(4, -0.1), (5, -0.3)]]
    quantized = [[(1, -0.4), (2, -1.0), (3, -0.1)], [(4, -0.2), (6, -2.0)]]
    c = kv_quant.compare(plain, quantized)
    assert c["exact"] == 1 and c["requests"] == 2
    assert c["agreement"] == pytest.approx(4 / 5)
    assert c["first_divergence"] == 1
    # The four agreeing tokens' |delta logprob|: 0.1, 0, 0.1, 0.1.
    assert c["mean_delta"] == pytest.approx(0.075) and c["max_delta"] == pytest.approx(0.1)


def test_the_parity_set_is_the_parity_tests() -> None:
    assert len(kv_quant.parity_set("tiny").requests) == 32
    assert len(kv_quant.parity_set("smollm2").requests) == 44
