# Source this at the start of a command on a bare GPU machine with no network (the lab's device
# tool): it installs mutwo from this checkout, editable, into the machine's python3, using the
# wheels carried in .whl/ for what that image lacks (pydot; a setuptools new enough for
# pyproject's license field). Fetch them here first:
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl setuptools==80.9.0 pydot==3.0.4
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "careful\|\*\*\*\|!!\|name as your\|precedence\|with strategy\|BuildBackendWarning\|^ *$"
python3 -c "import mutwo, torch; print('mutwo', mutwo.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())" || return 1
