#!/usr/bin/env bash
# Builds what the llama.cpp interoperability tests need, once: the llama-cpp-python 0.3.36
# sdist from PyPI (its vendor/llama.cpp is llama.cpp of 2026-10-01, upstream `deepseek4`
# included; its sha256 checked), unpacked in the cache (never in the repository), libllama
# with ggml's CPU backend, and our llama_logits and llama_quant over libllama's C API.
# Lean, for CI's time budget (CMakeLists.txt; docs/TESTING.md): no llama-common and no
# upstream tools, only the arithmetic optimised, one CPU variant (ggml's portable x86-64
# default, AVX2 + FMA + F16C: the same code on every machine), no weight repacking
# (llama_logits does not use it). Prints the build folder on its last line.
#   DSV4_CACHE_DIR (default ~/.cache/dsv4) holds the sdist, the source and the build;
#   DSV4_JOBS (default: the core count) the parallel compile jobs.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
version=0.3.36
sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e  # of the sdist on PyPI
cache="${DSV4_CACHE_DIR:-$HOME/.cache/dsv4}"
src="$cache/llama_cpp_python-$version/vendor/llama.cpp"
build="$cache/llamacpp-lean-$version"
py="${PYTHON:-python3}"
mkdir -p "$cache"

if [ ! -f "$src/CMakeLists.txt" ]; then
  sdist="$cache/llama_cpp_python-$version.tar.gz"
  if [ ! -f "$sdist" ]; then
    echo "llamacpp: downloading the llama-cpp-python $version sdist" >&2
    "$py" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
      "llama-cpp-python==$version" -d "$cache" >&2
  fi
  if ! echo "$sha256  $sdist" | sha256sum -c --quiet - >&2; then
    echo "llamacpp: $sdist: sha256 differs from $sha256 (a partial download? delete it and run again)" >&2
    exit 1
  fi
  echo "llamacpp: unpacking $sdist" >&2
  tar -xzf "$sdist" -C "$cache"
fi

# A build configured from another checkout of this folder (a worktree since removed) is
# configured again from here; its objects stay valid (same source, same flags).
if [ -f "$build/CMakeCache.txt" ] && ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$here" "$build/CMakeCache.txt"; then
  rm -rf "$build/CMakeCache.txt" "$build/CMakeFiles" "$build/build.ninja"
fi
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$here" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CPP_SOURCE="$src" \
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DGGML_CPU_REPACK=OFF -DGGML_OPENMP=OFF -DGGML_CCACHE=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >&2
fi
cmake --build "$build" -j "${DSV4_JOBS:-$(nproc)}" --target llama_logits llama_quant >&2
echo "$build"
