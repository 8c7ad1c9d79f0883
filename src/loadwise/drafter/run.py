"""``loadwise drafter train``: text → target hidden states → a trained EAGLE head directory.

Every stage resumes: examples and hidden states are cached under ``OUT/work`` and the training
state is saved every few minutes, so a killed run started again with the same flags continues.
The cache belongs to one set of data settings (``run.json``) but not to a number of examples:
the conversations come in one seeded order, so a run with a larger ``--num-examples`` extends
the cache and a smaller one reads its prefix. Training settings may change between runs on it,
each with its own saved state.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadwise.drafter.data import SOURCES, DrafterDataError


@dataclass(frozen=True, slots=True)
class DrafterConfig:
    model: str
    out_dir: str
    data: str = "self"  # self: the model's greedy answers; human: the recorded answers
    # At equal training time more conversations beat more epochs (docs/drafter.md).
    num_examples: int = 1920
    max_prompt_chars: int = 800
    max_answer_tokens: int = 256
    draft_vocab_size: int = 2048  # the draft LM head's cost against acceptance: docs/drafter.md
    num_steps: int = 3  # draft steps unrolled in training: the k the head is trained for
    # EAGLE-3 auxiliary layers the head reads (residual stream after that many target layers);
    # empty: the target's last hidden state.
    aux_layers: tuple[int, ...] = ()
    epochs: int = 4
    lr: float = 1e-3
    batch_tokens: int = 1024
    held_out: int = 32  # examples kept out of training to measure the head
    seed: int = 0
    save_every_s: float = 120.0

    def __post_init__(self) -> None:
        if self.data not in SOURCES:
            raise DrafterDataError(f"unknown --data {self.data!r}: choose one of "
                                   f"{', '.join(SOURCES)}")
        for name in ("num_examples", "max_answer_tokens", "draft_vocab_size", "num_steps",
                     "epochs", "batch_tokens", "held_out"):
            if getattr(self, name) < 1:
                raise DrafterDataError(f"--{name.replace('_', '-')} must be >= 1, got "
                                       f"{getattr(self, name)}")
        if self.held_out >= self.num_examples:
            raise DrafterDataError(f"--held-out {self.held_out} leaves nothing to train on "
                                   f"(--num-examples {self.num_examples})")
        if len(set(self.aux_layers)) != len(self.aux_layers) or any(
                i < 1 for i in self.aux_layers):
            raise DrafterDataError(f"--aux-layers must be distinct layer ids >= 1, got "
                                   f"{','.join(map(str, self.aux_layers))}")
        if not self.lr > 0:
            raise DrafterDataError(f"--lr must be > 0, got {self.lr}")
        if not (Path(self.model) / "config.json").is_file():
            raise DrafterDataError(f"--model {self.model} is not a model directory (no "
                                   "config.json): give a Hugging Face-format model directory")
        if self.aux_layers:
            num_layers = num_layers_of(self.model)
            if max(self.aux_layers) >= num_layers:
                raise DrafterDataError(
                    f"--aux-layers {','.join(map(str, self.aux_layers))}: {self.model} has "
                    f"{num_layers} layers, so layer ids must be below {num_layers}")

    def data_fingerprint(self) -> dict[str, Any]:
        """What each cached example and its hidden states depend on. Not ``num_examples``:
        example i is the same at any count (``sharegpt_pairs`` is a prefix of one seeded
        order), so the cache is extended or read in part."""
        keep = {"model", "data", "max_prompt_chars", "max_answer_tokens", "seed"}
        return {k: v for k, v in dataclasses.asdict(self).items() if k in keep}

    def fingerprint(self) -> dict[str, Any]:
        """What a saved training state must match to be resumed."""
        # A head on the last hidden state keeps the fingerprint it had before aux layers.
        drop = ("out_dir", "save_every_s") + (() if self.aux_layers else ("aux_layers",))
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in drop}

    def hidden_dir(self) -> str:
        """The cached hidden states' directory under OUT/work: one per set of layers read."""
        tail = "-aux" + "-".join(map(str, self.aux_layers)) if self.aux_layers else ""
        return f"hidden-{self.data}{tail}"

    def state_name(self) -> str:
        """The training state's file: one per training setting, so a run with another
        learning rate (say) starts its own training on the same cached data."""
        digest = hashlib.sha256(json.dumps(self.fingerprint(), sort_keys=True).encode())
        return f"train-state-{digest.hexdigest()[:12]}.pt"


