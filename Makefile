# Two commands: `make demo` and `make test`. Each creates (or refreshes, when pyproject.toml
# changes) a virtual environment in $(VENV), installs Ember into it, and runs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ember-installed
PYTEST_WORKERS ?= 2

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test,hf]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --durations=15

demo: $(STAMP)
	$(VENV)/bin/ember info
	$(VENV)/bin/jupyter execute examples/core_tour.ipynb

clean:
	rm -rf $(VENV) .pytest_cache runs
