"""`loadwise serve --kv-store` and `loadwise kv status`: the engine spec they build, the checks
that run before an engine starts, and what the status reads from a store on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadwise.cli import main
from loadwise.config.engine import EngineSpec
from loadwise.config.kvstore import KvStoreConfig
from loadwise.errors import EngineConfigError
from loadwise.kvstore import blockfile
from loadwise.kvstore.media.base import StoreError
from loadwise.kvstore.media.files import FileBlockStore, check_usable
from loadwise.kvstore.stats import ConnectorCounters, StatsFile
from loadwise.kvstore.status import store_status


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return str(d)


def write_blocks(root: Path, fp: bytes, n: int, payload: bytes = b"kv" * 8) -> None:
    store = FileBlockStore(root, 1 << 30)
    store.open_for_writing()
    for i in range(n):
        h = f"h{i}".encode()
        store.submit(blockfile.block_key(fp, h), blockfile.encode(fp, h, payload))
    store.flush()
    store.close()


def test_status_counts_blocks_per_engine_and_crash_leftovers(tmp_path: Path) -> None:
    fp_a, fp_b = blockfile.fingerprint({"model": "a"}), blockfile.fingerprint({"model": "b"})
    write_blocks(tmp_path, fp_a, 3)
    write_blocks(tmp_path, fp_b, 2)
    sub = next(p for p in (tmp_path / "blocks").iterdir() if p.is_dir())
    (sub / "dead.tmp").write_bytes(b"half a block")
    (sub / "junk.blk").write_bytes(b"not a block at all, long enough for a header ......")
    counters = ConnectorCounters(lookups=7, hit_blocks=5)
    StatsFile(tmp_path, "scheduler").maybe_write(counters, lambda: {"fingerprint": fp_a.hex()},
                                                  force=True)
    st = store_status(tmp_path)
    assert st.num_blocks == 5
    assert st.leftovers == 1 and st.unreadable == 1
    assert {fp: v[0] for fp, v in st.by_fingerprint.items()} == {fp_a.hex(): 3, fp_b.hex(): 2}
    assert st.stats["scheduler"]["hit_blocks"] == 5 and st.stats["worker"] == {}
    assert st.used_bytes == sum(v[1] for v in st.by_fingerprint.values())


def test_status_counts_the_extent_medium_per_writer_and_engine(tmp_path: Path) -> None:
    from loadwise.kvstore.media.extents.store import ExtentBlockStore

    fp_a, fp_b = blockfile.fingerprint({"model": "a"}), blockfile.fingerprint({"model": "b"})
    for name, fp, n in (("prefill", fp_a, 2), ("decode", fp_b, 3)):
        store = ExtentBlockStore(tmp_path, 1 << 30, name, fsync=False)
        store.open_for_writing()
        for i in range(n):
            h = f"{name}{i}".encode()
            store.submit(blockfile.block_key(fp, h), blockfile.encode(fp, h, b"kv" * 8), 1)
        store.flush()
        store.close()
    write_blocks(tmp_path, fp_a, 1)  # the file medium in the same directory counts too
    st = store_status(tmp_path)
    assert {fp: v[0] for fp, v in st.by_fingerprint.items()} == {fp_a.hex(): 3, fp_b.hex(): 3}
    assert st.num_blocks == 6 and st.unreadable == 0


def test_status_cli_prints_json_and_refuses_a_directory_that_is_no_store(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_blocks(tmp_path / "s", blockfile.fingerprint({"model": "a"}), 2)
    assert main(["kv", "status", str(tmp_path / "s"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_blocks"] == 2
    assert main(["kv", "status", str(tmp_path)]) == 2
    assert "not a loadwise KV store" in capsys.readouterr().err
    with pytest.raises(StoreError):
        store_status(tmp_path / "missing")


def test_status_cli_shows_each_engine_of_a_disaggregated_store(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_blocks(tmp_path, blockfile.fingerprint({"model": "a"}), 1)
    for engine in ("prefill", "decode"):
        StatsFile(tmp_path, f"{engine}-worker").maybe_write(
            ConnectorCounters(blocks_loaded=3), dict, force=True)
    assert main(["kv", "status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "prefill-worker" in out and "decode-worker" in out and "blocks_loaded" in out


def test_header_fingerprint_names_the_engine_or_none() -> None:
    fp = blockfile.fingerprint({"model": "a"})
    blob = blockfile.encode(fp, b"h", b"payload")
    assert blockfile.header_fingerprint(blob) == fp
    assert blockfile.header_fingerprint(blob[:10]) is None
    assert blockfile.header_fingerprint(b"X" * len(blob)) is None


def test_kv_store_renders_the_connector_and_checks_its_directory(model_dir: str,
                                                                 tmp_path: Path) -> None:
    kv = KvStoreConfig(str(tmp_path / "store"), 2.0)
    check_usable(kv.store_dir)
    assert (tmp_path / "store" / "blocks").is_dir()
    args = EngineSpec(model=model_dir, spec_method=None, extensions=(kv,)).server_args("127.0.0.1", 1)
    cfg = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert cfg["kv_connector_module_path"] == "loadwise.kvstore.connector"
    assert cfg["kv_load_failure_policy"] == "recompute"
    # A stop lets the engine's processes finish: queued writes and the memory tier reach disk.
    assert int(args[args.index("--shutdown-timeout") + 1]) > 0
    assert cfg["kv_connector_extra_config"] == {"store_dir": str((tmp_path / "store").resolve()),
                                                "capacity_gib": 2.0, "memory_gib": 0.0,
                                                "policy": "flat", "sync_saves": False,
                                                "engine": "", "handoff": "store"}
    (tmp_path / "file").write_text("x")
    with pytest.raises(EngineConfigError, match="not a writable directory"):
        check_usable(str(tmp_path / "file" / "store"))
    with pytest.raises(EngineConfigError, match="--kv-disk-gib"):
        KvStoreConfig(str(tmp_path), 0)
    with pytest.raises(EngineConfigError, match="--kv-memory-gib"):
        KvStoreConfig(str(tmp_path), 1, -1)
    with pytest.raises(EngineConfigError, match="unknown --kv-policy 'lru'"):
        KvStoreConfig(str(tmp_path), 1, 1, "lru")
    with pytest.raises(EngineConfigError, match="unknown --kv-medium 'tape'"):
        KvStoreConfig(str(tmp_path), medium="tape")
    extents = KvStoreConfig(str(tmp_path / "store"), 2.0, medium="extents").transfer_config()
    assert extents["kv_connector_extra_config"]["medium"] == "extents"


def test_kv_medium_needs_a_store(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--kv-medium", "extents"]) == 2
    assert "--kv-medium needs --kv-store DIR (or --disagg)" in capsys.readouterr().err


def test_vllm_flags_pass_through_after_loadwise_flags(model_dir: str) -> None:
    spec = EngineSpec(model=model_dir, spec_method=None,
                      server_extra_args=("--max-model-len", "512", "--enable-prompt-tokens-details"))
    args = spec.server_args("127.0.0.1", 1)
    # vLLM keeps the last value of a repeated flag: the user's.
    assert args[-3:] == ["--max-model-len", "512", "--enable-prompt-tokens-details"]
    assert args.index("--max-model-len") < len(args) - 3


def test_only_serve_takes_flags_after_a_double_dash(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--", "--enforce-eager"]) == 2
    assert "only `loadwise serve` takes vLLM flags" in capsys.readouterr().err


def test_a_fractional_kv_cache_goes_through_vllms_flag(model_dir: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    whole = EngineSpec(model=model_dir, spec_method=None, kv_cache_space_gib=2)
    assert "--kv-cache-memory-bytes" not in whole.server_args("127.0.0.1", 1)
    assert "kv_cache_memory_bytes" not in whole.llm_kwargs()
    part = EngineSpec(model=model_dir, spec_method=None, kv_cache_space_gib=0.25)
    args = part.server_args("127.0.0.1", 1)
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(1 << 28)
    assert part.llm_kwargs()["kv_cache_memory_bytes"] == 1 << 28
    # The CPU variable would override the flag, so it is unset for this engine only.
    assert "VLLM_CPU_KVCACHE_SPACE" not in part.env()
    with pytest.raises(EngineConfigError, match="--kv-cache-gib"):
        EngineSpec(model=model_dir, spec_method=None, kv_cache_space_gib=0)


def test_store_options_without_a_store_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--kv-memory-gib", "1"]) == 2
    assert "--kv-memory-gib needs --kv-store DIR" in capsys.readouterr().err


def test_disagg_engines_split_the_cores_and_only_the_prefill_writes_on_the_step_path(
        model_dir: str, tmp_path: Path) -> None:
    from loadwise.disagg.serve import DisaggError, DisaggSpecs, split_cores

    kv = KvStoreConfig(str(tmp_path / "store"), 2.0)
    specs = DisaggSpecs.from_spec(EngineSpec(model=model_dir, spec_method=None), kv, (0, 1))
    assert specs.prefill.cpu_binding.cores == (0,) and specs.decode.cpu_binding.cores == (1,)
    p_kv, d_kv = (s.extension(KvStoreConfig) for s in (specs.prefill, specs.decode))
    assert p_kv is not None and d_kv is not None
    assert p_kv.sync_saves and not d_kv.sync_saves
    assert (p_kv.engine, d_kv.engine) == ("prefill", "decode")
    assert p_kv.store_dir == d_kv.store_dir
    assert p_kv.capacity_gib == d_kv.capacity_gib == 1.0
    assert p_kv.pull_port is None
    assert specs.prefill.kv_cache_space_gib == specs.decode.kv_cache_space_gib == 4
    sized = DisaggSpecs.from_spec(EngineSpec(model=model_dir, spec_method=None,
                                             kv_cache_space_gib=0.25), kv, (0, 1),
                                  decode_kv_cache_gib=1.5)
    assert (sized.prefill.kv_cache_space_gib, sized.decode.kv_cache_space_gib) == (0.25, 1.5)
    # Pulling: the prefill serves its blocks on a port of its own and writes off the step path.
    from dataclasses import replace

    pull = DisaggSpecs.from_spec(EngineSpec(model=model_dir, spec_method=None),
                                 replace(kv, handoff="pull"), (0, 1))
    pull_p, pull_d = (s.extension(KvStoreConfig) for s in (pull.prefill, pull.decode))
    assert pull_p is not None and pull_d is not None
    assert pull_p.pull_port and pull_d.pull_port is None
    assert not pull_p.sync_saves
    assert pull_p.transfer_config()["kv_connector_extra_config"][
        "pull_port"] == pull_p.pull_port
    with pytest.raises(EngineConfigError, match="handoff"):
        replace(kv, handoff="pigeon")
    with pytest.raises(EngineConfigError, match="--no-kv-reuse needs --handoff pull"):
        replace(kv, reuse=False)
    no_reuse = replace(kv, handoff="push", reuse=False).transfer_config()
    assert no_reuse["kv_connector_extra_config"]["reuse"] is False
    assert [b.cores for b in split_cores((0, 1, 2, 3, 4))] == [(0, 1), (2, 3, 4)]
    with pytest.raises(DisaggError, match="two cores"):
        split_cores((3,))
