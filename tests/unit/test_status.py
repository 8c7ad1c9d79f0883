"""`loadwise status` against a real HTTP /metrics page: warming up is said, not shown as zeros."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loadwise.cli import main
from loadwise.config import env as envvars

COMMON = """# TYPE loadwise_draft_k gauge
loadwise_draft_k{start_bs="1",end_bs="32"} 4.0
loadwise_draft_rate 0.0
loadwise_predicted_goodput_tok_s 0.0
loadwise_table_changes 0.0
loadwise_adaptive_up 1.0
vllm:spec_decode_num_drafts_total 40.0
vllm:spec_decode_num_draft_tokens_total 160.0
vllm:spec_decode_num_accepted_tokens_total 80.0
"""


@pytest.fixture
def metrics_server() -> Iterator[tuple[str, list[str]]]:
    page = [""]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = page[0].encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", page
    server.shutdown()


def test_status_says_warming_up_instead_of_zeros(metrics_server, capsys) -> None:
    url, page = metrics_server
    page[0] = COMMON + "loadwise_estimate_drafts 40.0\nloadwise_estimate_min_drafts 100.0\n"
    assert main(["status", "--url", url]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "controller warming up (40 of 100 drafts)" in out
    assert "draft rate" not in out and "predicted goodput" not in out
    assert "live table: [[1, 32, 4]]" in out and "40 drafts, 160 draft tokens, 80 accepted" in out


def test_status_shows_estimates_once_warm(metrics_server, capsys) -> None:
    url, page = metrics_server
    page[0] = (COMMON.replace("loadwise_draft_rate 0.0", "loadwise_draft_rate 0.4")
               + "loadwise_estimate_drafts 150.0\nloadwise_estimate_min_drafts 100.0\n")
    assert main(["status", "--url", url]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "warming up" not in out and "draft rate" in out and "0.4" in out


def test_status_shows_the_draft_gate_exported_from_its_state_file(
        metrics_server, capsys, tmp_path, monkeypatch) -> None:
    """The engine's gate writes its state; the API server's stat logger turns it into gauges;
    `loadwise status` reads them back from /metrics."""
    import prometheus_client

    from loadwise.gate.engine import EngineGate
    from loadwise.policy.acceptance import AcceptanceEstimator
    from loadwise.policy.gate import DraftGate
    from loadwise.vllm.metrics import LoadwiseStatLogger

    gate = DraftGate(AcceptanceEstimator.create(2), lambda b, x: 0.01, explore_every=0)
    for accepted in (2, 0, 1, 2, 0, 1):
        keep = gate.offer({"r": 2}, {"r": [0.2 + 0.3 * accepted, 0.5]})
        gate.verified([("r", keep["r"], min(accepted, keep["r"]))])
    state = tmp_path / "gate.json"
    EngineGate(gate, str(state)).write_state(status="on")
    monkeypatch.setenv(envvars.GATE_STATE_FILE.name, str(state))
    monkeypatch.delenv("LOADWISE_STATE_FILE", raising=False)
    LoadwiseStatLogger(None).refresh()
    url, page = metrics_server
    page[0] = prometheus_client.generate_latest().decode() + COMMON.split(
        "loadwise_adaptive_up 1.0\n")[1]
    assert main(["status", "--url", url]) == 0
    # Table borders dropped: "│ AUC pooled │ 0.833 │" reads "AUC pooled 0.833".
    out = " ".join(re.sub(r"[\u2500-\u257f]", " ", capsys.readouterr().out).split())
    snap = gate.snapshot()
    assert "draft gate: trimming" in out
    assert f"AUC pooled {snap.auc:.3f}" in out
    assert f"drafts scored {snap.offered_drafts}" in out
    assert f"drafts kept {snap.kept_drafts}" in out
    assert "calibration: predicted vs accepted" in out
