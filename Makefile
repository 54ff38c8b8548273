# Quick start:  make run   (sets up .venv, runs the embedded default job)
#               make test  (sets up .venv-test, runs the test suite)
# Two environments: the run's holds the package and the trackers it writes to, without the test
# extras (torchao among them: transformers imports it whenever it is installed, and its import
# prints lines about its own build on every command); the test suite's holds them all.
VENV ?= .venv
TEST_VENV ?= .venv-test
PY := $(VENV)/bin/python
TEST_PY := $(TEST_VENV)/bin/python
# torch is pinned where we install it; setup.cfg keeps a range (a GPU user's pip takes the CUDA build).
TORCH_PIN ?= torch==2.13.0
# What `make run` and the README's walk use: tensorboard (the default metrics sink), matplotlib (report).
RUN_EXTRAS ?= tensorboard,report

$(VENV)/.installed: setup.cfg pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[$(RUN_EXTRAS)]'
	touch $@

$(TEST_VENV)/.installed: setup.cfg pyproject.toml
	python3 -m venv $(TEST_VENV)
	$(TEST_PY) -m pip install -q $(TORCH_PIN)
	$(TEST_PY) -m pip install -q -e '.[test]'
	touch $@

.PHONY: setup run test
setup: $(VENV)/.installed

run: $(VENV)/.installed
	bin/dflash-up $(ARGS)

test: $(TEST_VENV)/.installed
	TEST_PYTHON=$(TEST_PY) bash .ci/pytest.sh $(ARGS)
