"""The shipped EAGLE head: its checksums verified (a corrupt or missing file refused, named), its
float32 copy written once and rewritten when stale, and the reproduction check of a retrained
head against the shipped record's figures."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from loadwise.heads import (
    MANIFEST,
    RECORD,
    WEIGHTS,
    HeadError,
    prepare_head,
    reproduces,
    shipped_dir,
    verify,
    write_head,
)

RECORD_JSON = {"kind": "loadwise-eagle-head",
               "config": {"model": "/somewhere/model", "num_steps": 3, "epochs": 4},
               "held_out": {"step_accuracy_every_label": [0.55, 0.50, 0.47]}}


def _trained_head(tmp_path: Path) -> Path:
    src = tmp_path / "trained"
    src.mkdir()
    rng = np.random.default_rng(0)
    save_file({"fc.weight": rng.standard_normal((8, 24)).astype(np.float32),
               "d2t": np.arange(16, dtype=np.int64)}, str(src / WEIGHTS))
    (src / "config.json").write_text(json.dumps({"torch_dtype": "float32", "hidden_size": 8}))
    (src / RECORD).write_text(json.dumps(RECORD_JSON))
    return src


def test_a_compact_head_verifies_and_keeps_integer_tensors(tmp_path: Path) -> None:
    src = _trained_head(tmp_path)
    out = write_head(src, tmp_path / "compact", "float16")
    assert verify(out) is None
    w = load_file(str(out / WEIGHTS))
    assert w["fc.weight"].dtype == np.float16 and w["d2t"].dtype == np.int64
    assert np.array_equal(w["d2t"], np.arange(16))
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"
    assert (out / WEIGHTS).stat().st_size < (src / WEIGHTS).stat().st_size


def test_corrupt_or_missing_files_are_named(tmp_path: Path) -> None:
    out = write_head(_trained_head(tmp_path), tmp_path / "compact", "float16")
    raw = bytearray((out / WEIGHTS).read_bytes())
    raw[-1] ^= 0xFF
    (out / WEIGHTS).write_bytes(bytes(raw))
    assert verify(out) == f"{WEIGHTS} does not match its checksum"
    with pytest.raises(HeadError, match="shipped EAGLE head .* unusable: model.safetensors "
                                        "does not match its checksum"):
        prepare_head(tmp_path / "home", shipped=out)
    (out / WEIGHTS).unlink()
    assert verify(out) == f"{WEIGHTS} is missing"
    (out / MANIFEST).unlink()
    assert verify(out) == f"no {MANIFEST} in {out}"


def test_prepare_writes_float32_once_and_again_when_the_shipped_head_changes(
        tmp_path: Path) -> None:
    src = _trained_head(tmp_path)
    shipped = write_head(src, tmp_path / "shipped", "float16")
    home = tmp_path / "home"
    first = prepare_head(home, shipped=shipped)
    assert first.rebuilt and verify(first.path) is None
    w = load_file(str(first.path / WEIGHTS))
    compact = load_file(str(shipped / WEIGHTS))
    assert w["fc.weight"].dtype == np.float32
    assert np.array_equal(w["fc.weight"], compact["fc.weight"].astype(np.float32))
    assert not prepare_head(home, shipped=shipped).rebuilt
    # A new shipped head (another commit): the float32 copy follows it.
    save_file({"fc.weight": np.ones((8, 24), np.float32), "d2t": np.arange(16)},
              str(src / WEIGHTS))
    write_head(src, shipped, "float16")
    again = prepare_head(home, shipped=shipped)
    assert again.rebuilt and load_file(str(again.path / WEIGHTS))["fc.weight"].max() == 1.0
    # A damaged copy is rewritten from the shipped one.
    (again.path / WEIGHTS).write_bytes(b"junk")
    assert prepare_head(home, shipped=shipped).rebuilt


def test_reproduction_is_judged_on_the_figures_within_the_tolerance() -> None:
    near = {**RECORD_JSON, "config": {**RECORD_JSON["config"], "model": "/elsewhere"},
            "held_out": {"step_accuracy_every_label": [0.56, 0.49, 0.47]}}
    ok, why = reproduces(RECORD_JSON, near)
    assert ok and "largest difference 0.010 (within the tolerance 0.02)" in why
    far = {**near, "held_out": {"step_accuracy_every_label": [0.50, 0.49, 0.47]}}
    ok, why = reproduces(RECORD_JSON, far)
    assert not ok and "0.050 (above" in why
    other = {**near, "config": {**near["config"], "epochs": 8}}
    assert reproduces(RECORD_JSON, other) == (
        False, "trained with other settings than the shipped head")


def test_the_shipped_head_is_committed_and_verifies() -> None:
    problem = verify(shipped_dir())
    assert problem is None, problem
    record = json.loads((shipped_dir() / RECORD).read_text())
    assert record["compact_dtype"] == "float16"
    assert len(record["held_out_compact"]["step_accuracy_every_label"]) == \
        record["config"]["num_steps"]

