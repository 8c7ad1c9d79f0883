from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadwise.policy.table import DraftLengthTable, TableError


def test_parse_docs_table_and_lookup() -> None:
    t = DraftLengthTable.parse([[1, 64, 3], [65, 128, 1], [129, 512, 0]], max_k=3)
    assert [t.lookup(b) for b in (1, 64, 65, 128, 129, 512, 1000)] == [3, 3, 1, 1, 0, 0, 0]
    assert t.to_vllm() == [[1, 64, 3], [65, 128, 1], [129, 512, 0]]


def test_parse_json_string_and_config_object() -> None:
    a = DraftLengthTable.parse("[[1,1,3],[2,64,1]]", max_k=3)
    b = DraftLengthTable.parse({"num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 64, 1]]}, 3)
    assert a == b
    assert a.lookup(1) == 3 and a.lookup(2) == 1


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([], "empty"),
        ([[2, 4, 1]], "1..1 are not covered"),
        ([[1, 4, 1], [4, 8, 0]], "overlaps"),
        ([[1, 4, 1], [6, 8, 0]], "5..5 are not covered"),
        ([[1, 0, 1]], "is empty: start must be <= end"),
        ([[1, 4, 5]], "above the engine's max k=3"),
        ([[1, 4, -1]], "negative"),
        ([[1, 4]], "must be [start_bs, end_bs, k]"),
        ([[1, 4, 1.5]], "must be an integer"),
        ("[[1, 4, 1]", "not valid JSON"),
        ({"foo": 1}, "no 'num_speculative_tokens_per_batch_size'"),
        (5, "must be a list"),
    ],
)
def test_malformed_tables_are_rejected_with_reason(raw: object, message: str) -> None:
    with pytest.raises(TableError, match=None) as err:
        DraftLengthTable.parse(raw, max_k=3)
    assert message in str(err.value)


def test_load_and_dump_roundtrip(tmp_path) -> None:
    t = DraftLengthTable.parse([[1, 3, 2], [4, 16, 0]], max_k=4)
    path = tmp_path / "table.json"
    t.dump(path)
    assert DraftLengthTable.load(path, max_k=4) == t
    assert json.loads(path.read_text())["num_speculative_tokens_per_batch_size"] == t.to_vllm()
    plain = tmp_path / "plain.json"
    plain.write_text("[[1, 16, 1]]")
    assert DraftLengthTable.load(plain, max_k=1).lookup(10) == 1


def test_load_reports_file_name(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("[[1, 2, 9]]")
    with pytest.raises(TableError, match="bad.json.*max k=3"):
        DraftLengthTable.load(bad, max_k=3)
    with pytest.raises(TableError, match="cannot read"):
        DraftLengthTable.load(tmp_path / "missing.json", max_k=3)


def test_clamped_merges_ranges() -> None:
    docs = DraftLengthTable.parse([[1, 64, 3], [65, 128, 1], [129, 512, 0]], max_k=3)
    assert docs.clamped(1).to_vllm() == [[1, 128, 1], [129, 512, 0]]


mappings = st.integers(min_value=1, max_value=80).flatmap(
    lambda n: st.lists(st.integers(0, 5), min_size=n, max_size=n)
)


@given(mappings)
def test_compaction_is_lossless_and_minimal(ks: list[int]) -> None:
    mapping = {b: k for b, k in enumerate(ks, start=1)}
    table = DraftLengthTable.from_mapping(mapping, max_k=5)
    assert table.to_mapping() == mapping
    # Fewest ranges: one per run of equal neighbours.
    runs = 1 + sum(1 for a, b in itertools.pairwise(ks) if a != b)
    assert len(table.ranges) == runs
    # Emitted JSON parses back to the same table.
    assert DraftLengthTable.parse(table.to_json(), max_k=5) == table


@given(mappings, st.integers(1, 200))
def test_lookup_past_end_uses_last_range(ks: list[int], b: int) -> None:
    table = DraftLengthTable.from_mapping(dict(enumerate(ks, start=1)), max_k=5)
    expected = ks[b - 1] if b <= len(ks) else ks[-1]
    assert table.lookup(b) == expected


def test_from_mapping_with_hole_is_rejected() -> None:
    with pytest.raises(TableError, match="missing"):
        DraftLengthTable.from_mapping({1: 2, 3: 1}, max_k=3)


def test_lookup_on_vllm_json_matches_the_table() -> None:
    from loadwise.policy.table import lookup_vllm

    t = DraftLengthTable.parse([[1, 4, 3], [5, 16, 1], [17, 32, 0]], 3)
    for b in range(1, 40):
        assert lookup_vllm(t.to_vllm(), b) == t.lookup(b)
