"""Capabilities as extensions: how an engine-side capability reaches the command line, the
engine's environment and vLLM's processes.

Each capability (KV store, P/D, ordering, draft gate, adaptive tables, batch invariance) is one
package exporting ``EXTENSION``: an :class:`Extension` naming its frozen config dataclass. The
config's fields marked with :func:`flag` and the docstring under each field generate the
capability's option group (as vLLM's ``get_kwargs`` does from its configs); its
``__post_init__`` holds value rules; ``requires``/``conflicts`` hold the rules between
capabilities. :data:`REGISTRY` names each extension module by path and loads it on demand, as
vLLM's KV connector factory does, so nothing here imports a capability.

A config an engine runs with is an :class:`EngineExtension`: it renders its own environment,
server flags and ``LLM`` keyword arguments, and ``EngineSpec`` folds over the ones it holds.

Pure: no torch, no vLLM.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import itertools
import logging
import textwrap
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from functools import cache
from typing import Any, Protocol, TypeVar, runtime_checkable

from loadwise.config.env import EnvVar
from loadwise.errors import LoadwiseError

C = TypeVar("C")

# name -> the module exporting EXTENSION, in the order `serve --help` shows the groups.
REGISTRY: tuple[tuple[str, str], ...] = (
    ("gate", "loadwise.gate.extension"),
    ("adaptive", "loadwise.adaptive.extension"),
    ("kv", "loadwise.kvstore.extension"),
    ("disagg", "loadwise.disagg.extension"),
    ("sched", "loadwise.sched.extension"),
    ("invariance", "loadwise.invariance.extension"),
)


class ExtensionError(LoadwiseError):
    """Options that a capability refuses, or capabilities that do not combine."""


@dataclass(frozen=True, slots=True)
class Flag:
    """How a config field appears on the command line."""

    name: str  # "--kv-disk-gib"
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    # A field that is True by default, switched off by this flag ("--no-kv-reuse").
    negated: bool = False


def flag(name: str, default: Any = MISSING, *, metavar: str | None = None,
         choices: Sequence[str] | None = None, negated: bool = False) -> Any:
    """A config field that is also a command-line option; its help is the docstring under it.
    A field without a default is None on the command line until given (its switch)."""
    meta = {"flag": Flag(name, metavar, None if choices is None else tuple(choices), negated)}
    return field(metadata=meta) if default is MISSING else field(default=default, metadata=meta)


@dataclass(frozen=True, slots=True)
class Option:
    """One generated option: a config field, its flag, its type and its help."""

    field: str
    flag: Flag
    kind: type  # bool, int, float or str
    default: Any
    help: str

    @property
    def dest(self) -> str:
        return self.flag.name.lstrip("-").replace("-", "_")

    def value(self, args: argparse.Namespace) -> Any:
        """The field's value from parsed ``args`` (a negated flag given means False)."""
        raw = getattr(args, self.dest)
        return not raw if self.flag.negated else raw

    def given(self, args: argparse.Namespace) -> bool:
        return bool(self.value(args) != self.default)


@runtime_checkable
class EngineExtension(Protocol):
    """A capability's config as an engine runs it (``spec``: the ``EngineSpec`` holding it):
    its checks against the engine, what it adds to the engine's environment, to the server's
    flags and to ``LLM(...)``, and the scheduler class it needs (None: loadwise's adapter).
    Every method is pure; a refusal raises a ``LoadwiseError``."""

    def check_engine(self, spec: Any) -> None: ...

    def env(self) -> dict[str, str]: ...

    def server_args(self, spec: Any) -> list[str]: ...

    def llm_kwargs(self, spec: Any) -> dict[str, Any]: ...

    def scheduler_cls(self, async_scheduling: bool) -> str | None: ...


class EngineDefaults:
    """What a capability adds to an engine where it adds nothing: mixed into the configs that
    only set variables (every method of :class:`EngineExtension`, each a no-op)."""

    __slots__ = ()

    def check_engine(self, spec: Any) -> None:
        """Any engine takes the capability."""

    def env(self) -> dict[str, str]:
        return {}

    def server_args(self, spec: Any) -> list[str]:
        return []

    def llm_kwargs(self, spec: Any) -> dict[str, Any]:
        return {}

    def scheduler_cls(self, async_scheduling: bool) -> str | None:
        return None


