# Source this on the GPU machine (bash, from the repository root) before running the tests or a
# bench script there: it has torch and the other dependencies but not pydot (carried as wheels in
# .whl/, see the device tool's README) and no network. mutwo's folders are linked into one import
# package under /tmp/mutwo-src, as pyproject.toml's package-dir maps them, so no build is needed.
# PYTHONSAFEPATH keeps the repository root from coming first on sys.path (its mutwo/ holds only
# the top of the package), in subprocesses too; pytest then needs --import-mode=append:
#   source bench/device_env.sh && python3 -m pytest --import-mode=append -m cuda tests
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || return 1
rm -rf /tmp/mutwo-src && mkdir -p /tmp/mutwo-src/mutwo
for f in "$PWD"/mutwo/*; do ln -s "$f" /tmp/mutwo-src/mutwo/; done
ln -s "$PWD/mutwo_ir" /tmp/mutwo-src/mutwo/ir
ln -s "$PWD/passes" /tmp/mutwo-src/mutwo/passes
ln -s "$PWD/runtime" /tmp/mutwo-src/mutwo/runtime
ln -s "$PWD/tools" /tmp/mutwo-src/mutwo/tools
export PYTHONPATH=/tmp/mutwo-src:/tmp/site PYTHONSAFEPATH=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1
