# The two commands a newcomer needs: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# CPU wheel of torch; GPU users install their own torch build before `make`.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test bench venv clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/pixeltriage demo

test: venv
	$(PY) -m pytest -q

bench: venv
	$(PY) -m pytest -q -o addopts="" -m bench --benchmark-only --benchmark-columns=min,median,max,rounds tests/bench

clean:
	rm -rf $(VENV) .cache .pytest_cache .benchmarks
