"""tools/stream_trace.py: per-stream numbers from a Chrome trace's GPU events (a synthetic trace,
so the arithmetic is checked on CPU), and its refusals."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from mutwo.tools.stream_trace import intersection, merge, summarize, trace_iterations


def _event(cat: str, name: str, start: float, end: float, stream: int, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": start, "dur": end - start, "args": {"stream": stream, **args}}


# One iteration (microseconds): a convolution alone, the same convolution while a 1 MB copy out
# runs on stream 13 (20% slower), then a relu after the copy; a CPU op that must be ignored.
EVENTS = [
    _event("kernel", "conv", 0, 10, 7),
    _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 18, 40, 13, bytes=1_000_000),
    _event("kernel", "conv", 20, 32, 7),
    _event("kernel", "relu", 40, 45, 7),
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},
]


def test_intervals_merge_and_intersect() -> None:
    assert merge([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert intersection([(0, 3), (5, 8)], [(2, 6)]) == [(2, 3), (5, 6)]


def test_a_trace_is_summarised_per_stream_and_per_iteration() -> None:
    summary = summarize(EVENTS, iterations=1)
    assert summary["compute_stream"] == "7"
    assert summary["window_ms"] == pytest.approx(0.045)
    assert summary["compute_busy_ms"] == pytest.approx(0.027) and summary["compute_idle_ms"] == pytest.approx(0.018)
    assert summary["compute_busy_during_copies_ms"] == pytest.approx(0.012)
    assert summary["copy_busy_ms"] == pytest.approx(0.022)
    assert summary["compute_idle_during_copies_ms"] == pytest.approx(0.010)  # 18-20 and 32-40
    assert summary["kernel_slowdown_during_copies"] == pytest.approx(1.2)  # relu never ran beside a copy
    copy_stream = summary["streams"]["13"]
    assert copy_stream["d2h_bytes"] == 1_000_000 and copy_stream["d2h_gb_per_s"] == pytest.approx(45.45, abs=0.01)
    assert summary["streams"]["7"] == {"busy_ms": pytest.approx(0.027), "kernels": 3, "copies": 0}
    halved = summarize(EVENTS + [{**e, "ts": e["ts"] + 100} for e in EVENTS[:4]], iterations=2)
    assert halved["compute_busy_ms"] == pytest.approx(0.027) and halved["streams"]["7"]["kernels"] == 3


def test_refusals() -> None:
    with pytest.raises(ValueError, match="no GPU events"):
        summarize(EVENTS[-1:], iterations=1)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        trace_iterations(lambda: None, torch.device("cpu"), Path("unused.json.gz"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_compare_refuses_trace_without_a_gpu(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    from tests.test_bench_compare import compare

    monkeypatch.setattr(sys, "argv", ["compare.py", "--trace", "--models", "tiny:4", "--variants", "eager"])
    with pytest.raises(SystemExit) as exited:
        compare.main()
    assert exited.value.code == 2 and "--trace profiles CUDA streams and needs a GPU" in capsys.readouterr().err


@pytest.mark.cuda
def test_a_gpu_step_is_traced(tmp_path: Path) -> None:
    x = torch.randn(1024, 1024, device="cuda")
    host = torch.empty(1024, 1024, pin_memory=True)
    side = torch.cuda.Stream()

    def step() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            host.copy_(x, non_blocking=True)
        for _ in range(20):
            torch.mm(x, x)
        torch.cuda.current_stream().wait_stream(side)

    summary = trace_iterations(step, torch.device("cuda"), tmp_path / "t.json.gz", iterations=2)
    assert (tmp_path / "t.json.gz").stat().st_size > 0
    assert summary["compute_busy_ms"] > 0 and summary["copy_busy_ms"] > 0
    assert any(s.get("d2h_bytes") == 4 * 1024 * 1024 for s in summary["streams"].values())
