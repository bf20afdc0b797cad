#!/usr/bin/env bash
# Builds what the llama.cpp interoperability tests need, once: the llama-cpp-python 0.3.36
# sdist from PyPI (its vendor/llama.cpp is llama.cpp of 2026-10-01, upstream `deepseek4`
# included), unpacked in the cache (never in the repository), its CPU backend, llama-quantize,
# llama-imatrix and our llama_logits. Prints the build folder on its last line.
#   DSV4_CACHE_DIR (default ~/.cache/dsv4) holds the sdist, the source and the build.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
version=0.3.36
cache="${DSV4_CACHE_DIR:-$HOME/.cache/dsv4}"
src="$cache/llama_cpp_python-$version/vendor/llama.cpp"
build="$cache/llamacpp-build-$version"
py="${PYTHON:-python3}"
mkdir -p "$cache"

if [ ! -f "$src/CMakeLists.txt" ]; then
  sdist="$cache/llama_cpp_python-$version.tar.gz"
  if [ ! -f "$sdist" ]; then
    echo "llamacpp: downloading the llama-cpp-python $version sdist" >&2
    "$py" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
      "llama-cpp-python==$version" -d "$cache" >&2
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
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DGGML_OPENMP=OFF -DGGML_CCACHE=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >&2
fi
cmake --build "$build" -j "$(nproc)" --target llama-quantize llama-imatrix llama_logits >&2
echo "$build"
