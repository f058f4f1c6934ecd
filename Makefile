# ray-train-eks: every command a newcomer needs. Each target does its own set-up.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CDK := JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION=20 CDK_DISABLE_CLI_TELEMETRY=true npx --no-install cdk
export JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION := 20
export CDK_DISABLE_CLI_TELEMETRY := true

.PHONY: setup synth test demo mlflow-ui deploy destroy lock bench upstream clean

## setup: virtual environment with pinned Python packages, and the pinned CDK CLI (idempotent)
setup: $(VENV)/.installed node_modules/.installed

$(VENV)/.installed: requirements.txt requirements-dev.txt constraints.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet pip==25.3
	$(PY) -m pip install --quiet -r requirements-dev.txt -c constraints.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

## the MLflow tracking server the tests log to, in a virtual environment of its own (requirements-mlflow-server.txt)
MLFLOW_VENV := .venv-mlflow
$(MLFLOW_VENV)/.installed: requirements-mlflow-server.txt constraints-mlflow-server.txt
	test -x $(MLFLOW_VENV)/bin/python || $(PYTHON) -m venv $(MLFLOW_VENV)
	$(MLFLOW_VENV)/bin/python -m pip install --quiet pip==25.3
	$(MLFLOW_VENV)/bin/python -m pip install --quiet -r requirements-mlflow-server.txt -c constraints-mlflow-server.txt
	touch $@

node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

## synth: CloudFormation (cdk.out/) checked by cdk-nag; prints the cost per hour
synth: setup
	$(CDK) synth --no-notices --quiet

## test: the whole test suite (unit, synth, cdk-nag, cfn-lint, snapshots, training on CPU) on TEST_WORKERS
## pytest-xdist workers (0: one process): the Ray runs wait as much as they compute, so the rest runs beside them
TEST_WORKERS ?= 2
test: setup $(MLFLOW_VENV)/.installed
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

## demo: no AWS account needed: synthesize, run the RayJob's entrypoint on a local Ray
## with a tiny model (demo-out/ is the demo's scratch folder, emptied each time), say where everything went
demo: synth
	rm -rf demo-out && mkdir -p demo-out
	# MLflow's own default store (sqlite:///mlflow.db), its artifacts in ./mlruns beside it: run from demo-out/
	cd demo-out && $(abspath $(PY)) -m training.train --preset tiny-cpu --storage-path runs --tracking-uri sqlite:///mlflow.db \
	  2> ray.log | tee train.log
	$(PY) -m ray_train_eks.demo cdk.out demo-out

## mlflow-ui: the MLflow UI on the demo's runs (demo-out/mlflow.db), on http://127.0.0.1:5000
mlflow-ui: $(MLFLOW_VENV)/.installed
	cd demo-out && $(abspath $(MLFLOW_VENV))/bin/mlflow ui --host 127.0.0.1 --port 5000 --backend-store-uri sqlite:///mlflow.db

## deploy / destroy: real AWS (credentials and a bootstrapped account needed)
deploy: setup
	$(CDK) deploy --no-notices --require-approval broadening

destroy: setup
	$(CDK) destroy --no-notices

## lock: re-pin every transitive Python dependency after changing requirements*.txt
lock: setup $(MLFLOW_VENV)/.installed
	( echo '# Every transitive dependency, pinned (pip freeze of a working venv). Regenerate with `make lock`.'; \
	  $(PY) -m pip freeze --exclude-editable ) > constraints.txt
	( echo '# Every transitive dependency of the tests'"'"' MLflow server (.venv-mlflow), pinned (pip freeze). Regenerate with `make lock`.'; \
	  $(MLFLOW_VENV)/bin/python -m pip freeze ) > constraints-mlflow-server.txt

## bench: training-step throughput against dynamic padding, loss-step memory, bytes per step; the per-step
## preemption check, the checkpoint stall and the data preparation; a LoRA (DPO) step's cost; the run's end against a
## hung tracker (prints figures)
bench: setup
	$(PY) -m bench.train_throughput
	$(PY) -m bench.run_overheads
	$(PY) -m bench.evaluation_cost
	$(PY) -m bench.lora_step_cost
	$(PY) -m bench.tracker_end

## upstream: download the pinned chart packages (sha256-checked) and the upstream data the tests validate
## against into .cache/upstream/ (git-ignored); `cdk deploy` then ships the verified packages as assets
upstream: setup
	$(PY) scripts/fetch_upstream.py

clean:
	rm -rf cdk.out dist demo-out .pytest_cache
