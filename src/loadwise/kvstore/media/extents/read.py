"""Reading blocks back from the SSD medium's extent files: the plan (contiguous runs of blocks,
each laid out at an aligned place in one destination buffer) and the reads (sub-reads of a
bounded size with a bounded number in flight, every block verified against its checksum as
soon as it has landed; a torn or corrupt block is missing, never returned)."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import xxhash

DIRECT_ALIGN = 4096  # O_DIRECT needs offset, length and buffer aligned to the logical block


def o_direct_supported(directory: str | Path) -> bool:
    """Whether files under ``directory`` can be opened with O_DIRECT (not on tmpfs, say)."""
    probe = Path(directory) / ".o_direct_probe"
    probe.write_bytes(b"\0" * DIRECT_ALIGN)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except (OSError, AttributeError):
        return False
    finally:
        probe.unlink()


def block_checksum(data: bytes | memoryview) -> int:
    """XXH3-64 of a block's bytes (what the index stores and every read verifies)."""
    return xxhash.xxh3_64_intdigest(data)


def align_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def read_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned buffer of at least ``nbytes`` for :meth:`ExtentMedium.get_many` (``into``):
    O_DIRECT needs an aligned destination, and an anonymous mapping always is."""
    return mmap.mmap(-1, max(align_up(nbytes, DIRECT_ALIGN), DIRECT_ALIGN))


def buffer_address(buf: object) -> int:
    ref = ctypes.c_char.from_buffer(buf)  # type: ignore[arg-type]
    try:
        return ctypes.addressof(ref)
    finally:
        del ref  # releases the export, so the caller can still close or resize ``buf``


@dataclass(frozen=True, slots=True)
class Location:
    extent: int
    offset: int
    length: int
    checksum: int


@dataclass(frozen=True, slots=True)
class Run:
    """One contiguous read: bytes [start, start + span) of an extent file into the destination
    buffer at ``dest``; ``blocks`` are (location, answer index) in file order."""
    extent: int
    start: int
    span: int
    dest: int
    blocks: tuple[tuple[Location, int], ...]


def buffer_bytes(runs: Sequence[Run]) -> int:
    """Destination bytes a plan needs: runs are laid out in order, the last one ends it."""
    return runs[-1].dest + runs[-1].span if runs else 0


def plan_runs(index: Mapping[int, Location], keys: Sequence[int], direct: bool) -> list[Run]:
    """Group the stored keys into contiguous runs (file order) and lay them out in the
    destination, each at an aligned position (O_DIRECT reads the aligned span around it)."""
    wanted = sorted(
        ((index[k], i) for i, k in enumerate(keys) if k in index),
        key=lambda li: (li[0].extent, li[0].offset),
    )
    groups: list[list[tuple[Location, int]]] = []
    for loc, i in wanted:
        last = groups[-1][-1][0] if groups else None
        if (last is not None and loc.extent == last.extent
                and loc.offset == last.offset + last.length):
            groups[-1].append((loc, i))
        else:
            groups.append([(loc, i)])
    align = DIRECT_ALIGN if direct else 1
    runs: list[Run] = []
    dest = 0
    for group in groups:
        first, last = group[0][0], group[-1][0]
        start = first.offset - first.offset % align
        end = align_up(last.offset + last.length, align)
        runs.append(Run(first.extent, start, end - start, dest, tuple(group)))
        dest += align_up(end - start, DIRECT_ALIGN)
    return runs


@dataclass(slots=True)
class ReadCounts:
    bytes_read: int = 0
    read_calls: int = 0  # contiguous runs read (one logical read each)
    io_calls: int = 0  # sub-reads issued
    error: OSError | None = None  # the first failed sub-read (its blocks are missing)


def read_runs(runs: list[Run], view: memoryview, out: list[memoryview | None],
              fd_of: Callable[[int], int], chunk_bytes: int,
              pool: ThreadPoolExecutor | None) -> ReadCounts:
    """Read ``runs`` into ``view``; each block that lands intact is put at its answer index
    in ``out``. With a ``pool`` the sub-reads are queued on its threads up front, so the
    device always has the next one while blocks are verified."""
    subs: list[tuple[int, int, int, int]] = []  # (fd, file offset, dest offset, length)
    per_run: list[int] = []
    for run in runs:
        fd = fd_of(run.extent)
        n = 0
        for off in range(0, run.span, chunk_bytes):
            subs.append((fd, run.start + off, run.dest + off,
                         min(chunk_bytes, run.span - off)))
            n += 1
        per_run.append(n)
    counts = ReadCounts(io_calls=len(subs))
    futures: list[Future[int]] | None = None
    if pool is not None and len(subs) > 1:
        futures = [pool.submit(os.preadv, fd, [view[d: d + n]], f) for fd, f, d, n in subs]
    error: OSError | None = None
    j = 0
    try:
        for run, n_subs in zip(runs, per_run):
            landed = 0  # bytes of this run read without a gap, from its start
            complete = True
            blocks = iter(run.blocks)
            pending = next(blocks, None)
            for _ in range(n_subs):
                fd, f, d, n = subs[j]
                try:
                    got = (futures[j].result() if futures
                           else os.preadv(fd, [view[d: d + n]], f))
                except OSError as exc:
                    error = error or exc
                    got = 0
                j += 1
                counts.bytes_read += got
                if complete:
                    landed += got
                    complete = got == n
                # Verify every block that has fully landed.
                while (pending is not None
                       and pending[0].offset + pending[0].length - run.start <= landed):
                    loc, i = pending
                    pos = run.dest + loc.offset - run.start
                    chunk = view[pos: pos + loc.length]
                    # A torn or corrupt block is missing, never returned.
                    if block_checksum(chunk) == loc.checksum:
                        out[i] = chunk
                    pending = next(blocks, None)
            counts.read_calls += 1
    finally:
        # Never return while a worker may still write into the buffer.
        if futures:
            for fut in futures[j:]:
                try:
                    fut.result()
                except OSError:
                    pass
    counts.error = error
    return counts
