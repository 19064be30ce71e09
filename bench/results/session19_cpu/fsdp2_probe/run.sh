#!/bin/bash
# usage: ./run.sh script.py [args]
export OMP_NUM_THREADS=1
exec "${PYTHON:-.venv/bin/python}" -m torch.distributed.run --nproc-per-node 2 --master-port ${PORT:-29533} "$@"
