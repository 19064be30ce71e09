"""bench/memory_trace.py, bench/stack_sampler.py and bench/collector_time.py on CPU: the sampler's
summary counts each frame's time inclusively, bad input to either script gives one line, exit code
1, nothing written, and the collector's time is counted by generation while entered only."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

from collector_time import CollectorTime  # noqa: E402
from stack_sampler import summarize  # noqa: E402


def _run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "bench" / script), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)  # fmt: skip


def test_the_summary_counts_a_frame_once_per_stack_it_is_on(tmp_path: Path) -> None:
    folded = tmp_path / "setup.folded"
    # main -> compile -> trace for 3 s, main -> compile for 1 s, main -> capture for 2 s (in microseconds)
    folded.write_text("m.py:main;b.py:compile;a.py:trace 3000000\nm.py:main;b.py:compile 1000000\n"
                      "m.py:main;c.py:capture 2000000\n")  # fmt: skip
    lines = summarize(folded).splitlines()[1:]
    seconds = {line.split()[-1]: float(line.split()[0]) for line in lines}
    assert seconds == {"m.py:main": 6.0, "b.py:compile": 4.0, "a.py:trace": 3.0, "c.py:capture": 2.0}
    assert lines[0].split()[1] == "100.0%" and lines[1].split()[1] == "66.7%"


def test_bad_input_is_one_line_and_exit_code_1(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    done = _run("memory_trace.py", "--config", str(REPO / "examples" / "tiny_mlp.yaml"), "--batch-size", "8",
                "--budget", "banana", "--device", "cpu", "--out", str(out), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 1 and not out.exists()
    assert done.stderr.strip() == ("memory_trace: budget 'banana' is neither a fraction like 0.5, bytes like '6GiB', "
                                   "nor 'min'")
    done = _run("stack_sampler.py", str(tmp_path / "missing.folded"), cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.strip().count("\n") == 0 and "no folded stack file" in done.stderr


def test_the_collector_s_time_is_counted_while_entered_only() -> None:
    with CollectorTime() as collector:
        gc.collect()
        gc.collect(0)
    summary = collector.summary()
    gc.collect()  # after: not counted
    assert collector.summary() == summary
    young, _, full = summary["collections"]  # the two asked for (and any the interpreter ran meanwhile)
    assert young >= 1 and full >= 1 and len(summary["full_at"]) == full
    assert summary["seconds"] >= summary["full_seconds"] >= 0 and summary["full_at"][0][0] >= 0
    assert collector._note not in gc.callbacks
