"""Training an EAGLE head: draft vocabulary, batches, the unrolled loss, resumable state.

The loss at draft step s and slot t is the cross-entropy of the head's step-s output against
token t + s + 1, counted only where drafting can happen (token t + 1 is part of the answer, so
the target produced it) and the label is in the draft vocabulary (no other can be drafted).
Later steps weigh less (DECAY per step): a step only pays when every step before it was right.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from loadwise.drafter.data import Example
from loadwise.drafter.head import EagleHead

DECAY = 0.8
WARMUP_BATCHES = 20


@dataclass(frozen=True, slots=True)
class Batch:
    tokens: torch.Tensor  # [B, L] int64, padded with 0
    hidden: torch.Tensor  # [B, L, H] float32
    key_mask: torch.Tensor  # [B, L] bool
    answer_start: torch.Tensor  # [B] int64: index of the first answer token
    lengths: torch.Tensor  # [B] int64


def select_vocab(examples: Sequence[Example], size: int, always: Sequence[int],
                 vocab_size: int) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent answer tokens (plus ``always``), sorted; and the share of
    answer tokens they cover."""
    counts: Counter[int] = Counter()
    for ex in examples:
        counts.update(ex.answer_ids)
    chosen = set(always)
    for tok, _ in counts.most_common():
        if len(chosen) >= size:
            break
        chosen.add(tok)
    for tok in range(vocab_size):  # fewer distinct tokens than asked: pad with low ids
        if len(chosen) >= size:
            break
        chosen.add(tok)
    total = sum(counts.values())
    covered = sum(n for t, n in counts.items() if t in chosen)
    return torch.tensor(sorted(chosen), dtype=torch.long), covered / max(total, 1)


def make_batches(examples: Sequence[Example], batch_tokens: int, seed: int) -> list[list[int]]:
    """Example indices grouped by similar length so that padded size stays <= batch_tokens
    (one example per batch if it alone is longer), in a seeded order."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].token_ids))
    groups: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        n = len(examples[i].token_ids)
        if cur and n * (len(cur) + 1) > batch_tokens:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    random.Random(seed).shuffle(groups)
    return groups


def collate(examples: Sequence[Example], hidden: Sequence[torch.Tensor],
            idx: Sequence[int]) -> Batch:
    lengths = [len(examples[i].token_ids) for i in idx]
    length = max(lengths)
    b = len(idx)
    tokens = torch.zeros(b, length, dtype=torch.long)
    hid = torch.zeros(b, length, hidden[idx[0]].shape[-1])
    mask = torch.zeros(b, length, dtype=torch.bool)
    for row, i in enumerate(idx):
        n = lengths[row]
        tokens[row, :n] = torch.tensor(examples[i].token_ids)
        hid[row, :n] = hidden[i].to(torch.float32)
        mask[row, :n] = True
    starts = torch.tensor([len(examples[i].prompt_ids) for i in idx])
    return Batch(tokens, hid, mask, starts, torch.tensor(lengths))


def drafted_slots(batch: Batch, step: int) -> torch.Tensor:
    """[B, L] bool: slots where an engine drafts and draft step ``step`` has a label (token
    t + 1 is an answer token, token t + step + 1 exists), in the draft vocabulary or not."""
    b, length = batch.tokens.shape
    slots = torch.arange(length)[None, :]
    in_range = (slots + step + 1).expand(b, length) < batch.lengths[:, None]
    return in_range & (slots + 1 >= batch.answer_start[:, None])


def step_targets(batch: Batch, step: int, to_draft: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid [B, L] bool, draft-vocabulary label [B, L]) for draft step ``step``: valid where
    :func:`drafted_slots` is and the label is in the draft vocabulary."""
    b, length = batch.tokens.shape
    label_pos = (torch.arange(length)[None, :] + step + 1).expand(b, length)
    labels = torch.gather(batch.tokens, 1, label_pos.clamp(max=length - 1))
    mapped = to_draft[labels]
    valid = drafted_slots(batch, step) & (mapped >= 0)
    return valid, mapped.clamp(min=0)


def batch_loss(head: EagleHead, batch: Batch, num_steps: int, to_draft: torch.Tensor
               ) -> tuple[torch.Tensor, list[tuple[int, int, int]], torch.Tensor, torch.Tensor]:
    """(weighted loss, per step (right, counted in the draft vocabulary, drafted), chain
    length per slot whose first label is in the draft vocabulary, chain length per drafted
    slot) for one batch.

    The chain length at a slot counts the steps right in a row from step 1: the drafts greedy
    verification would accept there. A label outside the draft vocabulary can never be
    drafted, so it ends the chain; over every drafted slot (:func:`drafted_slots`) the mean
    chain is what an engine's drafting step at those slots accepts, whatever the vocabulary's
    size."""
    outs = head.unrolled(batch.tokens, batch.hidden, batch.key_mask, num_steps)
    total = torch.zeros(())
    stats: list[tuple[int, int, int]] = []
    first_valid, _ = step_targets(batch, 1, to_draft)
    alive = first_valid.clone()
    chain = torch.zeros(batch.tokens.shape, dtype=torch.long)
    for s, normed in enumerate(outs, start=1):
        valid, labels = step_targets(batch, s, to_draft)
        drafted = int(drafted_slots(batch, s).sum())
        if not bool(valid.any()):
            stats.append((0, 0, drafted))
            alive &= valid
            continue
        logits = head.lm_head(normed[valid])
        total = total + DECAY ** (s - 1) * F.cross_entropy(logits, labels[valid])
        right = torch.zeros_like(valid)
        right[valid] = logits.argmax(-1) == labels[valid]
        stats.append((int(right.sum()), int(valid.sum()), drafted))
        alive &= right
        chain += alive.long()
    return total, stats, chain[first_valid], chain[drafted_slots(batch, 1)]


