"""mutwo-opt, then torch's per-phase compile times (dynamo_timed) of what it compiled."""
import sys
import torch
from mutwo.tools.mutwo_opt import main
try:
    code = main(sys.argv[1:])
finally:
    print(torch._dynamo.utils.compile_times(repr="str"), flush=True)
sys.exit(code)
