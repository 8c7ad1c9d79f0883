"""The prediction study's variants (benchmarks/prediction_variants.py): pricing the prefill in
a window's mixed steps."""

from __future__ import annotations

import pytest
from prediction_variants import mix_prediction, window_prefill_price

from loadwise.evaluate.windows import mean_decode_batch
from loadwise.measure.records import StepRecord
from loadwise.policy.goodput import Acceptance, StepTimes, goodput
from loadwise.policy.table import DraftLengthTable

TIMES = StepTimes({(b, k): 0.05 + 0.002 * b * (1 + k) for b in (1, 4, 8) for k in range(3)})
ACC = Acceptance((0.8, 0.5), draft_rate=0.5)


def rec(b: int, decode: int, prefill_tokens: int = 0) -> StepRecord:
    return StepRecord(0.0, 0.1, b, decode, prefill_tokens, 0, 0, 2, (0, 0), (0, 0))


def test_mix_prediction_of_pure_decode_steps_is_the_goodput() -> None:
    table = DraftLengthTable.fixed(2, 2, 8)
    assert mix_prediction([rec(4, 4)] * 10, table, TIMES, ACC, 0.001) == pytest.approx(
        goodput(4, 2, TIMES, ACC))
    assert mean_decode_batch([rec(4, 4), rec(5, 2, 100)]) == 3.0


def test_mix_prediction_prices_prefill_and_uses_the_k_of_each_batch() -> None:
    table = DraftLengthTable.parse([[1, 4, 2], [5, 8, 0]], 2)
    steps = [rec(4, 4), rec(8, 7, 300), rec(1, 0, 500)]
    tokens = 4 * ACC.expected_tokens(2) + 7 * ACC.expected_tokens(0)
    secs = (TIMES.at(4, ACC.expected_drafts(2)) + TIMES.at(7, 0.0) + 0.001 * 300
            + TIMES.at(1, 0.0) + 0.001 * 500)
    assert mix_prediction(steps, table, TIMES, ACC, 0.001) == pytest.approx(tokens / secs)


def test_window_prefill_price_fits_the_mixed_steps_extra_time() -> None:
    # Mixed steps cost T(decode part) + 2 ms per prompt token; pure decode steps carry no price.
    mixed = [StepRecord(0.0, TIMES.at(3, 0.0) + 0.002 * n, 4, 3, n, 0, 0, 2, (0, 0), (0, 0))
             for n in (50, 120, 300)]
    price, ratio = window_prefill_price([*mixed, rec(4, 4)], TIMES, output_tokens=235)
    assert price == pytest.approx(0.002)
    assert ratio == pytest.approx(470 / 235)
    assert window_prefill_price([rec(4, 4)], TIMES, output_tokens=0) == (None, None)
