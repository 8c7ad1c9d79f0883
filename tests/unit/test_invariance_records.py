"""The checker's comparison: bitwise, per request, counted per condition."""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadwise.invariance.records import (
    Condition,
    InvarianceReport,
    PassResult,
    Sample,
    compare_pass,
    difference,
)

floats = st.floats(allow_nan=False, allow_infinity=False, width=32)
samples = st.lists(st.tuples(st.integers(0, 49151), floats), min_size=1, max_size=12).map(
    lambda xs: Sample(tuple(t for t, _ in xs), tuple(float(lp) for _, lp in xs)))


@given(samples)
def test_a_sample_equals_itself(s: Sample) -> None:
    assert difference(s, s) is None


@given(samples, st.data())
def test_one_flipped_bit_in_one_logprob_is_a_logprob_difference(s: Sample, data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(s.logprobs) - 1))
    bit = data.draw(st.integers(0, 63))
    raw = struct.unpack("<Q", struct.pack("<d", s.logprobs[i]))[0] ^ (1 << bit)
    flipped = struct.unpack("<d", struct.pack("<Q", raw))[0]
    got = Sample(s.token_ids, s.logprobs[:i] + (flipped,) + s.logprobs[i + 1:])
    assert difference(s, got) == "logprobs"


def test_signed_zero_and_nan_compare_by_bits() -> None:
    assert difference(Sample((1,), (0.0,)), Sample((1,), (-0.0,))) == "logprobs"
    nan = Sample((1,), (math.nan,))
    assert difference(nan, Sample((1,), (math.nan,))) is None


def test_tokens_outrank_logprobs_and_lengths_count() -> None:
    ref = Sample((1, 2), (-0.5, -0.25))
    assert difference(ref, Sample((1, 3), (-0.5, -0.25))) == "tokens"
    assert difference(ref, Sample((1,), (-0.5,))) == "tokens"


def test_compare_pass_counts_each_kind_and_names_the_prompts() -> None:
    ref = [Sample((1,), (-1.0,)), Sample((2,), (-2.0,)), Sample((3,), (-3.0,))]
    got = [ref[0], Sample((2,), (-2.0000001,)), Sample((4,), (-3.0,))]
    cond = Condition("default", 2, True, 4, "hit")
    p = compare_pass(cond, ref, got, wall_s=2.0, cached_prompt_tokens=256)
    assert (p.token_diffs, p.logprob_diffs, p.num_differ, p.differing) == (1, 1, 2, (1, 2))
    assert p.output_tokens == 3 and p.cached_prompt_tokens == 256
    with pytest.raises(ValueError, match="2 outputs for 3"):
        compare_pass(cond, ref, got[:2], wall_s=1.0)


def test_report_round_trips_and_totals_per_mode() -> None:
    a = PassResult(Condition("default", 1, False, 16, "miss"), 200, 3, 40, 10.0, 1600, (1, 2))
    b = PassResult(Condition("invariant", 1, False, 16, "miss"), 200, 0, 0, 11.0, 1600)
    report = InvarianceReport(config={"num_prompts": 200}, passes=(a, b), meta={"git_sha": "x"})
    back = InvarianceReport.from_json(report.to_json())
    assert back == report
    assert report.totals() == {"default": {"requests": 200, "differ": 43, "token_diffs": 3},
                               "invariant": {"requests": 200, "differ": 0, "token_diffs": 0}}


def test_the_checker_takes_bindings_as_every_command_names_them() -> None:
    from loadwise.config.binding import allowed_cpus, format_cores
    from loadwise.invariance.check_engine import CheckConfig, CheckConfigError

    cpus = allowed_cpus()
    default = CheckConfig(model="m").bindings()
    assert [b.cores for b in default] == [tuple(cpus[:n]) for n in (1, 2) if n <= len(cpus)]
    assert CheckConfig(model="m").to_json()["cpu_bindings"] == [b.name for b in default]
    one = CheckConfig(model="m", cpu_bindings=(format_cores(cpus[:1]),)).bindings()
    assert [b.cores for b in one] == [tuple(cpus[:1])]
    with pytest.raises(CheckConfigError, match="name the cores"):
        CheckConfig(model="m", cpu_bindings=("auto",))
    if len(cpus) >= 2:
        with pytest.raises(CheckConfigError, match="one binding per core count"):
            CheckConfig(model="m", cpu_bindings=(str(cpus[0]), str(cpus[1])))
