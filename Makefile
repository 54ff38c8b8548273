# Quick start:  make run   (sets up .venv, runs the embedded default job)
#               make test  (sets up .venv, runs the test suite)
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned where we install it; setup.cfg keeps a range (a GPU user's pip takes the CUDA build).
TORCH_PIN ?= torch==2.13.0

$(VENV)/.installed: setup.cfg pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

.PHONY: setup run test
setup: $(VENV)/.installed

run: $(VENV)/.installed
	bin/dflash-up $(ARGS)

test: $(VENV)/.installed
	bash .ci/pytest.sh $(ARGS)
