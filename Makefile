# make run   -> the main job: pack the demo model and serve it (make run ARGS="--port 8081")
# make test  -> create the environment from nothing and run the test suite
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin

.PHONY: env test run clean

$(BIN)/moefit: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $@

env: $(BIN)/moefit

test: env
	$(BIN)/python -m pytest

run: env
	$(BIN)/python -m moefit.demo $(ARGS)

clean:
	rm -rf $(VENV) .cache
