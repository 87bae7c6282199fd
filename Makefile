# Two commands do all set-up on a fresh machine with Python 3.11 and make:
#   make demo   - create .venv, install, run the main job on the embedded data and tiny model
#   make test   - create .venv, install, run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch first and pinned: the local CPU wheel satisfies the project's `torch>=2.4` range, so the
# project install below never pulls a multi-GB CUDA build. Override on GPU machines, e.g.
#   make demo TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
STAMP  := $(VENV)/.installed

export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
export MLFLOW_DISABLE_TELEMETRY := true
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 90

.PHONY: install demo test test-verl clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/rlhf demo

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# verl 0.9.1 in an environment of its own (its transformers range excludes ours): the conformance
# step computes every verl-named quantity with verl's own functions there and compares (tests/conformance).
VERL_VENV  ?= .venv-verl
VERL_STAMP := $(VERL_VENV)/.installed
VERL_DEPS  := packaging numpy ray codetiming omegaconf "tensordict>=0.8.0,<=0.10.0,!=0.9.0" \
              "transformers>=5.5.3,<5.11,!=5.6.0" datasets pillow peft cachetools uvicorn fastapi

$(VERL_STAMP):
	test -x $(VERL_VENV)/bin/python || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VERL_VENV)/bin/python -m pip install --quiet $(TORCH_SPEC)
	$(VERL_VENV)/bin/python -m pip install --quiet --no-deps verl==0.9.1 torchdata==0.11.0
	$(VERL_VENV)/bin/python -m pip install --quiet $(VERL_DEPS)
	touch $(VERL_STAMP)

test-verl: $(STAMP) $(VERL_STAMP)
	VERL_PYTHON=$(VERL_VENV)/bin/python RLHF_REQUIRE_VERL=1 $(BIN)/python -m pytest tests/conformance $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VERL_VENV) runs .rlhf .pytest_cache .hypothesis

# Local Prefect server + worker + MLflow UI on 127.0.0.1 (deployments/README.md)
.PHONY: services-up services-down services-status services-register
SERVICES_ARGS ?=
services-up: $(STAMP)
	$(BIN)/python -m deployments.services up $(SERVICES_ARGS)
services-down:
	$(BIN)/python -m deployments.services down
services-status:
	$(BIN)/python -m deployments.services status
services-register: $(STAMP)
	$(BIN)/python -m deployments.services register
