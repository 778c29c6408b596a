VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# `make run` needs only the service itself; `make test` and `make lint` add the test and lint extras to the same .venv
RUN_STAMP := $(VENV)/.installed-run
# `make gateway`: the service and the gateway's extra
GATEWAY_STAMP := $(VENV)/.installed-gateway
# the demo's own database, deleted at every `make run` so that each run starts from the demo; `make run KEEP=1` keeps it
DEMO_DB ?= statebudget-demo.db
# the deployed build (as in the Docker image): the planner's hot modules compiled with mypyc, see setup.py
COMPILED_VENV ?= .venv-compiled
COMPILED_STAMP := $(COMPILED_VENV)/.installed

.PHONY: run gateway fake-agents test test-fast test-compiled soak lint format import-graph compiled bench schemas screenshots clean \
	evidence evidence-quick evidence-demo evidence-exceeds evidence-decompose

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(RUN_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e .
	touch $(RUN_STAMP)

$(GATEWAY_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[gateway]'
	touch $(GATEWAY_STAMP)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[test,lint]'
	touch $(STAMP)

run: $(RUN_STAMP)
	$(VENV)/bin/statebudget serve --demo --db $(DEMO_DB) $(if $(KEEP),,--reset)

# the gateway in front of a planner (PLANNER, default the `make run` one); agents use http://127.0.0.1:8090/v1
PLANNER ?= http://127.0.0.1:8080
gateway: $(GATEWAY_STAMP)
	$(VENV)/bin/statebudget gateway --planner $(PLANNER) --host 127.0.0.1 --port 8090

# one agent per demo node for a planner (PLANNER, default the `make run` one, started afresh), every model a managed
# fake vLLM with its own LMCache instance id, then an hour of demo traffic in HOUR_SECONDS: tests/fakes/demo_cluster.py
HOUR_SECONDS ?= 300
fake-agents: $(RUN_STAMP)
	$(PY) tests/fakes/demo_cluster.py --server $(PLANNER) --hour-seconds $(HOUR_SECONDS)

# the whole suite but the compiled-build comparison (minutes of mypyc), which `make test-compiled` runs
test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile --ignore=tests/deploy/test_compiled_build.py

test-fast: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile -m "not slow" --ignore=tests/deploy/test_compiled_build.py

test-compiled: $(STAMP)
	$(PY) -m pytest tests/deploy/test_compiled_build.py

# the reliability trials against `statebudget serve` on loopback (about 30 minutes: 10 on the demo, 10 on 50 nodes,
# 50 SIGKILL trials, the fault cases); writes docs/reliability.md. tests/e2e/test_soak.py runs a bounded version.
soak: $(STAMP)
	$(PY) -m planner_service.soak --duration-seconds 600 --large-duration-seconds 600 --large-nodes 50 --trials 50 \
		--out docs/reliability.md

# the gates CI runs before the tests: lint, format, types, import layers
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# docs/images/imports.svg, the picture in docs/architecture.md: which package imports which (an arrow points at
# what a package imports), clustered by root package, no externals. pydeps follows imports from a file that
# imports every module; it needs graphviz's `dot` (Debian: apt-get install graphviz).
import-graph: $(STAMP)
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	find planner_service clients -name '*.py' ! -name '__init__.py' | sort \
		| sed 's|\.py$$||; s|/|.|g; s|^|import |' > "$$tmp/statebudget_modules.py" && \
	PYTHONPATH=$(CURDIR) $(VENV)/bin/pydeps "$$tmp/statebudget_modules.py" --no-config --noshow \
		--only planner_service clients -xx planner_service clients --max-bacon 0 --max-module-depth 2 \
		--cluster --max-cluster-size 1000 --reverse --rankdir BT --rmprefix planner_service. clients. \
		-o $(CURDIR)/docs/images/imports.svg

$(COMPILED_STAMP): $(STAMP) setup.py $(shell find planner_service -name '*.py')
	rm -rf dist
	STATEBUDGET_COMPILE=1 $(PY) -m pip wheel -q --no-build-isolation --no-deps -w dist .
	test -x $(COMPILED_VENV)/bin/python || python3 -m venv $(COMPILED_VENV)
	$(COMPILED_VENV)/bin/pip install -q --force-reinstall --no-deps dist/statebudget-*.whl
	$(COMPILED_VENV)/bin/pip install -q dist/statebudget-*.whl
	touch $@

compiled: $(COMPILED_STAMP)

# planning time of the deployed (compiled) build; `.venv/bin/statebudget bench plan ...` times pure Python
bench: $(COMPILED_STAMP)
	$(COMPILED_VENV)/bin/statebudget bench plan --gpus 16 --models 7 --sessions 100 --repeat 300 --json
	$(COMPILED_VENV)/bin/statebudget bench plan --gpus 64 --models 16 --sessions 500 --repeat 50 --json
	$(COMPILED_VENV)/bin/statebudget bench plan --gpus 1000 --models 64 --sessions 5000 --repeat 10 --json

schemas: $(STAMP)
	$(VENV)/bin/statebudget export-schemas --out schemas

# docs/images/status-page.png and swagger-offline.png: the demo on a fresh database, a few minutes of agents'
# traffic, then headless Chromium with the network off but for loopback (Debian: apt-get install chromium)
screenshots: $(STAMP)
	$(PY) deploy/screenshots.py --out docs/images

clean:
	rm -rf $(VENV) $(COMPILED_VENV) build dist .pytest_cache .hypothesis
	rm -f $(DEMO_DB) $(DEMO_DB)-wal $(DEMO_DB)-shm

# docs/evidence.md from the stored seed studies in docs/evidence/ and the findings written from them (seconds,
# no replay)
evidence: $(STAMP)
	$(VENV)/bin/statebudget study evidence docs/evidence/*.json --findings docs/evidence/findings.md \
		--out docs/evidence.md
# the CI-sized study (10 seeds of 5 sessions x 15 min, gaps x8, precision held equal, static-tuned searched in 50
# replays), stored, then rendered
evidence-quick: $(STAMP)
	$(VENV)/bin/statebudget study seeds --seeds 1,2,3,4,5,6,7,8,9,10 --train-seeds 101 --sessions 5 --gap-scale 8 \
		--hours 0.25 --precision native --tune-budget 50 --out build/evidence --json > docs/evidence/demo-quick.json
	$(MAKE) evidence
# the demo study docs/evidence.md reports: three load levels (5 sessions x 1 h, gaps x16, x8, x4), 10 seeds each,
# precision held equal, static-tuned searched in 200 training replays at each level
evidence-demo: $(STAMP)
	$(VENV)/bin/statebudget study seeds --seeds 1,2,3,4,5,6,7,8,9,10 --train-seeds 101,102 --sessions 5 \
		--gap-scale 16,8,4 --hours 1 --precision native --tune-budget 200 --out build/evidence \
		--json > docs/evidence/demo.json
	$(MAKE) evidence
# the demo's three load levels (gaps x16, x8, x4) on the catalog-exceeds-HBM scenario (999 GB of weights on 571 GB
# of HBM), 10 seeds each; EXCEEDS_GAPS=16 runs the light level alone
EXCEEDS_GAPS ?= 16,8,4
evidence-exceeds: $(STAMP)
	$(VENV)/bin/statebudget study seeds --scenario exceeds-hbm --seeds 1,2,3,4,5,6,7,8,9,10 --train-seeds 101,102 \
		--sessions 5 --gap-scale $(EXCEEDS_GAPS) --hours 1 --precision native --tune-budget 200 \
		--out build/evidence-exceeds --json > docs/evidence/exceeds-hbm.json
	$(MAKE) evidence
# the decomposition on the headline case (exceeds-hbm at gaps x16 and x8, 10 seeds): static-tuned, then the planner
# on the operator's groups without and with switch prediction, then moving engines; each step paired by seed
evidence-decompose: $(STAMP)
	$(VENV)/bin/statebudget study decompose --scenario exceeds-hbm --seeds 1,2,3,4,5,6,7,8,9,10 \
		--train-seeds 101,102 --sessions 5 --gap-scale 16,8 --hours 1 --precision native --tune-budget 200 \
		--json > docs/evidence/decomposition.json
	$(MAKE) evidence
