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

KERNEL_SO = moefit/kernels/_moe$(shell $(PY) -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')

gpu-check:   # the GPU image has torch but no venv: build the host kernel in place (by hand if its setuptools
             # is older than pyproject.toml needs), then check
	$(PY) setup.py -q build_ext --inplace 2>/dev/null || cc -O3 -std=gnu11 -fno-math-errno -fwrapv -fPIC -shared \
	    moefit/kernels/moe.c -o $(KERNEL_SO) -lm -lpthread || echo "no C compiler: the host path runs in torch"
	$(PY) bench/gpu_check.py $(ARGS)

clean:
	rm -rf $(VENV) .cache
