#!/usr/bin/env bash
# Build llama.cpp's own C++ OpenAI-compatible server (`llama-server`, parallel slots + continuous
# batching) and `llama-bench`: the serving peer of benchmarks/bench_serve.py.
#
# The source is the llama.cpp vendored in the llama-cpp-python sdist (the same version the Python
# binding peer uses), built with cmake. Binaries are installed into
#   ~/.cache/tokenmind/llama.cpp/<version>-<isa-hash>/bin/
# so a second run takes seconds; the last line printed is that bin directory.
#
# The ISA list is explicit and read from /proc/cpuinfo, never -march=native: some hosts advertise AMX
# while the hypervisor does not enable its tile state (SIGILL at the first decode), so AMX is always
# off; AVX-VNNI is on only when the CPU lists avx_vnni (see ../shared/PEERS.md).
#
# `--print-path` only prints the bin directory of an existing build for this CPU (status 1 when there
# is none); benchmarks/bench_serve.py finds llama-server that way.
#
# Environment: PYTHON (interpreter whose pip downloads the sdist; default: the project venv or python3),
# JOBS (parallel compile jobs; default nproc), LLAMA_SERVER_CACHE (cache root), FORCE=1 (rebuild).
set -euo pipefail
PRINT_PATH=
case "${1:-}" in
    --print-path) PRINT_PATH=1 ;;
    "") ;;
    *) echo "usage: bash benchmarks/setup_llama_server.sh [--print-path]" >&2; exit 2 ;;
esac
cd "$(dirname "$0")"
VERSION=0.3.36
CACHE_ROOT=${LLAMA_SERVER_CACHE:-"$HOME/.cache/tokenmind/llama.cpp"}
JOBS=${JOBS:-$(nproc)}
if [ -z "${PYTHON:-}" ]; then
    if [ -x ../.venv/bin/python ]; then PYTHON=../.venv/bin/python; else PYTHON=python3; fi
fi

flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() { [[ "$flags" == *" $1 "* ]]; }
on_if() { if has "$2"; then echo "-D$1=ON"; else echo "-D$1=OFF"; fi; }

ISA=(-DGGML_NATIVE=OFF
     "$(on_if GGML_AVX avx)" "$(on_if GGML_AVX2 avx2)" "$(on_if GGML_BMI2 bmi2)" "$(on_if GGML_FMA fma)"
     "$(on_if GGML_F16C f16c)" "$(on_if GGML_AVX_VNNI avx_vnni)" "$(on_if GGML_AVX512 avx512f)"
     "$(on_if GGML_AVX512_VBMI avx512vbmi)" "$(on_if GGML_AVX512_VNNI avx512_vnni)"
     "$(on_if GGML_AVX512_BF16 avx512_bf16)"
     -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
HASH=$(printf '%s\n' "$VERSION" "${ISA[@]}" | sha256sum | cut -c1-10)
PREFIX="$CACHE_ROOT/$VERSION-$HASH"
BIN="$PREFIX/bin"

if [ -n "$PRINT_PATH" ]; then
    if [ -x "$BIN/llama-server" ]; then echo "$BIN"; exit 0; fi
    echo "llama-server $VERSION is not built for this CPU's ISA yet: run bash benchmarks/setup_llama_server.sh" >&2
    exit 1
fi

if [ -z "${FORCE:-}" ] && [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-bench" ]; then
    echo "llama-server $VERSION already built (${ISA[*]})" >&2
    echo "$BIN"
    exit 0
fi

echo "ISA flags: ${ISA[*]}" >&2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "downloading the llama-cpp-python $VERSION sdist..." >&2
"$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work" >&2
tar xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work"
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -f "$src/CMakeLists.txt" ] || { echo "no vendored llama.cpp in the sdist ($src)" >&2; exit 1; }

start=$(date +%s)
echo "building llama-server and llama-bench with $JOBS jobs (about 15 minutes on 2 cores)..." >&2
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "${ISA[@]}" >&2
cmake --build "$work/build" -j "$JOBS" --target llama-server llama-bench >&2

# Install atomically: build into a temporary prefix, then rename, so an interrupted run leaves no
# half-filled cache directory behind.
mkdir -p "$CACHE_ROOT"
tmp="$PREFIX.tmp.$$"
rm -rf "$tmp"
mkdir -p "$tmp/bin"
cp "$work/build/bin/llama-server" "$work/build/bin/llama-bench" "$tmp/bin/"
# With BUILD_SHARED_LIBS=OFF the binaries are self-contained; copy any shared libs that a build
# configured otherwise would still need.
find "$work/build/bin" -maxdepth 1 -name '*.so*' -exec cp -P {} "$tmp/bin/" \; 2>/dev/null || true
printf '%s\n' "llama-cpp-python $VERSION vendored llama.cpp" "${ISA[@]}" > "$tmp/BUILD_INFO"
echo "build_seconds $(( $(date +%s) - start ))" >> "$tmp/BUILD_INFO"
rm -rf "$PREFIX"
mv "$tmp" "$PREFIX"
"$BIN/llama-server" --version >&2 2>&1 || true
echo "built in $(( $(date +%s) - start )) s" >&2
echo "$BIN"
