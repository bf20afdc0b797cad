#!/usr/bin/env bash
# The README's second command: installs what is missing, builds, and runs every test:
# the release build (CUDA code compiled, not run: no GPU here), the fuzzers for a bounded
# time, and the whole suite again under AddressSanitizer + UBSan.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/setup.sh
fuzz_seconds="${DSV4_FUZZ_SECONDS:-60}"

echo "== release build"
./scripts/build.sh release
echo "== fuzzers (${fuzz_seconds}s each)"
fuzzers=$(for f in fuzz/fuzz_*.cpp; do basename "$f" .cpp; done)
./scripts/build.sh fuzz $fuzzers   # only the fuzz targets and the libraries they link
for f in build-fuzz/fuzz/fuzz_*; do
  [ -x "$f" ] || continue
  name=$(basename "$f")
  work="build-fuzz/corpus-$name"; mkdir -p "$work"
  seeds="fuzz/corpus/${name#fuzz_}"
  "$f" -max_total_time="$fuzz_seconds" -rss_limit_mb=2048 -artifact_prefix="build-fuzz/$name-" -max_len=65536 "$work" ${seeds:+$( [ -d "$seeds" ] && echo "$seeds")} \
    >"build-fuzz/$name.log" 2>&1 || { tail -50 "build-fuzz/$name.log"; echo "fuzzer $name found a failure"; exit 1; }
  grep -E "^Done|#[0-9]+.*DONE" "build-fuzz/$name.log" | tail -1 || true
done
echo "== tests (release)"
(cd build && ctest --output-on-failure -j "$(nproc)")
echo "== llama.cpp interoperability (llama-cpp-python 0.3.36's llama.cpp, built once and cached)"
./tests/llamacpp/run.sh build/dsv4
echo "== tests (AddressSanitizer + UBSan)"
./scripts/build.sh asan
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j "$(nproc)" -LE "slow")
