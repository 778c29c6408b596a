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
	evidence evidence-quick evidence-demo evidence-exceeds evidence-decompose evidence-catalog-fits evidence-handoffs \
	evidence-real evidence-full evidence-gateway evidence-affinity

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
		--out docs/evidence.md --readme README.md
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
# the demo's middle load level (gaps x8, 10 seeds of 5 sessions x 1 h, as evidence-demo) on the catalog-fits scenario,
# where every model stays warm with room for KV
evidence-catalog-fits: $(STAMP)
	$(VENV)/bin/statebudget study seeds --scenario catalog-fits --seeds 1,2,3,4,5,6,7,8,9,10 --train-seeds 101,102 \
		--sessions 5 --gap-scale 8 --hours 1 --precision native --tune-budget 200 --out build/evidence-catalog-fits \
		--json > docs/evidence/catalog-fits.json
	$(MAKE) evidence
# the demo's gaps x8 level at two hand-off rates, 25 % (Alibaba's sessions change model on 24.9 % of later requests
# on the demo's models, sim/fit.py) and 50 %, once with the whole history shared and once with fresh sub-agents
HANDOFF_RATES ?= 0.25,0.5
evidence-handoffs: $(STAMP)
	for context in shared fresh; do \
		$(VENV)/bin/statebudget study seeds --seeds 1,2,3,4,5,6,7,8,9,10 --train-seeds 101,102 --sessions 5 \
			--gap-scale 8 --hours 1 --handoff-rate $(HANDOFF_RATES) --context $$context --precision native \
			--tune-budget 200 --out build/evidence-handoffs-$$context --json > docs/evidence/handoffs-$$context.json \
			|| exit 1; \
	done
	$(MAKE) evidence
# each public trace replayed as it is on the demo (../shared/traces, TRACES to move it), in windows: Azure and
# Mooncake (an hour each) in four 15-minute windows, static-tuned searched on the first, the other three reported;
# Alibaba (23 days) in days, searched on days 4-5, days 6-22 reported (days 0-3 and 23 hold about 100 requests
# each). Azure and Mooncake hand off along the demo's chain (their sessions never change model). REAL_TUNE replays
# for the search: a replay of a window takes 4-7 s (Azure) and 8-23 s (Mooncake, overloaded) per policy, a day of
# Alibaba 0.2-8 s (measured 2026-12-03 on the shared 2-vCPU machine)
TRACES ?= ../shared/traces
REAL_TUNE ?= 100
evidence-real: $(STAMP)
	$(VENV)/bin/statebudget study seeds --trace azure --traces-dir $(TRACES) --hours 0.25 --seeds 1,2,3 \
		--train-seeds 0 --precision native --tune-budget $(REAL_TUNE) --json > docs/evidence/real-azure.json
	$(VENV)/bin/statebudget study seeds --trace mooncake --traces-dir $(TRACES) --hours 0.25 --seeds 1,2,3 \
		--train-seeds 0 --precision native --tune-budget $(REAL_TUNE) --json > docs/evidence/real-mooncake.json
	$(VENV)/bin/statebudget study seeds --trace alibaba --traces-dir $(TRACES) --hours 24 \
		--seeds 6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22 --train-seeds 4,5 --precision native \
		--tune-budget $(REAL_TUNE) --json > docs/evidence/real-alibaba.json
	$(MAKE) evidence
# every replay the headline needs, sized to finish within 2 hours on 2 cores: exceeds-hbm at three load levels
# (38 s) and its decomposition (23 s), the demo at three (28 s), catalog-fits at one (9 s), the synthetic trace at two
# hand-off rates with both context semantics (33 s), and each public trace at REAL_TUNE=100 (23 min: Azure 12,
# Mooncake 9, Alibaba 3), with the gateway's studies (6 min and 2 min): 33 minutes in all (2026-12-04, load average 1-2.6; on
# 2026-12-03, at load 5-7 and before the last physics terms, about 80); evidence-quick stays the CI-sized study
evidence-full: $(STAMP)
	$(MAKE) evidence-exceeds
	$(MAKE) evidence-decompose
	$(MAKE) evidence-demo
	$(MAKE) evidence-catalog-fits
	$(MAKE) evidence-handoffs
	$(MAKE) evidence-real
	$(MAKE) evidence-gateway
	$(MAKE) evidence-affinity
# the gateway's warm-ups against the same policies without them (statebudget, sleep-router; arms none, warmups (the
# service's priced target), warmups-top, warmups-handoff, eager-handoff), 10 seeds each of the
# synthetic trace (5 sessions x 30 min) at gaps x16 and x4 (loaded), 60 s windows of Azure 2023 (--handoffs) and
# 4 h windows of Alibaba GenAI 2026, read from TRACES; precision held equal
evidence-gateway: $(STAMP)
	$(VENV)/bin/statebudget study gateway --seeds 1,2,3,4,5,6,7,8,9,10 --sessions 5 --hours 0.5 --gap-scale 16,4 \
		--traces $(TRACES) --azure-window 60 --alibaba-window 14400 --precision native --json > docs/evidence/gateway.json
	$(MAKE) evidence
# the gateway's session affinity, with two engine instances of each of the two busiest models (planner and coder:
# the most requested in Azure's and Alibaba's imports and the synthetic trace's): the same policies and traces as
# evidence-gateway, each request sent to the least loaded instance (none) or to its session's KV holder (affinity)
evidence-affinity: $(STAMP)
	$(VENV)/bin/statebudget study gateway --seeds 1,2,3,4,5,6,7,8,9,10 --sessions 5 --hours 0.5 --gap-scale 16,4 \
		--traces $(TRACES) --azure-window 60 --alibaba-window 14400 --precision native --arms none,affinity \
		--replicas planner=2,coder=2 --json > docs/evidence/gateway-affinity.json
	$(MAKE) evidence
