"""``loadwise serve --disagg``: a prefill engine and a decode engine, each on its own cores, on
one loadwise KV store, behind :class:`~loadwise.disagg.proxy.DisaggProxy`.

The handoff is the store: the prefill engine writes its prompt's blocks before it answers
(``sync_saves``), the decode engine loads them after their header checks. vLLM frees the
prefill's blocks once its step ends (the saves have copied them) and the decode's loads finish
before its forward, so no transfer is in flight when either engine frees a block. The decode
engine saves the blocks it completes (the answer) in the same store, where the next turn's
prefill finds them.

Lifecycle: both engines start together; the proxy starts once both are healthy. Ctrl-C or
SIGTERM stops all three; an engine that exits is reported with its last log lines and the
other is stopped, or (``restart_dead``) it is started again while the proxy answers the
requests that need it with errors.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from dataclasses import dataclass, replace

import requests
from aiohttp import web

from loadwise.config.binding import CpuBinding, allowed_cpus
from loadwise.config.engine import EngineSpec
from loadwise.config.kvstore import KvStoreConfig
from loadwise.disagg.proxy import DisaggProxy, limits_from
from loadwise.errors import LoadwiseError
from loadwise.kvstore.handoff.ledger import EngineLimits
from loadwise.vllm.server import ServerProcess, free_port

logger = logging.getLogger("loadwise.disagg")


class DisaggError(LoadwiseError, RuntimeError):
    pass


def split_cores(cores: tuple[int, ...] | None = None) -> tuple[CpuBinding, CpuBinding]:
    """Prefill gets the first half of the cores, decode the rest (one each on two cores)."""
    cpus = tuple(cores) if cores is not None else allowed_cpus()
    if len(cpus) < 2:
        raise DisaggError(f"--disagg needs two cores, one per engine; this process may use "
                          f"{len(cpus)}")
    half = len(cpus) // 2
    return CpuBinding(cpus[:half]), CpuBinding(cpus[half:])


@dataclass(frozen=True, slots=True)
class DisaggSpecs:
    prefill: EngineSpec
    decode: EngineSpec

    @classmethod
    def from_spec(cls, spec: EngineSpec, store: KvStoreConfig,
                  cores: tuple[int, ...] | None = None,
                  decode_kv_cache_gib: float | None = None) -> DisaggSpecs:
        """Two engines of ``spec`` on one store. Handing over through the store, the prefill
        writes on the step path; pulling, it serves its blocks on a port of its own.

        Each engine's writer gets half of the store's capacity: a writer evicts only the
        blocks it knows (those on disk when it opened, and its own writes), so every file is
        counted by at least one of them and the two together never exceed the capacity.
        ``decode_kv_cache_gib`` sizes decode's vLLM cache apart from prefill's (default:
        ``spec``'s, as prefill's)."""
        if decode_kv_cache_gib is not None and not decode_kv_cache_gib > 0:
            raise DisaggError(f"--decode-kv-cache-gib must be > 0, got {decode_kv_cache_gib:g}")
        p_bind, d_bind = split_cores(cores)
        pull = store.handoff != "store"
        half = replace(store, capacity_gib=store.capacity_gib / 2)
        prefill = replace(half, sync_saves=not pull, engine="prefill",
                          pull_port=free_port() if pull else None)
        decode_gib = (spec.kv_cache_space_gib if decode_kv_cache_gib is None
                      else decode_kv_cache_gib)
        decode = replace(half, sync_saves=False, engine="decode", pull_port=None)
        return cls(replace(spec, cpu_binding=p_bind).with_extension(prefill),
                   replace(spec, cpu_binding=d_bind,
                           kv_cache_space_gib=decode_gib).with_extension(decode))


def engine_limits(url: str, timeout_s: float = 30.0) -> EngineLimits:
    models = requests.get(f"{url}/v1/models", timeout=timeout_s)
    metrics = requests.get(f"{url}/metrics", timeout=timeout_s)
    models.raise_for_status()
    metrics.raise_for_status()
    return limits_from(models.json(), metrics.text)


class DisaggServer:
    """The two engine servers and the proxy; ``run`` serves until stopped or an engine dies."""

    def __init__(self, specs: DisaggSpecs, host: str = "127.0.0.1", port: int = 8000,
                 echo: bool = False, restart_dead: bool = False,
                 start_timeout_s: float = 900.0) -> None:
        self.host, self.port = host, port
        self.restart_dead = restart_dead
        self.start_timeout_s = start_timeout_s
        self.engines = {"prefill": ServerProcess(specs.prefill, echo=echo),
                        "decode": ServerProcess(specs.decode, echo=echo)}
        self.proxy: DisaggProxy | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start_engines(self, timeout_s: float) -> None:
        for server in self.engines.values():
            server.launch()
        try:
            for server in self.engines.values():
                server.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        p, d = self.engines["prefill"], self.engines["decode"]
        kv = p.spec.extension(KvStoreConfig)
        push_to = ("127.0.0.1", kv.pull_port) if kv and kv.handoff == "push" and kv.pull_port \
            else None
        self.proxy = DisaggProxy(p.url, d.url, engine_limits(p.url), engine_limits(d.url),
                                 push_to=push_to)

    def dead_engine(self) -> str | None:
        for name, server in self.engines.items():
            if server.proc is None or server.proc.poll() is not None:
                return name
        return None

    async def serve(self, on_ready: object = None) -> str:
        """Serve until an engine exits (returns its name; with ``restart_dead`` it is started
        again on its port while the proxy answers its requests with errors) or the task is
        cancelled."""
        assert self.proxy is not None, "start_engines first"
        runner = web.AppRunner(self.proxy.app(), handle_signals=False, access_log=None,
                               handler_cancellation=True)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
            if callable(on_ready):
                on_ready()
            while True:
                dead = self.dead_engine()
                if dead is None:
                    await asyncio.sleep(0.5)
                    continue
                if not self.restart_dead:
                    return dead
                await asyncio.get_running_loop().run_in_executor(None, self.restart, dead)
        finally:
            await runner.cleanup()

    def restart(self, name: str) -> None:
        """Reap a dead engine's process group and start the same engine on the same port
        (raises ServerError when it does not come back)."""
        old = self.engines[name]
        code = old.proc.returncode if old.proc else None
        logger.warning("loadwise: the %s engine exited (code %s); restarting it. Its last "
                       "lines:\n%s", name, code, old.log_tail(10))
        restarting = self.proxy.restarting if self.proxy else set()
        restarting.add(name)
        old.stop()
        new = ServerProcess(old.spec, host=old.host, port=old.port, echo=old.echo,
                            log_path=old.log_path)
        self.engines[name] = new
        new.start(self.start_timeout_s)
        logger.warning("loadwise: the %s engine is serving again", name)
        restarting.discard(name)

    def run(self, on_ready: object = None) -> str | None:
        """Serve in this thread; None when stopped by Ctrl-C/SIGTERM, else the dead engine."""
        loop = asyncio.new_event_loop()
        task = loop.create_task(self.serve(on_ready))
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            return loop.run_until_complete(task)
        except asyncio.CancelledError:
            return None
        finally:
            loop.close()

    def stop(self) -> None:
        stops = [threading.Thread(target=s.stop) for s in self.engines.values()]
        for t in stops:
            t.start()
        for t in stops:
            t.join()
