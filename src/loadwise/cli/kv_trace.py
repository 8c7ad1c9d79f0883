"""`loadwise kv agent-trace --out FILE`: the agent-session workload (``kvsim/agent.py``) as a
Mooncake-format trace for `loadwise kv replay`: every request's prompt tokenized with the
model's chat template and hashed into 512-token block ids, with its session id, its tool
messages (as the connector counts them) and its session's kind."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from loadwise.cli.common import console
from loadwise.errors import ConfigError


def add_parser(kv_sub: Any) -> None:
    at = kv_sub.add_parser("agent-trace", help="write the agent-session workload as a "
                           "Mooncake-format trace (JSONL) for `loadwise kv replay`")
    at.add_argument("--out", required=True, help="the JSONL file to write")
    at.add_argument("--agent-sessions", type=int, default=16, help="agent sessions at once")
    at.add_argument("--agent-sessions-total", type=int, default=None,
                    help="agent sessions in all (run in rounds; default: one round)")
    at.add_argument("--session-tokens", type=int, default=8192,
                    help="an agent session's context at most (estimated from characters)")
    at.add_argument("--think-s", type=float, default=2.0, help="mean tool/think time per step")
    at.add_argument("--step-s", type=float, default=2.0,
                    help="time from a step's request to the next one's, before think time")
    at.add_argument("--chat-rate", type=float, default=0.2, help="chats per second")
    at.add_argument("--shared-rate", type=float, default=0.2,
                    help="shared-system-prompt requests per second")
    at.add_argument("--kv-bytes-per-token", type=int, default=46_080,
                    help="for the printed session sizes only (default: SmolLM2's fp32 KV)")
    at.add_argument("--seed", type=int, default=0)
    at.set_defaults(func=cmd_agent_trace)


def cmd_agent_trace(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from loadwise.kvsim.agent import (
        AgentWorkloadConfig,
        BlockHasher,
        TraceRecord,
        generate,
        timeline,
    )
    from loadwise.kvsim.agent_corpus import load_corpus
    from loadwise.kvstore.connector.markers import (
        chat_token_ids,
        count_marker,
        tool_header_ids,
    )
    from loadwise.measure.workloads import sharegpt_chats
    from loadwise.model import prepare

    cfg = AgentWorkloadConfig(
        agent_sessions=args.agent_sessions, agent_sessions_total=args.agent_sessions_total,
        session_tokens=args.session_tokens, think_s=args.think_s, chat_rate_s=args.chat_rate,
        shared_rate_s=args.shared_rate, step_s_estimate=args.step_s, chars_per_token=3.0,
        seed=args.seed)
    out = Path(args.out)
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: directory {out.parent} does not exist")
    model = str(prepare().path)
    tok = AutoTokenizer.from_pretrained(model)
    header = tool_header_ids(model)
    corpus, info = load_corpus(tuple(c[0] for c in sharegpt_chats(400, 1, seed=args.seed)))
    wl = generate(corpus, cfg)
    hasher = BlockHasher(512)
    longest: dict[str, int] = {}
    lines: list[str] = []
    for req in timeline(wl, args.step_s, args.step_s):
        ids = chat_token_ids(tok, list(req.messages))
        longest[req.session_id] = max(longest.get(req.session_id, 0), len(ids))
        rec = TraceRecord(int(req.arrival_s * 1000), len(ids), req.output_tokens,
                          tuple(hasher.hash_ids(ids)), req.session_id,
                          count_marker(ids, header), "agent" if req.kind == "agent" else "chat")
        lines.append(json.dumps(rec.to_json()))
    out.write_text("\n".join(lines) + "\n")
    agents = [n for s, n in longest.items() if s.startswith("agent-")]
    gib = max(agents, default=0) * args.kv_bytes_per_token / (1 << 30)
    console.print(f"{len(lines)} requests, {len(agents)} agent sessions (longest "
                  f"{max(agents, default=0)} tokens: {gib:.2f} GiB of KV at "
                  f"{args.kv_bytes_per_token} bytes/token), {len(longest) - len(agents)} chat and "
                  f"shared sessions; corpus {info['source_files']} files of "
                  f"{', '.join(info['packages'])} → {out}")
    return 0