@dataclass(frozen=True)
class Extension:
    """One capability as the command line and the engine see it.

    ``switch`` is what turns it on, as an operator types it; ``is_on`` says from the config's
    option values whether it is on. An option of the group given while the capability is off
    is refused ("--handoff needs --disagg"), unless a capability in ``enabled_by`` is on.
    ``build`` makes the config from the option values and the parsed arguments (checks that
    need files or other options go there); ``process_hooks``, ``engine_hooks`` and
    ``worker_hooks`` name, by ``module:function``, what runs when vLLM loads loadwise's plugin,
    in vLLM's engine core (given the scheduler) and in its worker (given the model runner),
    loaded only in a process where the capability is on."""

    name: str
    title: str
    config: type
    switch: str
    is_on: Callable[[Mapping[str, Any]], bool]
    # None: the config from the option values alone (``build_config``).
    build: Callable[[Mapping[str, Any], argparse.Namespace], Any] | None = None
    requires: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()
    enabled_by: tuple[str, ...] = ()
    engine_hooks: tuple[str, ...] = ()
    worker_hooks: tuple[str, ...] = ()
    # Run once when the plugin loads in each vLLM process where the capability is on.
    process_hooks: tuple[str, ...] = ()
    # True: a failing hook logs once and switches the capability off while vLLM goes on.
    # False: the failure stops the engine (a mode that must hold or not serve at all).
    fail_open: bool = True
    # The engine-scoped variables that carry the config into vLLM's processes: the plugin
    # loads the hooks of a capability only in a process where one of them is set.
    env_vars: tuple[EnvVar, ...] = ()
    # One line for the operator when serve starts with the capability on.
    describe: Callable[[Any], str] = str

    def active(self, env: Mapping[str, str] | None = None) -> bool:
        """Whether this capability runs in a process with ``env`` (default: this one's)."""
        return any(v.is_set(env) for v in self.env_vars)

    def options(self) -> tuple[Option, ...]:
        return options(self.config)

    def values(self, args: argparse.Namespace) -> dict[str, Any]:
        return {o.field: o.value(args) for o in self.options()}

    def given(self, args: argparse.Namespace, with_choice: bool = False) -> list[str]:
        """The options given a value other than their default (``with_choice``: a choice
        shown with its value, "--schedule srpt")."""
        return [f"{o.flag.name} {o.value(args)}" if with_choice and o.flag.choices else
                o.flag.name for o in self.options() if o.given(args)]


def load(name: str) -> Extension:
    """The registered extension ``name``, its module imported now."""
    paths = dict(REGISTRY)
    if name not in paths:
        raise ExtensionError(f"unknown capability {name!r}: registered are {', '.join(paths)}")
    ext = importlib.import_module(paths[name]).EXTENSION
    if not isinstance(ext, Extension) or ext.name != name:
        raise ExtensionError(f"{paths[name]}.EXTENSION is not the extension {name!r}")
    return ext


def load_all() -> tuple[Extension, ...]:
    return tuple(load(name) for name, _ in REGISTRY)


def hook(path: str) -> Callable[..., Any]:
    """The function a ``module:function`` path names, imported now."""
    module, _, name = path.partition(":")
    fn = getattr(importlib.import_module(module), name)
    if not callable(fn):
        raise ExtensionError(f"{path} is not callable")
    return typing.cast(Callable[..., Any], fn)


# --- options from a config dataclass ----------------------------------------------------------
@cache
def attr_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of ``cls`` (a string literal right after its
    annotation), by field name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = typing.cast(ast.ClassDef, tree.body[0]).body
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


@cache
def options(cls: type) -> tuple[Option, ...]:
    """The command-line options ``cls``'s flagged fields generate, in field order."""
    hints = typing.get_type_hints(cls)
    docs = attr_docs(cls)
    out = []
    for f in fields(cls):
        fl = f.metadata.get("flag")
        if fl is None:
            continue
        if f.name not in docs:
            raise ExtensionError(f"{cls.__name__}.{f.name} ({fl.name}) has no docstring")
        default = None if f.default is MISSING else f.default
        out.append(Option(f.name, fl, _scalar(hints[f.name]), default, docs[f.name]))
    return tuple(out)


def _scalar(hint: Any) -> type:
    """bool, int, float or str from a field's type (``X | None`` is X)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            hint = args[0]
    if hint not in (bool, int, float, str):
        raise ExtensionError(f"an option's field must be bool, int, float or str, not {hint}")
    return typing.cast(type, hint)


def add_group(parser: argparse.ArgumentParser, ext: Extension) -> None:
    """``ext``'s options as one argument group of ``parser``."""
    group = parser.add_argument_group(ext.title)
    for o in ext.options():
        fl = o.flag
        if o.kind is bool:
            group.add_argument(fl.name, dest=o.dest, action="store_true", help=o.help)
        else:
            group.add_argument(fl.name, dest=o.dest, type=o.kind, default=o.default,
                               metavar=fl.metavar, choices=fl.choices, help=_with_default(o))


