# Two commands: `make demo` and `make test`. Each creates (or refreshes, when pyproject.toml
# changes) a virtual environment in $(VENV), installs Ember into it, and runs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ember-installed
PYTEST_WORKERS ?= 2

.PHONY: demo test venv clean gpu gpu-wheels

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -e ".[test,hf]"
	@# pip byte-compiles what it installs on one core; compileall uses every core (fresh clones on a
	@# 2-core machine like CI's, two paired runs: 96 -> 76 s and 129 -> 83 s). Its exit status is 1
	@# for a file that pip skips as well: a torch test helper in Python 3.12 syntax.
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	touch $(STAMP)

# Lint and format check first (fast, and a failure stops before the long suite), then pytest.
# Work stealing: a worker that runs out of tests takes them from the other's queue (xdist's default
# keeps each worker's queue; one worker was seen idle for the last 5 of 17 minutes), and
# tests/conftest.py starts the longest modules first, so that what is left to steal is short.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist worksteal --durations=15

# Trains the tiny byte-level LM on this machine's Python stdlib sources (~2 minutes on CPU) into a
# fresh run directory, samples text from it, and plots its curves.
demo: $(STAMP)
	$(VENV)/bin/ember info
	@run_dir=runs/tiny-$$(date +%Y%m%d-%H%M%S); \
	$(VENV)/bin/ember train configs/lm/tiny.yaml run_dir=$$run_dir && \
	$(VENV)/bin/ember plot $$run_dir --metrics loss,val_loss,tokens_per_second

# The GPU session's one command (benchmarks/README.md): every kernel checked on the device, then
# the issue's performance rows. Without a GPU it runs at toy sizes with the kernels interpreted.
# On the device machine: `make gpu PY=python3 GPU_ARGS="--results-dir $$OUT"`.
gpu:
	$(PY) -m benchmarks.gpu $(GPU_ARGS)

# Wheels the GPU image lacks, for the device tool's `carry` (.whl/ is git-ignored; never commit it).
GPU_WHEELS := omegaconf==2.4.0 qwix==0.1.8
gpu-wheels:
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV) .pytest_cache runs
