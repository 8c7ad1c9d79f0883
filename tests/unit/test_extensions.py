"""The registry of capabilities (``loadwise.config.extension``): every registered module and
hook path loads, every generated option reaches `serve` with its config's default and help, the
rules between capabilities come from the registry, and the fail-open guard."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import subprocess
import sys
from dataclasses import dataclass

import pytest

from loadwise.cli import build_parser
from loadwise.config import env as envvars
from loadwise.config import extension
from loadwise.config.engine import EngineSpec
from loadwise.config.extension import ExtensionError, FailOpen, flag

EXTENSIONS = extension.load_all()


def _serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_every_registered_module_and_hook_path_loads() -> None:
    assert [e.name for e in EXTENSIONS] == [name for name, _ in extension.REGISTRY]
    for ext in EXTENSIONS:
        for path in (*ext.process_hooks, *ext.engine_hooks, *ext.worker_hooks):
            assert callable(extension.hook(path)), path
        assert ext.config.__dataclass_params__.frozen, ext.name  # type: ignore[attr-defined]


@pytest.mark.parametrize("ext", EXTENSIONS, ids=lambda e: e.name)
def test_every_generated_option_is_served_with_the_configs_default_and_help(
        ext: extension.Extension) -> None:
    parser = build_parser()
    serve = next(a for a in parser._subparsers._group_actions  # type: ignore[union-attr]
                 if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    actions = {s: a for a in serve._actions for s in a.option_strings}
    defaults = {f.name: f.default for f in dataclasses.fields(ext.config)}
    args = _serve_args()
    assert ext.options(), ext.name
    for o in ext.options():
        action = actions[o.flag.name]
        assert o.help and o.help in (action.help or ""), o.flag.name
        expected = None if defaults[o.field] is dataclasses.MISSING else defaults[o.field]
        assert o.value(args) == expected == o.default, o.flag.name
        assert not o.given(args)
    assert not extension.enabled(EXTENSIONS, args)[ext.name]


def test_flags_and_destinations_are_unique_across_the_registry() -> None:
    flags = [o.flag.name for e in EXTENSIONS for o in e.options()]
    dests = [o.dest for e in EXTENSIONS for o in e.options()]
    assert len(set(flags)) == len(flags) and len(set(dests)) == len(dests)


OPTION_WITHOUT_SWITCH = {
    "gate": ["--acceptance-history", "0.5"], "adaptive": ["--state-file", "s.json"],
    "kv": ["--kv-memory-gib", "1"], "disagg": ["--handoff", "pull"],
    "sched": ["--max-wait-s", "5"]}


@pytest.mark.parametrize("name", sorted(OPTION_WITHOUT_SWITCH))
def test_an_option_without_its_switch_names_the_switch(name: str) -> None:
    ext = extension.load(name)
    argv = OPTION_WITHOUT_SWITCH[name]
    with pytest.raises(ExtensionError, match=f"^{argv[0]} needs {ext.switch}"):
        extension.enabled(EXTENSIONS, _serve_args(*argv))


def test_kv_options_are_taken_by_disagg_and_disagg_refuses_what_it_conflicts_with() -> None:
    on = extension.enabled(EXTENSIONS, _serve_args("--disagg", "--kv-memory-gib", "1"))
    assert on["disagg"] and not on["kv"]
    with pytest.raises(ExtensionError, match="--disagg does not take --schedule srpt, --oracle-lengths yet"):
        extension.enabled(EXTENSIONS, _serve_args("--disagg", "--schedule", "srpt",
                                                  "--oracle-lengths", "/dev/null"))


def test_a_negated_flag_sets_its_field_false() -> None:
    args = _serve_args("--disagg", "--handoff", "pull", "--no-kv-reuse")
    cfg = extension.configs(EXTENSIONS, args)["disagg"]
    assert (cfg.handoff, cfg.kv_reuse) == ("pull", False)


@dataclass(frozen=True)
class _Documented:
    size_gib: float = flag("--size-gib", 1.5)
    """how big"""
    name: str | None = flag("--name", None, metavar="NAME")
    """what it is
    called"""
    hidden: int = 3


@dataclass(frozen=True)
class _Undocumented:
    size_gib: float = flag("--size-gib", 1.5)


def test_options_come_from_flagged_fields_and_their_docstrings() -> None:
    opts = extension.options(_Documented)
    assert [(o.flag.name, o.kind, o.default, o.help) for o in opts] == [
        ("--size-gib", float, 1.5, "how big"), ("--name", str, None, "what it is called")]
    with pytest.raises(ExtensionError, match="has no docstring"):
        extension.options(_Undocumented)


def test_an_unknown_capability_is_refused_with_the_registered_names() -> None:
    with pytest.raises(ExtensionError, match="registered are gate, adaptive"):
        extension.load("nope")


def test_fail_open_logs_once_then_keeps_the_capability_off(
        caplog: pytest.LogCaptureFixture) -> None:
    guard = FailOpen("demo", logging.getLogger("loadwise.test"))
    assert guard.call("adding", lambda a, b: a + b, 1, 2) == 3
    calls = []

    def broken() -> None:
        calls.append(1)
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="loadwise.test"):
        assert guard.call("breaking", broken) is None
        assert guard.call("breaking again", broken) is None
        assert guard.call("adding", lambda: 1) is None
    assert calls == [1] and guard.off
    assert len([r for r in caplog.records if "demo failed while breaking" in r.message]) == 1


def test_an_engine_never_inherits_a_capability_its_spec_does_not_run(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    inherited = {v.name: "x" for v in envvars.engine_scoped()}
    env = EngineSpec(model=str(tmp_path), spec_method=None).env(inherited)
    assert not set(inherited) & set(env)
    assert {v.name for v in envvars.engine_scoped()} >= {
        v.name for e in EXTENSIONS for v in e.env_vars}


def _hook_modules() -> set[str]:
    return {p.partition(":")[0] for e in EXTENSIONS
            for p in (*e.process_hooks, *e.engine_hooks, *e.worker_hooks)}


def test_the_plugin_imports_no_capability_hook_where_none_is_on() -> None:
    code = ("import os, sys\n"
            "for v in [k for k in os.environ if k.startswith('LOADWISE_')]: del os.environ[v]\n"
            "from loadwise.vllm import plugin, scheduler_hooks\n"
            "plugin._register_extensions()\n"
            "hooks = [h for h in scheduler_hooks._INIT_HOOKS if isinstance(h, plugin.Hook)]\n"
            f"print(len(hooks), sorted(set(sys.modules) & {_hook_modules()!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split(maxsplit=1)
    engine_hooks = sum(len(e.engine_hooks) for e in EXTENSIONS)
    assert int(out[0]) == engine_hooks > 0
    assert out[1].strip() == "[]"


@dataclass(frozen=True)
class _Cache:
    cache_dir: str | None = flag("--cache-dir", None)
    """where"""


@dataclass(frozen=True)
class _Warm:
    warm_s: float = flag("--warm-s", 0.0)
    """how long"""


def test_a_capability_that_requires_another_is_refused_without_it() -> None:
    """``requires``: a capability on without the one it needs is one line naming that one's
    switch; with it, both are on."""
    cache = extension.Extension("cache", "cache", _Cache, "--cache-dir",
                                is_on=lambda v: v["cache_dir"] is not None)
    warm = extension.Extension("warm", "warm", _Warm, "--warm-s",
                               is_on=lambda v: v["warm_s"] > 0, requires=("cache",))
    parser = argparse.ArgumentParser()
    for ext in (cache, warm):
        extension.add_group(parser, ext)
    with pytest.raises(ExtensionError, match="^--warm-s needs --cache-dir$"):
        extension.enabled((cache, warm), parser.parse_args(["--warm-s", "2"]))
    on = extension.enabled((cache, warm), parser.parse_args(["--warm-s", "2", "--cache-dir", "d"]))
    assert on == {"cache": True, "warm": True}
    assert extension.enabled((cache, warm), parser.parse_args([])) == {"cache": False,
                                                                      "warm": False}