# stage, done, total, detail
Report = Callable[[str, int, int, str], None]


def train_drafter(cfg: DrafterConfig, report: Report,
                  engine_factory: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Run every stage; returns the head's metadata (also written to OUT/loadwise-drafter.json).

    ``engine_factory`` makes the vLLM engine that writes ``self`` answers (a LocalEngine)."""
    # Imported here, not at the top: torch and transformers take seconds to load, and the CLI
    # imports this module to validate a run's settings before any of that is needed.
    import torch

    from loadwise.drafter import train as T
    from loadwise.drafter.head import save_head

    out = Path(cfg.out_dir)
    work = out / "work"
    _claim(work, cfg)
    timings: dict[str, float] = {}

    t = time.perf_counter()
    examples = _examples(cfg, work, report, engine_factory)
    timings["examples_s"] = time.perf_counter() - t

    # After the engine: vLLM leaves this process at one torch thread.
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    t = time.perf_counter()
    target_cfg, weights, hidden = _hidden(cfg, work, report, examples)
    timings["hidden_s"] = time.perf_counter() - t

    train_ex, val_ex = examples[cfg.held_out:], examples[:cfg.held_out]
    train_h, val_h = hidden[cfg.held_out:], hidden[:cfg.held_out]
    t = time.perf_counter()
    head, coverage, state = _train(cfg, work, report, target_cfg, weights, train_ex, train_h)
    timings["train_s"] = time.perf_counter() - t
    report("held-out check", 0, 1, f"{len(val_ex)} examples")
    metrics = T.evaluate_head(head, val_ex, val_h, cfg.num_steps, cfg.batch_tokens)
    meta = {"kind": "loadwise-eagle-head", "vllm_method": "eagle3", "target": cfg.model,
            "config": cfg.fingerprint(), "draft_vocab_coverage": coverage,
            "num_train_examples": len(train_ex),
            "num_train_tokens": sum(len(e.token_ids) for e in train_ex),
            "held_out": metrics, "stage_time_s": timings, "train_time_s": state.elapsed_s}
    save_head(head, target_cfg, out, meta)
    return meta


def _examples(cfg: DrafterConfig, work: Path, report: Report,
              engine_factory: Callable[[], Any] | None) -> list[Any]:
    """Stage 1: the training conversations (ShareGPT prompts, answered as ``cfg.data`` says)."""
    from loadwise.drafter.data import build_examples
    from loadwise.measure.workloads import sharegpt_pairs

    pairs = sharegpt_pairs(cfg.num_examples, cfg.max_prompt_chars, seed=cfg.seed)
    made = [0]

    def on_example(n: int) -> None:
        made[0] += n
        report("examples", made[0], len(pairs), cfg.data)

    return build_examples(cfg.data, pairs, cfg.model, work / f"examples-{cfg.data}.jsonl",
                          cfg.max_answer_tokens, on_example, engine_factory)


def _hidden(cfg: DrafterConfig, work: Path, report: Report,
            examples: list[Any]) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
    """Stage 2: the target's config, weights and hidden states of every example."""
    from loadwise.drafter.target import hidden_states, load_target

    target_cfg, weights, lm = load_target(cfg.model)
    done = [0]

    def on_hidden(n: int) -> None:
        done[0] += n
        report("hidden states", done[0], len(examples), "target forward")

    hidden = hidden_states(lm, examples, work / cfg.hidden_dir(), on_hidden, cfg.aux_layers)
    del lm
    return target_cfg, weights, hidden


def _train(cfg: DrafterConfig, work: Path, report: Report, target_cfg: dict[str, Any],
           weights: dict[str, Any], train_ex: list[Any],
           train_h: list[Any]) -> tuple[Any, float, Any]:
    """Stage 3: the head initialised from the target and trained, resumed from the work
    directory's state where a run was interrupted; returns it, its vocabulary's coverage and
    the training state."""
    import torch

    from loadwise.drafter import train as T
    from loadwise.drafter.head import EagleHead, HeadShape

    shape = HeadShape.from_config(target_cfg)
    eos = int(target_cfg.get("eos_token_id") or 0)
    vocab, coverage = T.select_vocab(train_ex, cfg.draft_vocab_size, [eos], shape.vocab_size)
    embed = weights["model.embed_tokens.weight"]
    torch.manual_seed(cfg.seed)
    head = EagleHead(shape, vocab, embed, cfg.aux_layers)
    head.init_from_target(weights, shape_last_layer(target_cfg))
    optimizer = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    state = T.TrainState()
    state_path = work / cfg.state_name()
    if state_path.is_file():
        saved = torch.load(state_path, weights_only=False)
        head.load_state_dict(saved["head"])
        optimizer.load_state_dict(saved["optimizer"])
        state = saved["state"]

    def save(st: T.TrainState) -> None:
        tmp = state_path.with_suffix(".tmp")
        torch.save({"fingerprint": cfg.fingerprint(), "head": head.state_dict(),
                    "optimizer": optimizer.state_dict(), "state": st}, tmp)
        tmp.replace(state_path)

    def on_batch(p: T.Progress) -> None:
        report("training", p.epoch * p.num_batches + p.batch, p.num_batches * cfg.epochs,
               f"epoch {p.epoch + 1}/{cfg.epochs} loss {p.loss:.3f}")

    T.train_loop(head, train_ex, train_h, epochs=cfg.epochs, batch_tokens=cfg.batch_tokens,
                 lr=cfg.lr, num_steps=cfg.num_steps, seed=cfg.seed, state=state,
                 optimizer=optimizer, save=save, save_every_s=cfg.save_every_s,
                 on_batch=on_batch)
    return head, coverage, state


def num_layers_of(model: str) -> int:
    try:
        return int(json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DrafterDataError(f"--model {model}: cannot read num_hidden_layers from its "
                               f"config.json ({exc})") from exc


def _claim(work: Path, cfg: DrafterConfig) -> None:
    """The work directory holds one set of examples and their hidden states: a run with other
    data settings is refused before anything is read or written there."""
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DrafterDataError(f"--out {cfg.out_dir}: cannot create {work} "
                               f"({exc.strerror})") from exc
    path = work / "run.json"
    if path.is_file():
        try:
            stored = json.loads(path.read_text())
            # Directories made before the count left the fingerprint record it.
            stored.pop("num_examples", None)
            same = stored == cfg.data_fingerprint()
        except (ValueError, AttributeError):
            same = False
        if not same:
            raise DrafterDataError(f"{cfg.out_dir} holds examples made with other data settings "
                                   f"({path}): start it again with the same --data and "
                                   "--max-answer-tokens (--num-examples may change), or give "
                                   "another --out")
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cfg.data_fingerprint(), indent=2))
    tmp.replace(path)


