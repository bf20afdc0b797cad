#!/usr/bin/env bash
# Configures and builds one flavour of dsv4. Usage: scripts/build.sh [release|asan|fuzz] [targets...]
# release -> build/ (GCC; the CUDA backend too when nvcc is present), asan -> build-asan/
# (clang, ASan + UBSan, the tests and the libFuzzer targets: clang builds it in a third of
# GCC's time), fuzz -> build-fuzz/ (clang + libFuzzer, no tests: scripts/fuzz.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
flavour="${1:-release}"; shift || true
jobs="${DSV4_JOBS:-$(nproc)}"
case "$flavour" in
  release) dir=build;      args=(-DCMAKE_BUILD_TYPE=Release) ;;
  asan)    dir=build-asan; args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DDSV4_SANITIZE=ON -DDSV4_FUZZ=ON -DDSV4_BENCH=OFF
                                 -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++) ;;
  fuzz)    dir=build-fuzz; args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DDSV4_FUZZ=ON -DDSV4_TESTS=OFF -DDSV4_BENCH=OFF
                                 -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++) ;;
  *) echo "build.sh: unknown flavour '$flavour' (release, asan, fuzz)" >&2; exit 2 ;;
esac
[ -f "$dir/CMakeCache.txt" ] || cmake -S . -B "$dir" -G Ninja "${args[@]}" >/dev/null
if (($#)); then cmake --build "$dir" -j "$jobs" --target "$@"; else cmake --build "$dir" -j "$jobs"; fi
