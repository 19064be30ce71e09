"""A/B of the two changes of 2026-11-24 to mutwo's Inductor plans, on one GPU in one run: fused
pricing of recomputes (``select{fused=true}``: a pointwise clone fused into its producer charged
nothing) and ``batch_norm_elemt`` decomposed for Inductor (a batch norm replayed from its statistics
fused with the ReLU after it). This script sets them in the worker process of a
``bench/compare.py`` row, so that the rows differ by them alone (same budget, same machine):

- ``fused+decomposed``: both (fused pricing was the default under Inductor when this ran first);
- ``eager-priced+decomposed``: every recompute clone priced at its eager time (the default since);
- ``eager-priced``: neither (mutwo's Inductor plans before 2026-11-24).

Why: after both landed, ResNet-152 channels-last b128 at torch.compile 0.5's peak ran 123.6 and
125.5 ms on the H100 where it had run 119.9 ms before them (bench/results/issue18_h100_swap_inductor/).

    python bench/fused_pricing_ab.py --out $OUT/fused_pricing_ab.json --model resnet152-cl:128 \
        --budget-bytes 15766076416
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("fused+decomposed", "eager-priced+decomposed", "eager-priced")


def configure(config: str) -> None:
    """In this process, set what ``config`` names (before compare.py's worker plans): fused pricing
    on for both planning passes, the decomposition off unless named."""
    from mutwo.passes import select, select_swap
    from mutwo.runtime.execution import backends

    if "fused" in config:
        priced = select.recompute_time_model

        def fused(graph: Any, profile: Any, ctx: Any, who: str, _: bool) -> Any:
            return priced(graph, profile, ctx, who, True)

        select.recompute_time_model = select_swap.recompute_time_model = fused  # type: ignore[assignment]
    if "decomposed" not in config:
        backends.batch_norm_elemt_decomposed = nullcontext  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write (rewritten after every row)")
    parser.add_argument("--model", default="resnet152-cl:128", help="name:batch, as compare.py's --models")
    parser.add_argument("--budget-bytes", type=int, required=True, help="the budget every row is planned for")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"a subset of {','.join(CONFIGS)}")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per row")
    args = parser.parse_args()
    name, _, batch = args.model.rpartition(":")
    rows: list[dict[str, Any]] = []
    for config in args.configs.split(","):
        if config not in CONFIGS:
            parser.error(f"--configs: {config!r} is not one of {', '.join(CONFIGS)}")
        code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from bench.fused_pricing_ab import configure; "
                f"configure({config!r}); import runpy; runpy.run_path({str(ROOT / 'bench/compare.py')!r}, "
                "run_name='__main__')")  # fmt: skip
        # compare.py's variant name sets the backend; the budget is given in bytes.
        command = [sys.executable, "-c", code, "--worker", name, batch, "mutwo@inductor-x",
                   json.dumps({"bytes": args.budget_bytes}), "--out", args.out]  # fmt: skip
        try:
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            row = json.loads(lines[-1]) if done.returncode == 0 and lines else {"error": done.stderr.strip()[-600:]}
        except subprocess.TimeoutExpired:
            row = {"error": f"timeout after {args.timeout} s"}
        row.update(config=config, model=name, batch_size=int(batch))
        print(json.dumps({k: v for k, v in row.items() if k != "iteration_ms_all"}), flush=True)
        rows.append(row)
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"gpu": gpu, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                                              "budget_bytes": args.budget_bytes, "runs": rows}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
