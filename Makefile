# The two commands a newcomer needs: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# CPU wheel of torch, from PyTorch's CPU index (on PyPI, Linux torch is the multi-GB CUDA build; its +cpu local
# version ranks above PyPI's, so pip takes it; where that index is unreachable, a local +cpu wheel from pip's
# configured find-links is taken). torch alone comes from there (--no-deps), its dependencies from the usual
# indexes. GPU users install their own torch build into $(VENV) before `make`.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: demo test test-slow bench venv clean

# the venv with torch in it (a CUDA torch already there is kept)
$(VENV)/.torch:
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || { $(PIP) install -q --no-deps --retries 2 "$(TORCH_SPEC)" \
		--extra-index-url "$(TORCH_INDEX)" && $(PIP) install -q "$(TORCH_SPEC)"; }
	touch $@

# the package build's inputs: its metadata, and the C kernels setup.py compiles (in place, an editable install)
PACKAGE_BUILD := pyproject.toml setup.py $(wildcard pixeltriage/kernels/native/*.[ch]) \
	pixeltriage/kernels/native/abi.py pixeltriage/kernels/native/variants.py

# what the demo needs: the package (its C kernels built for every x86 level, as a user's `pip install .` builds
# them) and its runtime dependencies
$(VENV)/.installed: $(PACKAGE_BUILD) $(VENV)/.torch
	$(PIP) install -q -e .
	touch $@

# everything the test suite needs (the test extra: Triton for the fused head under its interpreter, peft, the
# server's and the retrieval index's dependencies, ...); implies the demo's
$(VENV)/.installed-test: $(PACKAGE_BUILD) $(VENV)/.torch
	$(PIP) install -q -e ".[test]"
	touch $@ $(VENV)/.installed

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/pixeltriage demo

# the suite on TEST_WORKERS parallel processes (pytest-xdist; each test file on one worker, its tests in file order,
# the files marked long first: tests/conftest.py), without the tests marked slow: those are `make test-slow`'s
# (.ci/run runs both)
TEST_WORKERS ?= 2
test: $(VENV)/.installed-test
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow"

test-slow: $(VENV)/.installed-test
	$(PY) -m pytest -q -m slow; status=$$?; \
		if [ $$status -eq 5 ]; then echo "no tests marked slow"; status=0; fi; exit $$status

bench: $(VENV)/.installed-test
	$(PY) -m pytest -q -o addopts="" -m bench --benchmark-only --benchmark-columns=min,median,max,rounds tests/bench/suite

clean:
	rm -rf $(VENV) .cache .pytest_cache .benchmarks build pixeltriage/kernels/native/prebuilt