def shape_last_layer(target_cfg: dict[str, Any]) -> int:
    return int(target_cfg["num_hidden_layers"]) - 1


def read_meta(head_dir: str | Path) -> dict[str, Any] | None:
    """A head's loadwise metadata, or None for a directory loadwise did not train."""
    from loadwise.drafter.head import META_FILE

    path = Path(head_dir) / META_FILE
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def held_out_of(head_dir: Path, work_dir: Path) -> dict[str, Any]:
    """The held-out figures of the head saved in ``head_dir`` as its weights are stored (a
    compact copy's rounding included), on the held-out examples and hidden states its training
    cached in ``work_dir``."""
    import torch
    from safetensors.torch import load_file

    from loadwise.drafter import train as T
    from loadwise.drafter.data import read_examples
    from loadwise.drafter.head import load_head
    from loadwise.drafter.target import hidden_states

    meta = read_meta(head_dir) or {}
    cfg = meta.get("config") or {}
    try:
        model, data, held = str(cfg["model"]), str(cfg["data"]), int(cfg["held_out"])
        steps, batch_tokens = int(cfg["num_steps"]), int(cfg["batch_tokens"])
        aux = tuple(int(i) for i in cfg.get("aux_layers") or ())
    except (KeyError, TypeError, ValueError) as exc:
        raise DrafterDataError(f"{head_dir}: no usable training record ({exc})") from exc
    examples = read_examples(work_dir / f"examples-{data}.jsonl")[:held]
    if len(examples) < held:
        raise DrafterDataError(f"{work_dir} holds {len(examples)} examples, the head held out "
                               f"{held}")
    tail = "-aux" + "-".join(map(str, aux)) if aux else ""
    hidden = hidden_states(None, examples, work_dir / f"hidden-{data}{tail}", lambda n: None,
                           aux)
    target_cfg = json.loads((Path(model) / "config.json").read_text())
    embed = load_file(str(next(Path(model).glob("*.safetensors"))))["model.embed_tokens.weight"]
    head = load_head(head_dir, target_cfg, embed)
    with torch.no_grad():
        return T.evaluate_head(head, examples, hidden, steps, batch_tokens)
