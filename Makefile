# make run   -> the main job: pack the demo model and serve it (make run ARGS="--port 8081")
# make test  -> create the environment from nothing and run the test suite
# make gpu-check -> the device check on a machine with a GPU (bench/gpu_check.py, under 8 minutes)
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin

.PHONY: env test run clean gpu-check

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

gpu-check:   # the GPU image has torch but no venv: build the host kernel in place, then check
	$(PY) setup.py -q build_ext --inplace || echo "no C compiler: the host path runs in torch"
	$(PY) bench/gpu_check.py $(ARGS)

clean:
	rm -rf $(VENV) .cache
