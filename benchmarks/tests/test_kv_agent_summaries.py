"""The agent benchmark's summaries: read-back share (sum of min(cached, reusable) over the sum of
reusable), the chats every configuration sent, greedy identity against vLLM alone, the trace of
what was sent."""

from __future__ import annotations

from kv_agent import Req, common_chats, identity, summarize, trace_lines


def req(config: str, kind: str, sid: str, turn: int, cached: int, reusable: int, ttft: float,
        out: list[int] | None = None, level: int = 4) -> Req:
    r = Req(session=0, turn=turn, phase="load", kind=kind, sid=sid, level=level, config=config)
    r.cached_tokens, r.reusable_tokens, r.ttft_s = cached, reusable, ttft
    r.prompt_tokens = 1000
    r.prompt_ids = [1, 2, 3, turn]
    r.output_ids = out if out is not None else [7, 8]
    r.sent_at_s = 100.0 + turn
    return r


def test_read_back_counts_what_was_not_computed_up_to_the_reusable_prefix() -> None:
    reqs = [req("flat", "agent", "a", 0, 0, 0, 1.0), req("flat", "agent", "a", 1, 900, 768, 0.5),
            req("flat", "agent", "a", 2, 256, 1024, 0.7), req("flat", "chat", "c", 0, 0, 0, 0.2)]
    s = summarize(reqs)
    # cached beyond the reusable prefix (vLLM's own cache held more) counts as the prefix only
    assert s["agent"]["read_back_of_reusable"] == (768 + 256) / (768 + 1024)
    assert s["agent"]["prefill_tokens_computed"] == 3000 - 1156
    assert s["agent_later_steps"]["requests"] == 2 and s["chat"]["read_back_of_reusable"] is None
    assert s["agent"]["ttft_p50_s"] == 0.7


def test_chats_are_compared_on_what_every_configuration_sent() -> None:
    reqs = [req("none", "chat", "c1", 0, 0, 0, 3.0), req("none", "chat", "c2", 0, 0, 0, 5.0),
            req("flat", "chat", "c1", 0, 0, 0, 1.0)]
    got = common_chats(reqs)
    assert got["none@4"] == {"requests": 1, "ttft_p50_s": 3.0, "ttft_p90_s": 3.0}
    assert got["flat@4"]["requests"] == 1


def test_identity_is_against_vllm_alone_on_equal_prompts() -> None:
    reqs = [req("none", "agent", "a", 1, 0, 0, 1.0, [5, 6]),
            req("flat", "agent", "a", 1, 0, 0, 1.0, [5, 6]),
            req("tiered", "agent", "a", 1, 0, 0, 1.0, [5, 9])]
    assert identity(reqs) == {"flat@4": {"same_prompt": 1, "identical": 1},
                              "tiered@4": {"same_prompt": 1, "identical": 0}}


def test_the_trace_of_what_was_sent_hashes_real_token_ids() -> None:
    reqs = [req("flat", "agent", "a", k, 0, 0, 1.0) for k in range(2)]
    reqs[1].prompt_ids = [1] * 600 + [2] * 100
    reqs[0].prompt_ids = [1] * 600
    lines = trace_lines(reqs, (1, 1))
    assert [x["timestamp"] for x in lines] == [0, 1000]
    assert lines[1]["hash_ids"][0] == lines[0]["hash_ids"][0] and len(lines[1]["hash_ids"]) == 2
    assert lines[0]["kind"] == "agent" and lines[0]["tool_messages"] == 599
