# Everything installs itself: `make run` and `make test` work on a fresh machine and are fast when set up.
# `make run` installs what serving needs (tether, llama-cpp-python, the default model); `make test` adds the dev,
# Ray and docs tools, Debian's chromium and systemd-analyze, and Open WebUI in a venv of its own.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# TETHER_GPU: "cuda" builds llama.cpp with NVIDIA's CUDA (layers offloaded to the GPU, see docs/gpu.md), "cpu"
# without; "auto" (the default) is cuda where both nvcc and a working NVIDIA driver are (`nvidia-smi -L`), else cpu.
# CUDA_ARCHITECTURES: the GPUs to compile for ("native": the ones this machine has; e.g. 90 for an H100).
TETHER_GPU ?= auto
CUDA_ARCHITECTURES ?= native
HAVE_CUDA := $(shell command -v nvcc >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)
GPU := $(if $(filter auto,$(TETHER_GPU)),$(if $(HAVE_CUDA),cuda,cpu),$(TETHER_GPU))
ifeq ($(filter cpu cuda,$(GPU)),)
$(error TETHER_GPU must be auto, cpu or cuda, not "$(TETHER_GPU)")
endif
STAMP  := $(VENV)/.tether-installed-$(GPU)
DEV_STAMP := $(VENV)/.tether-dev-installed
# llama-cpp-python builds from source here; skip what tether does not use (pip caches the wheel it builds).
# No AMX on x86: ggml's native build uses AMX tiles wherever the CPU has them, and its AMX matmul segfaults in the
# first decode on this project's Sapphire Rapids VMs (llama_print_system_info says AMX_INT8 = 1); AVX-512 stays.
# GGML_RPC: ggml's RPC backend, which splits one model's layers over the ranks of a multi-rank llama.cpp instance.
NO_AMX := $(if $(filter x86_64,$(shell uname -m)),-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
CUDA_ARGS := $(if $(filter cuda,$(GPU)),-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$(CUDA_ARCHITECTURES))
export CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_RPC=ON $(CUDA_ARGS) $(if $(NO_AMX),'-DCMAKE_C_FLAGS=$(NO_AMX)' '-DCMAKE_CXX_FLAGS=$(NO_AMX)')
# The built library must be the one asked for: CPU or CUDA (libggml-cuda: llama_supports_gpu_offload is true for
# any RPC build), with RPC, without AMX.
WANT_GPU := $(if $(filter cuda,$(GPU)),True,False)
BUILD_OK := import llama_cpp as l, sys; from tether.engines.llamacpp.estimate import gpu_build_missing as m; sys.exit('AMX_INT8 = 1' in l.llama_print_system_info().decode() or not l.llama_supports_rpc() or (m() is None) != $(WANT_GPU))
PROMPT ?= What is the capital of France?

.PHONY: install install-dev browser systemd openwebui run ask check test lint format docs docs-build figures bench clean

install: $(STAMP)

# Serving: tether with its llama extra, and the default model fetched by `tether pull` (what a wheel user runs too).
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[llama]'
	# pip reuses a cached llama-cpp-python wheel by version, whatever CMAKE_ARGS built it: rebuild one that has AMX,
	# lacks RPC or is not the CPU/CUDA build asked for, and cache the rebuilt wheel in its place so the next fresh
	# checkout reuses it.
	$(BIN)/python -c "$(BUILD_OK)" || { \
	  $(BIN)/python -m pip cache remove llama_cpp_python >/dev/null 2>&1; \
	  $(BIN)/python -m pip install --quiet --force-reinstall --no-deps \
	    "llama-cpp-python==$$($(BIN)/python -c 'import llama_cpp; print(llama_cpp.__version__)')"; }
	$(BIN)/python -c "$(BUILD_OK)" || { echo "llama-cpp-python is not the $(GPU) build with GGML_RPC asked for" >&2; exit 1; }
	$(BIN)/python -c "from tether.engines.llamacpp.estimate import gpu_build_missing as m; print('llama.cpp build:', 'CPU only' if m() else 'CUDA (layers offload to NVIDIA GPUs)', '(TETHER_GPU=$(TETHER_GPU))')"
	$(BIN)/tether pull
	touch $(STAMP)

# Developing: the tests' clients and tools, Ray, and the docs site's builder, on top of what serving needs.
install-dev: $(DEV_STAMP)

$(DEV_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[llama,ray,dev,docs]'
	$(BIN)/tether pull gemma3-270m
	$(BIN)/tether build deterministic
	touch $(DEV_STAMP)

# The dashboard's and the docs site's browser tests drive Debian's chromium with Playwright for Python (installed with
# the dev extra; Playwright's own browser download is not used). Only `make test` needs it.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@command -v chromium >/dev/null || { echo "installing Debian's chromium for the browser tests"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium >/dev/null; }

# systemd-analyze (Debian's systemd package; no running systemd needed) checks deploy/tether.service in the tests.
systemd:
	@command -v systemd-analyze >/dev/null || { echo "installing Debian's systemd for systemd-analyze verify"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends systemd >/dev/null; }

# Open WebUI, the chat front end users point at tether (as an Ollama or an OpenAI backend), for the browser test that
# proves a chat works in its default setup. Its own venv: its exact pins never fight tether's. Only `make test` needs
# it. torch==2.13.0 (which sentence-transformers pulls in) resolves to the CPU build on this machine's local disk, not
# a multi-GB CUDA one. ~3.3 min and 2.9 GB on 2 busy cores here; tests/test_open_webui.py skips, saying why, without it.
OPEN_WEBUI       := 0.12.4
OPEN_WEBUI_VENV  := .venv-openwebui
OPEN_WEBUI_STAMP := $(OPEN_WEBUI_VENV)/.installed-$(OPEN_WEBUI)
openwebui: $(OPEN_WEBUI_STAMP)

# The stamp names the version: bumping OPEN_WEBUI reinstalls, other edits of this Makefile do not.
$(OPEN_WEBUI_STAMP):
	test -x $(OPEN_WEBUI_VENV)/bin/python || $(PYTHON) -m venv $(OPEN_WEBUI_VENV)
	$(OPEN_WEBUI_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(OPEN_WEBUI_VENV)/bin/python -m pip install --quiet 'open-webui==$(OPEN_WEBUI)' 'torch==2.13.0'
	$(OPEN_WEBUI_VENV)/bin/python -c "import importlib.metadata as m; print('open-webui', m.version('open-webui'), 'torch', m.version('torch'))"
	touch $(OPEN_WEBUI_STAMP)

# The main job: serve the default model over HTTP (OpenAI- and Ollama-compatible) on 127.0.0.1:$(PORT) until Ctrl-C.
PORT ?= 8000
run: install
	$(BIN)/tether serve --port $(PORT)

# One question, one answer, no server.
ask: install
	$(BIN)/tether run "$(PROMPT)"

# The quick tier, for every change: lint, types, and every test that needs no model, no Ray, no browser, no
# fuzzer and no seconds of waiting (about a minute on 2 cores), on 2 workers, then what runs alone.
QUICK := not model and not cluster and not browser and not fuzz and not slow
check: lint
	$(BIN)/python -m pytest -m "$(QUICK) and not serial" -n 2 --dist worksteal
	$(BIN)/python -m pytest -m "$(QUICK) and serial"

# Everything, what CI runs (the docs site's strict build is one of its tests): what may share the machine on 3
# workers (most tests wait on processes), the real-model decoders (``cores``) one at a time on one of them while the
# other two take the rest, then what runs alone (``serial``: Ray clusters, Open WebUI, and the tests that leave
# orphans on purpose). Every run prints its slowest 10 tests and any over the 45 s bound.
# The suite starts ~1,000 Python processes (workers, runners, the CLI, pytest's own): each reads the bytecode the
# first one wrote instead of compiling tether and the rewritten tests again, also where the environment asks Python
# not to write any (PYTHONDONTWRITEBYTECODE, set on this project's VMs: ~0.1 CPU-s a worker, ~3 s a pytest start).
check test: export PYTHONDONTWRITEBYTECODE :=
test: lint browser systemd openwebui
	$(BIN)/python -m pytest -m "not serial" -n 3 --dist loadgroup
	$(BIN)/python -m pytest -m serial

lint: install-dev
	$(BIN)/ruff check src tests bench docs/gen
	$(BIN)/ruff format --check src tests bench docs/gen
	$(BIN)/mypy

format: install-dev
	$(BIN)/ruff format src tests bench docs/gen
	$(BIN)/ruff check --fix src tests bench docs/gen

# The docs site on http://127.0.0.1:8001, rebuilt as pages change; `docs-build` writes it to site/ (--strict).
docs: install-dev
	$(BIN)/mkdocs serve --dev-addr 127.0.0.1:8001

docs-build: install-dev
	$(BIN)/mkdocs build --strict --site-dir site

# The README's headline figures, rewritten from bench/results (a test fails while they are stale).
figures: install-dev
	$(BIN)/python docs/gen/figures.py --readme

bench: install-dev
	$(BIN)/python bench/ipc.py
	$(BIN)/python bench/orphan_exit.py
	$(BIN)/python bench/detect.py
	$(BIN)/python bench/memory.py
	$(BIN)/python bench/hang.py
	$(BIN)/python bench/cancel.py
	$(BIN)/python bench/chaos.py
	$(BIN)/python bench/fuzz.py
	$(BIN)/python bench/load.py
	$(BIN)/python bench/swap.py
	$(BIN)/python bench/cluster.py
	$(BIN)/python bench/ranks.py
	$(BIN)/python bench/soak.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache src/*.egg-info site dist build
