# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv if missing,
# installs the pinned dependencies once, and (re)builds the C++ core incrementally (ninja).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  := $(VENV)/.torch-stamp
DEPS   := $(VENV)/.deps-stamp
EXT    := torchneuron/_C$(shell $(PYTHON) -c "import sysconfig;print(sysconfig.get_config_var('EXT_SUFFIX'))")
CSRC   := $(shell find csrc -name '*.cpp' -o -name '*.h')
VLLM   := $(VENV)/.vllm-stamp
# triton for TorchTitan runs only (examples/torchtitan): kept off the venv's path (vLLM refuses it)
TITAN_TRITON := $(VENV)/torchtitan-triton
# A CI run once lost two large wheels (vLLM 133 MB, triton 198 MB) to a network that kept dropping
# the connection: pip resumes an interrupted download this many times before giving up (its
# default, 5, was not enough). pip before 25.1 (the venv's first, bundled pip) ignores it.
export PIP_RESUME_RETRIES ?= 40
export PIP_RETRIES ?= 10

.PHONY: all build demo test bench clean vllm mutation

all: build

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first and pinned, so nothing can pull another (multi-GB CUDA) build. The C++ core
# needs nothing else, so it compiles while the project and its extras install (CPU vs download).
$(TORCH): $(PY) requirements/constraints.txt
	$(PY) -m pip install -q --upgrade pip setuptools wheel ninja
	$(PY) -m pip install -q torch==2.13.0
	touch $@

# The project in editable mode without compiling (the extension is built below, incrementally).
$(DEPS): $(TORCH) pyproject.toml setup.py
	TORCHNEURON_SKIP_EXT=1 $(PY) -m pip install -q --no-build-isolation -c requirements/constraints.txt -e '.[test,ecosystem,profiler]'
	touch $@

$(EXT): $(TORCH) $(CSRC) setup.py
	# Autoload off: torch must not try to load the extension that is being built.
	flock /tmp/torchneuron-build.lock env MAX_JOBS=2 TORCH_DEVICE_BACKEND_AUTOLOAD=0 $(PY) setup.py -q build_ext --inplace
	touch $@

build: $(EXT)

# Serving extra (docs/serving.md): the exact vLLM set of requirements/vllm.txt, installed with
# --no-deps so pip resolves nothing (no CUDA torchvision/torchaudio/torchcodec, no triton) and,
# with the constraints, can never replace torch. Checked after install.
# Needs only the dependencies, not the extension, so `make test` installs it while the C++ core
# compiles (download vs CPU); the check imports torch with the backend autoload off for that.
$(VLLM): $(DEPS) requirements/vllm.txt requirements/constraints.txt
	$(PY) -m pip install -q --no-deps -c requirements/constraints.txt -r requirements/vllm.txt
	TORCH_DEVICE_BACKEND_AUTOLOAD=0 VLLM_PLUGINS= $(PY) -c "import importlib.util as u, torch, vllm; \
	assert torch.__version__ == '2.13.0+cpu', 'pip replaced torch: ' + torch.__version__; \
	bad = [m for m in ('torchvision', 'torchaudio', 'torchcodec', 'triton') if u.find_spec(m)]; \
	assert not bad, f'remove {bad}: CUDA builds that break import vllm'; \
	assert vllm.__version__ == '0.32.0', vllm.__version__"
	touch $@

vllm: build $(VLLM)

# TorchTitan 0.2.2 imports triton at start-up (no kernel of it runs on neuron). Installed into
# its own directory, which examples/torchtitan/run.sh adds to PYTHONPATH for TorchTitan alone.
$(TITAN_TRITON)/.stamp: $(DEPS)
	$(PY) -m pip install -q --no-deps -c requirements/constraints.txt --target $(TITAN_TRITON) triton==3.7.1
	touch $@

demo: build $(DEPS)
	$(PY) examples/train_gpt.py

# The setup steps run side by side once torch is in: the C++ build is CPU-bound, the installs
# (the project's extras, then vLLM and TorchTitan's triton) mostly download and unpack.
test: $(TORCH)
	$(MAKE) --no-print-directory -j3 build $(VLLM) $(TITAN_TRITON)/.stamp
	# Two xdist workers, one host thread each (two cores, no oversubscription); grouping in
	# tests/conftest.py keeps each file on one worker and every multi-process test on one.
	# --durations: the slowest tests in every CI log, to keep the suite within its 25-minute budget
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup --durations=30 tests
	# The execution engine is on by default, so most ops above queue their kernels: the device
	# tests again with synchronous kernels (what NEURON_LAUNCH_BLOCKING=1 and the profiler run),
	# but for those that set the engine's state themselves (tests/conftest.py: they would run as
	# above). The other directories pass that way too (docs/testing.md) but do not run twice.
	NEURON_LAUNCH_BLOCKING=1 OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup tests/device

bench: build $(VLLM)
	$(PY) bench/eager_overhead.py
	@for b in bench/compile.py bench/precision.py bench/layout.py bench/layers.py bench/rng.py bench/rnn.py bench/engine.py bench/hf_steps.py bench/nki.py bench/nkilib.py bench/collectives.py bench/serving.py bench/ipc.py bench/profiler.py; do \
		if [ -f $$b ]; then $(PY) $$b || exit 1; fi; done

# Mutation testing (docs/testing.md): not part of `make test`. The `mutation` extra (mutmut) is
# installed with the constraints, so pip cannot touch torch; checked after install.
# `make mutation MODULES="platform memory"` runs some modules (list: tools/mutation.py --list).
MUTMUT := $(VENV)/.mutmut-stamp
$(MUTMUT): $(DEPS)
	TORCHNEURON_SKIP_EXT=1 $(PY) -m pip install -q --no-build-isolation -c requirements/constraints.txt -e '.[mutation]'
	$(PY) -c "import importlib.metadata as m; v = m.version('torch'); assert v == '2.13.0+cpu', 'pip replaced torch: ' + v"
	touch $@

mutation: build $(MUTMUT)
	nice -n 10 $(PY) tools/mutation.py $(MODULES)

clean:
	rm -rf build torchneuron/_C*.so *.egg-info mutants