def _with_default(o: Option) -> str:
    """The option's help, its default appended unless the help says it or there is none."""
    if o.default is None or "default" in o.help:
        return o.help
    shown = f"{o.default:g}" if isinstance(o.default, float) else str(o.default)
    return f"{o.help} (default {shown})"


# --- which capabilities are on, and whether they combine --------------------------------------
def enabled(exts: Sequence[Extension], args: argparse.Namespace) -> dict[str, bool]:
    """Each capability's on/off from parsed ``args``, with the rules between capabilities
    checked: an option of a capability that is off, a missing requirement, a conflict."""
    on = {e.name: bool(e.is_on(e.values(args))) for e in exts}
    by_name = {e.name: e for e in exts}
    for e in exts:
        given = e.given(args)
        if given and not on[e.name] and not any(on.get(o) for o in e.enabled_by):
            alternatives = "".join(f" (or {by_name[o].switch})" for o in e.enabled_by)
            raise ExtensionError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} "
                                 f"{e.switch}{alternatives}")
    for e in exts:
        if not on[e.name]:
            continue
        for other in e.requires:
            if not on.get(other):
                raise ExtensionError(f"{e.switch} needs {by_name[other].switch}")
        taken = [f for other in e.conflicts if on.get(other)
                 for f in by_name[other].given(args, with_choice=True)]
        if taken:
            raise ExtensionError(f"{e.switch} does not take {', '.join(taken)} yet")
    return on


def configs(exts: Sequence[Extension], args: argparse.Namespace) -> dict[str, Any]:
    """The config of every capability that is on, by name (the rules checked first)."""
    on = enabled(exts, args)
    return {e.name: e.build(e.values(args), args) if e.build else
            build_config(e.config, e.values(args)) for e in exts if on[e.name]}


def build_config(cls: type[C], values: Mapping[str, Any], **extra: Any) -> C:
    """``cls(**values, **extra)``, a value error raised as the user's error."""
    try:
        return cls(**values, **extra)
    except ValueError as exc:
        if isinstance(exc, LoadwiseError):
            raise
        raise ExtensionError(str(exc)) from exc


# --- the one guard between a capability's hooks and vLLM --------------------------------------
class FailOpen:
    """Runs a capability's code inside vLLM: the first exception is logged with its traceback,
    the capability is switched off for the rest of this guard's life (``on_off`` runs once
    then: the capability puts back what vLLM had), and vLLM goes on without it. No capability
    writes its own try/except for this.

    Two forms: ``guard.call(what, fn, *args)`` returns ``fn(*args)``, or None once off; and
    ``with guard(what): ...`` runs a block whose exception is absorbed the same way (check
    ``guard.on`` first to skip the block once off)."""

    def __init__(self, name: str, logger: logging.Logger,
                 on_off: Callable[[], None] | None = None,
                 then: str = "vLLM goes on without it") -> None:
        self.name = name
        self.logger = logger
        self.on_off = on_off
        self.then = then  # what the engine does once the capability is off
        self.off = False

    @property
    def on(self) -> bool:
        return not self.off

    def call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or None once this capability is off (now or before)."""
        if self.off:
            return None
        with self(what):
            return fn(*args)
        return None

    def __call__(self, what: str) -> _Guarded:
        return _Guarded(self, what)

    def switch_off(self, what: str) -> None:
        """Log why (with the exception being handled, if any), switch off, undo (once)."""
        if self.off:
            return
        self.off = True
        self.logger.exception("loadwise: %s failed while %s; off, %s", self.name, what,
                              self.then)
        if self.on_off is not None:
            try:
                self.on_off()
            except Exception:  # the guard's own: undoing must not raise into vLLM either
                self.logger.exception("loadwise: %s could not put back what it changed",
                                      self.name)


@dataclass(frozen=True, slots=True)
class _Guarded:
    """One block run under ``guard``: an exception in it switches the capability off."""

    guard: FailOpen
    what: str

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: types.TracebackType | None) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False  # KeyboardInterrupt and SystemExit are vLLM's, never absorbed
        self.guard.switch_off(self.what)
        return True
