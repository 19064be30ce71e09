"""mutwo-opt, listing every mismatch of --check and the time the check took, and the fp64 rule's
verdicts (compiled RMSE from fp64 over eager fp32's) on the tensors that missed the direct rule."""
import sys
import time

from mutwo.runtime import equivalence, fp64_reference
from mutwo.tools import mutwo_opt as m

verdicts = []
plain_verdict = fp64_reference.verdict


def recording_verdict(*args, **kwargs):
    judged = plain_verdict(*args, **kwargs)
    if judged is not None:
        verdicts.append(judged)
    return judged


equivalence.fp64_reference.verdict = recording_verdict
plain_check = m.MutwoOpt.check


def check_and_list(self, *args):
    started = time.perf_counter()
    report = plain_check(self, *args)
    print(f"check took {time.perf_counter() - started:.1f} s", flush=True)
    for mismatch in report.mismatches:
        print("  ", mismatch, flush=True)
    ratios = sorted(v.compiled_error / v.eager_error if v.eager_error else float("inf") for v in verdicts)
    if ratios:
        print(f"fp64 rule judged {len(ratios)} tensors: compiled/eager RMSE ratio median {ratios[len(ratios) // 2]:.3g}, "
              f"90th percentile {ratios[int(len(ratios) * 0.9)]:.3g}, max {ratios[-1]:.3g}; "
              f"{sum(r <= 1 for r in ratios)} with the compiled step closer to fp64 than eager", flush=True)
    return report


m.MutwoOpt.check = check_and_list
sys.exit(m.main(sys.argv[1:]))
