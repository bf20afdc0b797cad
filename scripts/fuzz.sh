#!/usr/bin/env bash
# Open-ended fuzzing, run on purpose (CI's fuzzing is fixed and short: scripts/test.sh).
# Usage: scripts/fuzz.sh [-t SECONDS] [-j JOBS] [TARGET...]
#   TARGET: gguf, safetensors, tokenizer, chat, output_parser (default: all), one after the other
#   -t: seconds per target (default 600); -j: fuzzing processes per target (default 1)
# Each target starts from its committed corpus and past findings plus its own working
# corpus (build-fuzz/work/<target>/, kept between runs), with a fresh random seed (printed
# and logged in build-fuzz/work/<target>.log). It keeps going after a crash, leak, timeout or
# out-of-memory; every finding is saved in build-fuzz/findings/<target>/. To keep one:
# minimise it, commit it under fuzz/regressions/<target>/ (for GGUF, also as a named case of
# tests/data/make_malformed_gguf.py with its expected message), fix the bug, and check
# `ctest -R fuzz_replay_<target>` in build/ and build-asan/. docs/FUZZING.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
seconds=600
jobs=1
while getopts "t:j:h" opt; do
  case "$opt" in
    t) seconds="$OPTARG" ;;
    j) jobs="$OPTARG" ;;
    *) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
targets=("$@")
if ((${#targets[@]} == 0)); then
  for f in fuzz/fuzz_*.cpp; do t=$(basename "$f" .cpp); targets+=("${t#fuzz_}"); done
fi
for t in "${targets[@]}"; do
  [ -f "fuzz/fuzz_$t.cpp" ] || { echo "fuzz.sh: no fuzz target '$t' (fuzz/fuzz_$t.cpp)" >&2; exit 2; }
done

./scripts/build.sh fuzz "${targets[@]/#/fuzz_}"
found=0
for t in "${targets[@]}"; do
  work="build-fuzz/work/$t"; findings="build-fuzz/findings/$t"
  mkdir -p "$work" "$findings"
  seed=$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')
  ((seed > 0)) || seed=1
  before=$(ls "$findings" | wc -l)
  echo "== fuzz_$t: ${seconds}s, $jobs process(es), seed $seed (log: $work.log)"
  dirs=("$work")
  for d in "fuzz/corpus/$t" "fuzz/regressions/$t"; do [ -d "$d" ] && dirs+=("$d"); done
  # Fork mode survives findings; the working corpus (first folder) collects new inputs.
  "build-fuzz/fuzz/fuzz_$t" -seed="$seed" -max_total_time="$seconds" -fork="$jobs" -ignore_crashes=1 \
    -ignore_ooms=1 -ignore_timeouts=1 -rss_limit_mb=2048 -max_len=65536 -timeout=30 \
    -artifact_prefix="$findings/" "${dirs[@]}" >"$work.log" 2>&1 || true
  grep -E "DONE|^#[0-9]+" "$work.log" | tail -1 || true
  after=$(ls "$findings" | wc -l)
  if ((after > before)); then
    found=1
    echo "  $((after - before)) new finding(s) in $findings/:"
    ls -t "$findings" | head -n $((after - before)) | sed "s|^|    |"
    echo "  reproduce: build-fuzz/fuzz/fuzz_$t $findings/FILE"
    echo "  minimise:  build-fuzz/fuzz/fuzz_$t -minimize_crash=1 -runs=10000 -exact_artifact_path=min FILE"
  fi
done
if ((found)); then
  echo "fuzz.sh: findings to keep go to fuzz/regressions/<target>/ with their fix (docs/FUZZING.md)"
  exit 1
fi
echo "fuzz.sh: no findings"
