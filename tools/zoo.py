"""Sweep the model zoo: capture each model's training iteration, rewrite it, check it bitwise.

    python -m mutwo.tools.zoo [--ci] [--only NAME,...] [--passes P] [--device cpu|cuda] [-o results.json]
                              [--markdown docs/zoo.md]
    python -m mutwo.tools.zoo --render results.json --markdown docs/zoo.md

Each model (``mutwo.tools.zoo_models``) goes through capture, the pipeline (default
``profile,select{budget=min},rewrite``) and the equivalence check over 3 iterations (bitwise on
CPU). A model mutwo cannot support must be refused with one sentence: the sweep records it, and
``expect`` in the zoo says which sentence is the right one. Exit code 0 when every model met its
expectation, 1 otherwise, 2 for bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mutwo.ir.memory import simulate
from mutwo.ir.pass_base import write_atomic
from mutwo.ir.pass_manager import PipelineFailure
from mutwo.runtime.api import optimize_graph
from mutwo.runtime.capture.tracing import CaptureError
from mutwo.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, Parser, UsageError
from mutwo.tools.workloads import to_device
from mutwo.tools.zoo_models import MAX_PARAMETERS, ZooModel, zoo

DEFAULT_PASSES = "profile{runs=1,warmup=0},select{budget=min},rewrite"
RESULTS = "bench/results/zoo_cpu.json"  #: the committed sweep that docs/zoo.md shows
MIB = 2**20


@dataclass
class ZooResult:
    """What happened to one model. ``status``: ``ok`` (captured, rewritten, bitwise equal),
    ``refused`` (mutwo said why in one sentence), ``skipped`` (too large for a CPU sweep),
    ``not-equivalent``, ``failed`` (a pass failed) or ``crashed`` (any other exception: a bug)."""

    name: str
    family: str
    status: str
    reason: str = ""
    parameters: int = 0
    nodes: int = 0
    peak_before: int = 0
    peak_after: int = 0
    recomputed: int = 0
    seconds: float = 0.0
    expected: bool = False

    @property
    def reduction(self) -> float | None:
        return 1 - self.peak_after / self.peak_before if self.peak_before else None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def run_model(entry: ZooModel, passes: str = DEFAULT_PASSES, device: str = "cpu") -> ZooResult:
    """Build, capture, rewrite and check one model on ``device``; every outcome is a result, never
    an exception (the check is bitwise on CPU, with deterministic kernels on CUDA)."""
    started = time.perf_counter()
    torch.manual_seed(0)
    model, batch, loss_fn = entry.build()
    model, batch = model.to(device), to_device(batch, torch.device(device))
    result = ZooResult(entry.name, entry.family, "ok", parameters=sum(p.numel() for p in model.parameters()))
    if result.parameters > MAX_PARAMETERS:
        result.status = "skipped"
        result.reason = f"{result.parameters / 1e6:.0f}M parameters: too large for a CPU sweep"
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        try:
            optimized = optimize_graph(model, optimizer, batch, loss_fn, passes=passes, check=True)
        except CaptureError as error:
            result.status, result.reason = "refused", str(error)
        except PipelineFailure as error:
            result.status, result.reason = "failed", _first_line(error)
        except Exception as error:  # a bug in mutwo or torch: recorded so the sweep goes on
            result.status, result.reason = "crashed", f"{type(error).__name__}: {_first_line(error)}"
        else:
            assert optimized.report is not None
            result.nodes = len(optimized.original)
            result.peak_before = simulate(optimized.original).peak_bytes
            result.peak_after = simulate(optimized.graph).peak_bytes
            result.recomputed = len(optimized.plan.entries) if optimized.plan is not None else 0
            if not optimized.report.equivalent:
                result.status, result.reason = "not-equivalent", optimized.report.summary()
    result.seconds = round(time.perf_counter() - started, 2)
    result.expected = met_expectation(entry, result)
    return result


def met_expectation(entry: ZooModel, result: ZooResult) -> bool:
    """An ``ok`` model must come out ``ok``; any other expectation is the start of its refusal."""
    if result.status == "skipped":
        return True
    if entry.expect == "ok":
        return result.status == "ok"
    return result.status == "refused" and result.reason.startswith(entry.expect)


def markdown(sweep: dict[str, Any]) -> str:
    """The zoo table of a sweep's JSON (``{"torch": version, "results": [...]}``), as in docs/zoo.md;
    zoo models the sweep did not reach are listed as ``not swept``."""
    swept = {r["name"] for r in sweep["results"]}
    results = sweep["results"] + [dict(ZooResult(m.name, m.family, "not swept").__dict__) for m in zoo()
                                  if m.name not in swept]  # fmt: skip
    counts: dict[str, int] = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    lines = [
        "# Model zoo: which models mutwo captures, rewrites and checks",
        "",
        f"Swept on {sweep.get('device', 'cpu').upper()} with torch {sweep['torch']} by "
        f"`python -m mutwo.tools.zoo -o {RESULTS}`; this page is",
        f"generated from that file by `python -m mutwo.tools.zoo --render {RESULTS} --markdown docs/zoo.md`.",
        "Every `ok` model was captured, rewritten at the lowest reachable peak (`select{budget=min}`) and",
        "found bitwise equal to the captured step over 3 Adam iterations (loss, gradients, parameters,",
        "buffers, optimizer state). A `refused` model got the one sentence in the note, which the sweep",
        "checks. Peaks are the simulator's, in MiB, at batch 2 and tiny sizes (`mutwo/tools/zoo_models.py`).",
        "The test suite sweeps the subset marked `ci`; `MUTWO_ZOO=full pytest tests/test_zoo.py` sweeps all.",
        "",
        "Totals: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + ".",
        "",
        "| model | family | status | nodes | peak before → after (MiB) | recomputed | seconds | note |",
        "|---|---|---|---:|---|---:|---:|---|",
    ]
    for r in results:
        peaks = f"{r['peak_before'] / MIB:.2f} → {r['peak_after'] / MIB:.2f}" if r["peak_before"] else ""
        seconds = r["seconds"] if r["status"] != "not swept" else ""
        note = r["reason"].replace("|", "\\|")
        lines.append(f"| {r['name']} | {r['family']} | {r['status']} | {r['nodes'] or ''} | {peaks} | "
                     f"{r['recomputed'] if r['status'] == 'ok' else ''} | {seconds} | {note} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m mutwo.tools.zoo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ci", action="store_true", help="only the cheap subset the test suite sweeps")
    parser.add_argument("--only", default="", metavar="NAME,...", help="only these models")
    parser.add_argument("--passes", default=DEFAULT_PASSES, help=f"the pipeline (default {DEFAULT_PASSES})")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to run (default cpu)")
    parser.add_argument("-o", "--out", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--markdown", metavar="FILE", help="write the results as a markdown table")
    parser.add_argument("--render", metavar="FILE",
                        help="sweep nothing: write --markdown from the JSON of an earlier sweep")
    return parser


def _render(source: str, target: str | None) -> int:
    if not target:
        raise UsageError("--render needs --markdown FILE to write the table to")
    try:
        sweep = json.loads(Path(source).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UsageError(f"--render: cannot read {source!r} ({error}); give a JSON written by -o") from None
    write_atomic(Path(target), markdown(sweep))
    return EXIT_OK


def select_models(ci: bool, only: str) -> list[ZooModel]:
    models = [m for m in zoo() if m.ci or not ci]
    wanted = [n for n in only.split(",") if n]
    unknown = sorted(set(wanted) - {m.name for m in models})
    if unknown:
        raise UsageError(f"--only names unknown model '{unknown[0]}'; the zoo: {', '.join(m.name for m in zoo())}")
    return [m for m in models if not wanted or m.name in wanted]


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.render:
            return _render(args.render, args.markdown)
        models = select_models(args.ci, args.only)
        if args.device == "cuda" and not torch.cuda.is_available():
            raise UsageError("--device cuda: no GPU is visible to torch; use --device cpu")
    except SystemExit as exit_:  # --help
        return int(exit_.code or 0)
    except UsageError as error:
        print(f"zoo: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    # cuBLAS reads this when it starts; the deterministic check on CUDA needs it.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    sweep: dict[str, Any] = {"torch": torch.__version__, "device": args.device, "passes": args.passes, "results": []}
    results: list[dict[str, Any]] = sweep["results"]
    for entry in models:
        result = run_model(entry, args.passes, args.device)
        results.append(dict(result.__dict__, reduction=result.reduction))
        mark = "" if result.expected else "  <-- unexpected"
        print(f"{entry.name:28} {result.status:15} {result.seconds:7.1f}s {result.reason[:90]}{mark}", flush=True)
        if args.out:  # after every model, so an interrupted sweep keeps what it measured
            write_atomic(Path(args.out), json.dumps(sweep, indent=1) + "\n")
    if args.markdown:
        write_atomic(Path(args.markdown), markdown(sweep))
    return EXIT_OK if all(r["expected"] for r in results) else EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
