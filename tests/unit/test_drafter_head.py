"""The EAGLE head's training arithmetic against step-by-step drafting with a KV cache, its
checkpoint layout, and the pieces of the training loop."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from loadwise.config.engine import EngineSpec, eagle_method
from loadwise.drafter import train as T
from loadwise.drafter.data import Example, read_examples
from loadwise.drafter.head import EagleHead, HeadShape, head_config, save_head
from loadwise.errors import EngineConfigError

SHAPE = HeadShape(hidden_size=16, intermediate_size=24, num_heads=4, num_kv_heads=2, head_dim=4,
                  rms_eps=1e-5, rope_theta=10000.0, vocab_size=40)


def make_head(seed: int = 0, draft_ids=None, aux_layers: tuple[int, ...] = ()) -> EagleHead:
    torch.manual_seed(seed)
    ids = torch.arange(0, 40, 2) if draft_ids is None else draft_ids
    head = EagleHead(SHAPE, ids, torch.randn(40, 16), aux_layers)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return head


def drafted_step_by_step(head: EagleHead, tokens: torch.Tensor, hidden: torch.Tensor,
                         slot: int, num_steps: int) -> list[torch.Tensor]:
    """What a drafting engine computes at ``slot``: positions 0..slot from the target's hidden
    states into the KV cache, then each further step one query over the cache plus its own
    earlier draft keys."""
    s = head.shape
    group = s.num_heads // s.num_kv_heads
    hidden = head.combine(hidden)  # what vLLM's combine_hidden_states hands the first step
    pos = torch.arange(slot + 1)
    q, k, v = head._qkv(tokens[1:slot + 2], hidden[:slot + 1], pos)
    keys, values = [k], [v]
    h_in = hidden[slot:slot + 1]
    outs = []
    q_last = q[slot:slot + 1]
    for step in range(1, num_steps + 1):
        if step > 1:
            p = torch.tensor([slot + step - 1])
            q_last, k_new, v_new = head._qkv(tokens[slot + step:slot + step + 1], h_in, p)
            keys.append(k_new)
            values.append(v_new)
        kk = torch.cat(keys).repeat_interleave(group, dim=1)  # [n, heads, d]
        vv = torch.cat(values).repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q_last[0], kk) / s.head_dim ** 0.5
        attn = torch.einsum("hn,nhd->hd", torch.softmax(scores, -1), vv)
        prenorm, normed = head._rest(attn[None], h_in)
        outs.append(normed[0])
        h_in = prenorm
    return outs


@pytest.mark.parametrize("aux_layers", [(), (2, 5, 7)])
def test_unrolled_training_equals_drafting_with_a_kv_cache(aux_layers) -> None:
    head = make_head(aux_layers=aux_layers)
    torch.manual_seed(1)
    length = 9
    tokens = torch.randint(0, 40, (2, length))
    hidden = torch.randn(2, length, 16 * max(len(aux_layers), 1))
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[1, 7:] = False  # a padded row: padding must not leak into real slots
    outs = head.unrolled(tokens, hidden, mask, num_steps=3)
    for row, n in ((0, length), (1, 7)):
        for slot in range(n - 3):
            want = drafted_step_by_step(head, tokens[row, :n], hidden[row, :n], slot, 3)
            for step in range(3):
                torch.testing.assert_close(outs[step][row, slot], want[step], atol=1e-5,
                                           rtol=1e-5)


def test_select_vocab_takes_the_most_frequent_answer_tokens() -> None:
    ex = [Example((1, 2, 3), (5, 5, 5, 6, 6, 7)), Example((9,), (5, 8))]
    ids, coverage = T.select_vocab(ex, 3, always=[2], vocab_size=40)
    assert ids.tolist() == [2, 5, 6]
    assert coverage == pytest.approx(6 / 8)
    ids, coverage = T.select_vocab(ex, 7, always=[2], vocab_size=40)
    assert len(ids) == 7 and coverage == 1.0 and {5, 6, 7, 8} <= set(ids.tolist())


def test_step_targets_count_only_slots_where_drafting_happens() -> None:
    ex = [Example((1, 2, 3), (4, 6, 8, 10))]
    batch = T.collate(ex, [torch.zeros(7, 16)], [0])
    head = make_head()
    to_draft = T.draft_index(head)  # even ids only
    valid, labels = T.step_targets(batch, 1, to_draft)
    # Slot t predicts token t + 2; drafting starts once token t + 1 is an answer token (t >= 2).
    assert valid[0].tolist() == [False, False, True, True, True, False, False]
    assert labels[0, 2].item() == to_draft[6].item()
    valid3, _ = T.step_targets(batch, 3, to_draft)
    assert valid3[0].tolist() == [False, False, True, False, False, False, False]
    odd = [Example((1, 2, 3), (5, 7, 9, 11))]
    v, _ = T.step_targets(T.collate(odd, [torch.zeros(7, 16)], [0]), 1, to_draft)
    assert not v.any()  # labels outside the draft vocabulary can never be drafted


def test_held_out_figures_over_every_label_count_tokens_outside_the_vocabulary_as_misses(
) -> None:
    torch.manual_seed(3)
    # Answers mixing even (in the draft vocabulary) and odd (outside it) tokens.
    examples = [Example((1, 2, 3), tuple(int(t) for t in torch.randint(0, 40, (n,))))
                for n in (6, 9, 4)]
    hidden = [torch.randn(len(e.token_ids), 16) for e in examples]
    head = make_head()
    held = T.evaluate_head(head, examples, hidden, num_steps=3, batch_tokens=64)
    for s in range(1, 4):
        # Slot t drafts once token t + 1 is an answer token; step s's label is token t + s + 1.
        labels = [e.token_ids[t + s + 1] for e in examples
                  for t in range(len(e.prompt_ids) - 1, len(e.token_ids) - s - 1)]
        assert held["step_drafted"][s - 1] == len(labels)
        assert held["step_counted"][s - 1] == sum(t % 2 == 0 for t in labels)
        every, in_vocab = held["step_accuracy_every_label"][s - 1], held["step_accuracy"][s - 1]
        if in_vocab is not None:
            assert every == pytest.approx(in_vocab * held["step_counted"][s - 1]
                                          / held["step_drafted"][s - 1])
    assert held["held_out_vocab_coverage"] == pytest.approx(
        held["step_counted"][0] / held["step_drafted"][0])
    assert held["held_out_vocab_coverage"] < 1
    # The same accepted drafts, over more slots: those whose first label cannot be drafted
    # accept nothing.
    assert held["mean_accepted_per_drafted_slot"] * held["step_drafted"][0] == pytest.approx(
        held["mean_accepted_per_draft_step"] * held["num_slots"])


def test_checkpoint_has_vllms_eagle3_names_and_maps_draft_ids(tmp_path) -> None:
    from safetensors.torch import load_file

    ids = torch.tensor([0, 3, 4, 9, 17])
    head = make_head(draft_ids=ids)
    target_cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 16, "vocab_size": 40,
                  "num_hidden_layers": 30, "_name": "x"}
    save_head(head, target_cfg, tmp_path, {"kind": "test"})
    sd = load_file(str(tmp_path / "model.safetensors"))
    assert (sd["d2t"] + torch.arange(5)).tolist() == ids.tolist()
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (16, 32)  # [embedding; hidden] in
    assert sd["lm_head.weight"].shape == (5, 16)
    assert "embed_tokens.weight" not in " ".join(sd)  # vLLM shares the target's
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg == head_config(target_cfg, 5)
    assert cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == 5
    assert cfg["eagle_config"] == {"use_aux_hidden_state": False} and "_name" not in cfg
    assert eagle_method(str(tmp_path)) == "eagle3"


def test_eagle_spec_needs_a_head_and_renders_vllms_method(tmp_path, model_stub) -> None:
    with pytest.raises(EngineConfigError, match="--draft-model"):
        EngineSpec(model=str(model_stub), spec_method="eagle")
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    spec = EngineSpec(model=str(model_stub), spec_method="eagle", draft_model=str(head), max_k=3)
    cfg = spec.speculative_config()
    assert cfg is not None and cfg["method"] == "eagle" and cfg["model"] == str(head)
    (head / "config.json").write_text(json.dumps({"draft_vocab_size": 8}))
    assert spec.speculative_config()["method"] == "eagle3"  # type: ignore[index]


def test_training_resumed_from_its_state_ends_where_an_unbroken_run_ends() -> None:
    torch.manual_seed(5)
    ex = [Example(tuple(torch.randint(0, 40, (4,)).tolist()),
                  tuple(torch.randint(0, 40, (6,)).tolist())) for _ in range(6)]
    hid = [torch.randn(10, 16) for _ in ex]

    class Killed(Exception):
        pass

    def run(head: EagleHead, opt: torch.optim.Optimizer, state: T.TrainState,
            save=lambda st: None) -> T.TrainState:
        return T.train_loop(head, ex, hid, epochs=2, batch_tokens=20, lr=1e-2, num_steps=2,
                            seed=0, state=state, optimizer=opt, save=save, save_every_s=0.0,
                            on_batch=lambda p: None)

    whole = make_head()
    run(whole, torch.optim.AdamW(whole.parameters()), T.TrainState())

    first = make_head()
    opt = torch.optim.AdamW(first.parameters())
    saves: list[dict] = []

    def save_then_die(st: T.TrainState) -> None:
        saves.append(copy.deepcopy({"head": first.state_dict(), "opt": opt.state_dict(),
                                    "state": st}))
        if len(saves) == 2:  # killed right after its second save, mid-way through epoch 1
            raise Killed

    with pytest.raises(Killed):
        run(first, opt, T.TrainState(), save_then_die)
    saved = saves[-1]
    assert (saved["state"].epoch, saved["state"].batch) == (0, 2)
    resumed = make_head()  # the same target embedding; trained weights from the state only
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)
    resumed.load_state_dict(saved["head"])
    opt2 = torch.optim.AdamW(resumed.parameters())
    opt2.load_state_dict(saved["opt"])
    run(resumed, opt2, saved["state"])
    for a, b in zip(whole.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b)


def test_a_torn_examples_file_keeps_its_complete_lines(tmp_path) -> None:
    path = tmp_path / "ex.jsonl"
    path.write_text(json.dumps(Example((1,), (2, 3)).to_json()) + "\n" + '{"prompt_ids": [4')
    assert read_examples(path) == [Example((1,), (2, 3))]


@pytest.mark.parametrize("aux_layers", [(), (2, 5, 7)])
def test_a_saved_head_loads_back_with_the_same_weights(tmp_path, aux_layers) -> None:
    from loadwise.drafter.head import load_head

    head = make_head(draft_ids=torch.tensor([1, 2, 30]), aux_layers=aux_layers)
    save_head(head, {"hidden_size": 16}, tmp_path, {})
    back = load_head(tmp_path, {"hidden_size": 16, "intermediate_size": 24,
                                "num_attention_heads": 4, "num_key_value_heads": 2,
                                "head_dim": 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                                "vocab_size": 40}, head.embed)
    assert back.draft_ids.tolist() == [1, 2, 30] and back.aux_layers == aux_layers
    assert [n for n, _ in head.named_parameters()] == [n for n, _ in back.named_parameters()]
    for (name, a), (_, b) in zip(head.named_parameters(), back.named_parameters()):
        torch.testing.assert_close(a, b, msg=name)


def test_an_aux_layer_head_writes_vllms_fc_and_per_layer_norms(tmp_path) -> None:
    from safetensors.torch import load_file

    head = make_head(aux_layers=(2, 15, 27))
    target_cfg = {"hidden_size": 16, "vocab_size": 40, "num_hidden_layers": 30}
    save_head(head, target_cfg, tmp_path, {})
    sd = load_file(str(tmp_path / "model.safetensors"))
    assert sd["fc.weight"].shape == (16, 48)  # three layers side by side into the hidden size
    assert [sd[f"fc_norm.{i}.weight"].shape for i in range(3)] == [(16,)] * 3
    assert "fc_norm.3.weight" not in sd
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["eagle_config"] == {"use_aux_hidden_state": True,
                                   "eagle_aux_hidden_state_layer_ids": [2, 15, 27]}
    assert cfg["fc_norm"] is True


def test_aux_layer_chunks_are_normed_apart_and_start_as_the_deepest_one() -> None:
    from loadwise.drafter.head import default_aux_layers

    assert default_aux_layers(30) == (2, 15, 27)
    head = EagleHead(SHAPE, torch.arange(0, 40, 2), torch.randn(40, 16), (1, 2))
    target = {f"model.layers.0.{n}": torch.randn(*shape) for n, shape in (
        ("self_attn.q_proj.weight", (16, 16)), ("self_attn.k_proj.weight", (8, 16)),
        ("self_attn.v_proj.weight", (8, 16)), ("mlp.gate_proj.weight", (24, 16)),
        ("mlp.up_proj.weight", (24, 16)), ("post_attention_layernorm.weight", (16,)),
        ("input_layernorm.weight", (16,)))}
    target["model.embed_tokens.weight"] = torch.randn(40, 16)
    head.init_from_target(target, 0)
    big, deepest = 1e4 * torch.randn(3, 16), torch.randn(3, 16)
    out = head.combine(torch.cat((big, deepest), dim=-1))
    # A chunk far larger than another does not drown it: each chunk is normed on its own, and
    # the starting fc passes the deepest layer through.
    want = deepest * torch.rsqrt(deepest.pow(2).mean(-1, keepdim=True) + SHAPE.rms_eps)
    torch.testing.assert_close(out, want)


def test_aux_layers_are_checked_against_the_model_and_keep_old_states_resumable(
        model_stub) -> None:
    from loadwise.drafter.data import DrafterDataError
    from loadwise.drafter.run import DrafterConfig

    (model_stub / "config.json").write_text(json.dumps({"num_hidden_layers": 30}))
    plain = DrafterConfig(model=str(model_stub), out_dir="h")
    with pytest.raises(DrafterDataError, match="has 30 layers, so layer ids must be below 30"):
        DrafterConfig(model=str(model_stub), out_dir="h", aux_layers=(2, 30))
    with pytest.raises(DrafterDataError, match="distinct layer ids >= 1"):
        DrafterConfig(model=str(model_stub), out_dir="h", aux_layers=(2, 2))
    aux = DrafterConfig(model=str(model_stub), out_dir="h", aux_layers=(2, 15, 27))
    # A head on the last hidden state resumes the training states written before aux layers
    # existed; an aux head trains its own, on its own cached states, from the same examples.
    assert "aux_layers" not in plain.fingerprint() and plain.hidden_dir() == "hidden-self"
    assert aux.state_name() != plain.state_name()
    assert aux.hidden_dir() == "hidden-self-aux2-15-27"
    assert aux.data_fingerprint() == plain.data_fingerprint()
