#!/usr/bin/env bash
# The README's second command: installs what is missing, builds, and runs every test:
# the release build (GCC; CUDA code compiled, not run: no GPU here), its tests and the
# interoperability tests against llama.cpp (built from its source), then the sanitizer build
# (clang, AddressSanitizer + UBSan, with the libFuzzer targets), the fuzzers, and the whole
# suite again under the sanitizers. Stages and their measured times: docs/TESTING.md.
#
# Deterministic: the same commit does the same work and gives the same result. Tests draw
# their random data from a fixed seed; the committed fuzz corpus and past findings
# (fuzz/corpus/<target>/, fuzz/regressions/<target>/) are replayed by the ctest tests
# fuzz_replay_<target> in both builds; each fuzzer then starts from them with a fixed seed
# for a fixed number of runs, not for a wall-clock time. Open-ended random fuzzing is
# scripts/fuzz.sh's job. docs/FUZZING.md.
# Usage: scripts/test.sh [release] [fuzz] [asan]   (the stages to run; default: all three)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/setup.sh
stages=" ${*:-release fuzz asan} "
want() { [[ "$stages" == *" $1 "* ]]; }
export DSV4_TEST_SEED="${DSV4_TEST_SEED:-20260601}"
fuzz_seed="${DSV4_FUZZ_SEED:-1}"
# Runs per target: about 22 s of one core each on the CI machine (they run side by side);
# halved from ~45 s to make room for the llama.cpp interoperability tests (docs/TESTING.md).
fuzz_dir=build-asan/fuzzing
# (server_request parses, renders and tokenizes whole chat requests: ~500 runs/s, where the
# default of 200,000 took 7 minutes.)
declare -A fuzz_runs=([gguf]=200000 [safetensors]=500000 [tokenizer]=125000 [chat]=300000 [output_parser]=200000
                      [server_request]=12500)

# One fuzzer, fixed seed and run count: its log in build-asan/fuzzing/<name>.log, its exit
# status in build-asan/fuzzing/<name>.status. Seeds are listed in name order (-seed_inputs), not read from
# folders, whose order depends on the file system. -use_cmp=0: comparison operands,
# which include addresses that vary with ASLR, do not steer the mutations.
fuzz_fixed() {
  local name="$1" target="${1#fuzz_}" runs
  runs="${DSV4_FUZZ_RUNS:-${fuzz_runs[$target]:-200000}}"
  local seeds="$fuzz_dir/$name.seeds"
  local dirs=()
  for d in "fuzz/corpus/$target" "fuzz/regressions/$target"; do [ -d "$d" ] && dirs+=("$d"); done
  : >"$seeds"
  ((${#dirs[@]} == 0)) || find "${dirs[@]}" -type f | LC_ALL=C sort | paste -sd, >"$seeds"
  local args=(-seed="$fuzz_seed" -runs="$runs" -use_cmp=0 -reload=0 -rss_limit_mb=2048 -max_len=65536
              -timeout=300 -print_final_stats=1 -artifact_prefix="$fuzz_dir/findings/$name-")
  [ -s "$seeds" ] && args+=(-seed_inputs="@$seeds")
  local status=0
  "build-asan/fuzz/$name" "${args[@]}" >"$fuzz_dir/$name.log" 2>&1 || status=$?
  echo "$status" >"$fuzz_dir/$name.status"
}

if want release; then
  echo "== release build"
  ./scripts/build.sh release
  echo "== tests (release)"
  (cd build && ctest --output-on-failure -j "$(nproc)")
  # Issue 12's checks 1 and 2 against llama.cpp itself (docs/TESTING.md): builds libllama from
  # the llama-cpp-python sdist (cached in ~/.cache/dsv4, so only CI's clean machine pays the
  # build), then llama.cpp on dsv4's files and dsv4 on llama.cpp's quantised ones (every
  # published type), with build/dsv4.
  echo "== llama.cpp interoperability (tests/llamacpp: llama.cpp of llama-cpp-python 0.3.36)"
  log=build/llamacpp_interop.log
  if ./tests/llamacpp/run.sh build/dsv4 >"$log" 2>&1; then
    tail -1 "$log"
  else
    grep -E "^(FAIL|llama.cpp interop:)" "$log" || tail -60 "$log"
    echo "llama.cpp interoperability failed: the whole log is $log (reproduce: tests/llamacpp/run.sh build/dsv4)"
    exit 1
  fi
fi

if want fuzz; then
  fuzzers=$(for f in fuzz/fuzz_*.cpp; do basename "$f" .cpp; done)
  echo "== fuzzers (seed $fuzz_seed, a fixed number of runs each)"
  ./scripts/build.sh asan $fuzzers   # only the fuzz targets and the libraries they link
  rm -rf "$fuzz_dir" && mkdir -p "$fuzz_dir/findings"
  for name in $fuzzers; do
    fuzz_fixed "$name" &
    while (($(jobs -rp | wc -l) >= $(nproc))); do wait -n || true; done
  done
  wait
  failed=0
  for name in $fuzzers; do
    # The last stats line without its speed and memory: the same on every run of a commit.
    summary=$(grep -E "^#[0-9]+[[:space:]]+DONE" "$fuzz_dir/$name.log" | tail -1 | sed -E 's/[[:space:]]+exec\/s:.*//')
    echo "$name: ${summary:-no result}"
    if [ "$(cat "$fuzz_dir/$name.status")" != 0 ]; then
      tail -40 "$fuzz_dir/$name.log"
      echo "fuzzer $name found a failure: $(ls "$fuzz_dir"/findings/"$name"-* 2>/dev/null | tr '\n' ' ')"
      echo "  reproduce: build-asan/fuzz/$name FILE; keep it as fuzz/regressions/${name#fuzz_}/ (docs/FUZZING.md)"
      failed=1
    fi
  done
  ((failed == 0)) || exit 1
fi

if want asan; then
  echo "== tests (AddressSanitizer + UBSan)"
  ./scripts/build.sh asan
  (cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j "$(nproc)" -LE "slow")
fi
