# Two entry points: `make demo` and `make test`. Both create .venv when missing and install into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test stress install clean bench

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel cffi "numpy>=2.0"

# --no-compile: Python compiles the bytecode of the modules it imports on first use, instead of
# pip compiling every file of every package (torch alone has thousands) at install.
$(STAMP): $(PY) pyproject.toml setup.py native/build.py $(wildcard native/*.c native/*.h)
	$(PY) -m pip install -q --no-compile --no-build-isolation -e ".[test,plot,peer,dask]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) -m cachedarrays.models.demo

# Test workers (pytest-xdist): auto = one per core; 0 runs the suite in this process.
TEST_WORKERS ?= auto

test: install
	$(PY) -m pytest tests -n $(TEST_WORKERS)

# Long randomized runs (not part of `make test`): STRESS_STEPS steps and STRESS_MINUTES at least.
STRESS_STEPS ?= 100000
STRESS_MINUTES ?= 5
stress: install
	$(PY) tests/stress.py --steps $(STRESS_STEPS) --minutes $(STRESS_MINUTES)

# Every benchmark at sizes that finish in about ten minutes; writes bench_results/SUMMARY.md.
bench: install
	$(PY) benchmarks/run_all.py --out bench_results

clean:
	rm -rf build *.egg-info cachedarrays/_native*.so cachedarrays/_records*.so native/_native.c
