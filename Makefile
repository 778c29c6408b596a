VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-fast bench schemas clean

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/statebudget serve --demo

test: $(STAMP)
	$(PY) -m pytest

test-fast: $(STAMP)
	$(PY) -m pytest -m 'not slow'

bench: $(STAMP)
	$(VENV)/bin/statebudget bench plan --gpus 16 --models 7 --sessions 100 --repeat 300 --json
	$(VENV)/bin/statebudget bench plan --gpus 64 --models 16 --sessions 500 --repeat 50 --json
	$(VENV)/bin/statebudget bench plan --gpus 1000 --models 64 --sessions 5000 --repeat 10 --json

schemas: $(STAMP)
	$(VENV)/bin/statebudget export-schemas --out schemas

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
