#!/usr/bin/env bash
# Create benchmarks/.venv-peers with llama.cpp's Python binding (the batch-1 speed peer of
# peer_llamacpp.py), kept out of the project's own dependencies. The serving peer is llama.cpp's C++
# server, built by setup_llama_server.sh; the binding's own server (one request at a time) is not used.
# Compiling takes ~10 minutes on 2 cores; the built wheel is cached in ~/.cache/tokenmind/wheels so a
# second run takes seconds.
#
# The ISA list is explicit: this CPU advertises AMX but the hypervisor does not enable its tile state,
# and a -march=native build dies with SIGILL at the first decode (see ../shared/PEERS.md).
set -euo pipefail
cd "$(dirname "$0")"
VERSION=0.3.36
VENV=.venv-peers
WHEELS="$HOME/.cache/tokenmind/wheels"
PYTHON=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
if ! ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
    mkdir -p "$WHEELS"
    echo "building llama-cpp-python $VERSION from source (about 10 minutes on 2 cores)..."
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
-DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON \
-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
        "$VENV/bin/pip" wheel --no-cache-dir --no-deps --wheel-dir "$WHEELS" "llama-cpp-python==$VERSION"
fi
"$VENV/bin/pip" install --quiet --find-links "$WHEELS" "llama-cpp-python==$VERSION"
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'ready in', '$PWD/$VENV')"
touch "$VENV/.ready"  # benchmarks/_common.py looks for this
