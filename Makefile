# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv if missing,
# installs the pinned dependencies once, and (re)builds the C++ core incrementally (ninja).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
DEPS   := $(VENV)/.deps-stamp
EXT    := torchneuron/_C$(shell $(PYTHON) -c "import sysconfig;print(sysconfig.get_config_var('EXT_SUFFIX'))")
CSRC   := $(shell find csrc -name '*.cpp' -o -name '*.h')

.PHONY: all build demo test bench clean

all: build

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first and pinned, so nothing can pull another (multi-GB CUDA) build; then the project
# in editable mode without compiling (the extension is built below, incrementally).
$(DEPS): $(PY) pyproject.toml setup.py
	$(PY) -m pip install -q --upgrade pip setuptools wheel ninja
	$(PY) -m pip install -q torch==2.13.0
	TORCHNEURON_SKIP_EXT=1 $(PY) -m pip install -q --no-build-isolation -e '.[test]'
	touch $@

$(EXT): $(DEPS) $(CSRC) setup.py
	# Autoload off: torch must not try to load the extension that is being built.
	flock /tmp/torchneuron-build.lock env MAX_JOBS=2 TORCH_DEVICE_BACKEND_AUTOLOAD=0 $(PY) setup.py -q build_ext --inplace
	touch $@

build: $(EXT)

demo: build
	$(PY) examples/train_gpt.py

test: build
	$(PY) -m pytest -q -p no:cacheprovider tests

bench: build
	$(PY) bench/eager_overhead.py
	@for b in bench/compile.py bench/nki.py bench/nkilib.py bench/collectives.py; do \
		if [ -f $$b ]; then $(PY) $$b || exit 1; fi; done

clean:
	rm -rf build torchneuron/_C*.so *.egg-info
