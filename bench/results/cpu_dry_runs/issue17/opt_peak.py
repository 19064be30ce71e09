"""mutwo-opt, also measuring on the CPU (profiler allocation events) the peak of one iteration of the
plan run by the eager executor and by the compiled backend; then torch's per-phase compile times."""
import sys
import torch
from mutwo.ir.to_fx import to_fx
from mutwo.runtime.profiler import cpu_iteration_peak
from mutwo.tools import mutwo_opt as m

plain_compile = m.MutwoOpt.compile


def compile_and_measure(self, config, final, inputs):
    compiled = plain_compile(self, config, final, inputs)
    eager = cpu_iteration_peak(to_fx(final), inputs)
    ours = cpu_iteration_peak(compiled.run, inputs)
    print(f"CPU peak beyond the inputs, one iteration of the plan: eager executor {eager / 2**20:.2f} MiB, "
          f"{compiled.backend} {ours / 2**20:.2f} MiB ({ours / eager - 1:+.2%})", flush=True)
    return compiled


m.MutwoOpt.compile = compile_and_measure
plain_check = m.MutwoOpt.check


def check_and_list(self, *args):
    report = plain_check(self, *args)
    for mismatch in report.mismatches:
        print("  ", mismatch, flush=True)
    return report


m.MutwoOpt.check = check_and_list
try:
    code = m.main(sys.argv[1:])
finally:
    print(torch._dynamo.utils.compile_times(repr="str"), flush=True)
sys.exit(code)