@dataclass(slots=True)
class Progress:
    """What the training loop reports after each batch."""

    epoch: int
    batch: int
    num_batches: int
    loss: float
    lr: float


@dataclass(slots=True)
class TrainState:
    epoch: int = 0
    batch: int = 0
    elapsed_s: float = 0.0


def lr_at(i: int, total: int, peak: float) -> float:
    if i < WARMUP_BATCHES:
        return peak * (i + 1) / WARMUP_BATCHES
    frac = (i - WARMUP_BATCHES) / max(total - WARMUP_BATCHES, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def train_loop(head: EagleHead, examples: Sequence[Example], hidden: Sequence[torch.Tensor],
               *, epochs: int, batch_tokens: int, lr: float, num_steps: int, seed: int,
               state: TrainState, optimizer: torch.optim.Optimizer,
               save: Callable[[TrainState], None], save_every_s: float,
               on_batch: Callable[[Progress], None]) -> TrainState:
    """Run (or resume at ``state``) the epochs; ``save`` is called every ``save_every_s``
    and at each epoch's end with the position to resume from."""
    to_draft = draft_index(head)
    last_save = time.perf_counter()
    t0 = time.perf_counter() - state.elapsed_s
    for epoch in range(state.epoch, epochs):
        groups = make_batches(examples, batch_tokens, seed + epoch)
        total = len(groups) * epochs
        for bi in range(state.batch if epoch == state.epoch else 0, len(groups)):
            i = epoch * len(groups) + bi
            cur_lr = lr_at(i, total, lr)
            for g in optimizer.param_groups:
                g["lr"] = cur_lr
            loss, _, _, _ = batch_loss(head, collate(examples, hidden, groups[bi]), num_steps,
                                    to_draft)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            state.epoch, state.batch = epoch, bi + 1
            state.elapsed_s = time.perf_counter() - t0
            on_batch(Progress(epoch, bi + 1, len(groups), float(loss.detach()), cur_lr))
            if time.perf_counter() - last_save >= save_every_s:
                save(state)
                last_save = time.perf_counter()
        state.epoch, state.batch = epoch + 1, 0
        save(state)
        last_save = time.perf_counter()
    return state


def draft_index(head: EagleHead) -> torch.Tensor:
    """Target id -> draft id (-1 outside the draft vocabulary)."""
    to_draft = torch.full((head.shape.vocab_size,), -1, dtype=torch.long)
    to_draft[head.draft_ids] = torch.arange(len(head.draft_ids))
    return to_draft


@torch.no_grad()
def evaluate_head(head: EagleHead, examples: Sequence[Example], hidden: Sequence[torch.Tensor],
                  num_steps: int, batch_tokens: int) -> dict[str, Any]:
    """Held-out, teacher-forced: top-1 accuracy per draft step and the mean chain length
    (drafts greedy verification would accept per drafting step, of ``num_steps``), each two
    ways: over labels in the draft vocabulary only (``step_accuracy``,
    ``mean_accepted_per_draft_step``: slots whose first label is in it), and over every label,
    one outside the vocabulary a miss (``*_every_label``, ``mean_accepted_per_drafted_slot``:
    what an engine drafting at those slots accepts; the figures to compare heads with
    vocabularies of other sizes by). ``held_out_vocab_coverage``: the share of step-1 labels in
    the draft vocabulary."""
    to_draft = draft_index(head)
    right = [0] * num_steps
    counted = [0] * num_steps
    drafted = [0] * num_steps
    chains: list[torch.Tensor] = []
    every: list[torch.Tensor] = []
    for idx in make_batches(examples, batch_tokens, seed=0):
        _, stats, chain, chain_every = batch_loss(head, collate(examples, hidden, idx),
                                                  num_steps, to_draft)
        for s, (r, c, d) in enumerate(stats):
            right[s] += r
            counted[s] += c
            drafted[s] += d
        chains.append(chain)
        every.append(chain_every)

    def mean(parts: list[torch.Tensor]) -> float | None:
        joined = torch.cat(parts) if parts else torch.zeros(0)
        return float(joined.float().mean()) if len(joined) else None

    return {"step_accuracy": [r / c if c else None for r, c in zip(right, counted)],
            "step_counted": counted,
            "mean_accepted_per_draft_step": mean(chains),
            "num_slots": sum(len(c) for c in chains),
            "step_accuracy_every_label": [r / d if d else None for r, d in zip(right, drafted)],
            "step_drafted": drafted,
            "mean_accepted_per_drafted_slot": mean(every),
            "held_out_vocab_coverage": counted[0] / drafted[0] if drafted and drafted[0]
            else None}

