"""The EAGLE-3 head shipped with loadwise for the embedded model, and heads in compact form.

The head ``loadwise drafter train`` makes with its defaults is committed in
``src/loadwise/assets/<name>/`` as float16 safetensors (half the bytes of the trained float32),
with its training record (``loadwise-drafter.json``: command, data, held-out figures of the
float16 weights) and a manifest of SHA-256 checksums. ``loadwise model prepare`` verifies the
shipped files against the manifest (a corrupt or missing file is refused, naming it) and
writes the float32 head vLLM loads under ``$LOADWISE_HOME/heads/``, verified the same way on
every later call.

Invariant: a head directory with a valid manifest is complete; writes go to a temporary sibling
renamed into place. No torch here: the conversion goes through safetensors' NumPy API.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadwise.checksums import check_files, listed_files, replacing_dir, sha256_file
from loadwise.errors import LoadwiseError

SHIPPED_NAME = "eagle3-smollm2-135m-instruct"
ASSETS = Path(__file__).resolve().parent / "assets"
MANIFEST = "loadwise-manifest.json"
WEIGHTS = "model.safetensors"
RECORD = "loadwise-drafter.json"


class HeadError(LoadwiseError, RuntimeError):
    pass


def write_manifest(directory: Path, dtype: str) -> None:
    manifest = {"kind": "loadwise-eagle-head", "dtype": dtype,
                "files": listed_files(directory, MANIFEST)}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def verify(directory: Path) -> str | None:
    """None when ``directory`` matches its manifest, else what is wrong (naming the file)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files: dict[str, str] = manifest["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} in {directory}"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST} unreadable: {exc}"
    for name in (WEIGHTS, "config.json"):
        if name not in files:
            return f"the manifest lists no {name}"
    return check_files(directory, files)


def _convert(src: Path, dst: Path, dtype: str) -> None:
    """``src``'s weights with every floating tensor cast to ``dtype`` (integer tensors, the
    draft-to-target token map, kept)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    target = {"float32": np.float32, "float16": np.float16}.get(dtype)
    if target is None:
        raise HeadError(f"cannot write a head as {dtype}: choose float32 or float16")
    tensors = load_file(str(src))
    save_file({k: (v.astype(target) if np.issubdtype(v.dtype, np.floating) else v)
               for k, v in tensors.items()}, str(dst))


def write_head(src: Path, out: Path, dtype: str, record: dict[str, Any] | None = None) -> Path:
    """Copy the head at ``src`` to ``out`` with its weights in ``dtype`` and a manifest
    (``record``: the training record to write, default ``src``'s). Atomic: ``out`` is replaced
    whole."""
    if not (src / WEIGHTS).is_file() or not (src / "config.json").is_file():
        raise HeadError(f"{src} is not a head directory (config.json and {WEIGHTS})")
    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing_dir(out, ".head-") as tmp:
        _convert(src / WEIGHTS, tmp / WEIGHTS, dtype)
        cfg = json.loads((src / "config.json").read_text())
        cfg["torch_dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        rec = record if record is not None else (
            json.loads((src / RECORD).read_text()) if (src / RECORD).is_file() else None)
        if rec is not None:
            (tmp / RECORD).write_text(json.dumps(rec, indent=2) + "\n")
        write_manifest(tmp, dtype)
        tmp.chmod(0o755)  # mkdtemp makes it private; a head is read by every user's engines
        for p in tmp.iterdir():
            p.chmod(0o644)
    return out


def rewrite_record(directory: Path, record: dict[str, Any], dtype: str) -> None:
    """Replace the training record of the head in ``directory`` (and its manifest entry)."""
    (directory / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    (directory / RECORD).chmod(0o644)
    write_manifest(directory, dtype)


@dataclass(frozen=True, slots=True)
class PreparedHead:
    path: Path  # the float32 head vLLM loads
    shipped: Path  # the committed compact form it came from
    rebuilt: bool


def shipped_dir() -> Path:
    return ASSETS / SHIPPED_NAME


def prepare_head(home: Path, shipped: Path | None = None, force: bool = False) -> PreparedHead:
    """Verify the shipped head and return the float32 copy vLLM loads, written when missing,
    stale or corrupt. HeadError names what is wrong with the shipped files."""
    src = shipped or shipped_dir()
    problem = verify(src)
    if problem is not None:
        raise HeadError(f"the shipped EAGLE head in {src} is unusable: {problem}; restore it "
                        "with `git checkout -- src/loadwise/assets` or train one with "
                        "`loadwise drafter train --out DIR`")
    target = home / "heads" / f"{src.name}-float32"
    shipped_sha = sha256_file(src / MANIFEST)
    stamp = target / "loadwise-shipped.sha256"
    if (not force and verify(target) is None and stamp.is_file()
            and stamp.read_text().strip() == shipped_sha):
        return PreparedHead(target, src, rebuilt=False)
    write_head(src, target, "float32")
    stamp.write_text(shipped_sha + "\n")
    problem = verify(target)
    if problem is not None:
        raise HeadError(f"the float32 head written to {target} failed verification: {problem}")
    return PreparedHead(target, src, rebuilt=True)


# --- reproduction: a retrained head against the shipped record -------------------------------
# Held-out accuracy per draft step may differ by this much (absolute) between two runs of the
# same command: the answers are greedy and the training seeded, but float sums on another CPU
# (or thread count) round differently and training amplifies it.
ACCURACY_TOLERANCE = 0.02


def reproduces(shipped: dict[str, Any], trained: dict[str, Any],
               tolerance: float = ACCURACY_TOLERANCE) -> tuple[bool, str]:
    """Whether a retrained head's held-out figures match the shipped record's: the same
    training settings, and accuracy at every draft step within ``tolerance``."""
    if shipped.get("config", {}) | {"model": None} != trained.get("config", {}) | {"model": None}:
        return False, "trained with other settings than the shipped head"
    a = shipped["held_out"]["step_accuracy_every_label"]
    b = trained["held_out"]["step_accuracy_every_label"]
    if len(a) != len(b):
        return False, f"{len(b)} draft steps measured, the shipped head has {len(a)}"
    worst = max(abs(x - y) for x, y in zip(a, b))
    verdict = worst <= tolerance
    return verdict, (f"held-out accuracy per draft step {[round(x, 3) for x in b]} against the "
                     f"shipped {[round(x, 3) for x in a]}: largest difference {worst:.3f} "
                     f"({'within' if verdict else 'above'} the tolerance {tolerance})")
