#!/usr/bin/env bash
# The one script for the CUDA kernels on an H200: builds for sm_90a, runs every GPU check
# (test_cuda) and every CUDA benchmark (cuda_bench_*), writes the logs under $OUT (or
# ./gpu-out) and prints a short table last.
#
#   scripts/gpu.sh prepare   on a machine with the project's build dependencies (no GPU
#                            needed): configures build-cuda with -DDSV4_CUDA=ON (sm_90a),
#                            builds test_cuda and the benchmarks, and stages them with the
#                            shared libraries the GPU machine may lack in build-gpu-bin/.
#   scripts/gpu.sh [run]     on the GPU machine: builds there when the build dependencies
#                            (fmt, GoogleTest, ...) are installed, otherwise runs the staged
#                            binaries from build-gpu-bin/ (bring it along, e.g. the device
#                            tool's carry: ["build-gpu-bin"]); then checks, benchmarks, table.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mode="${1:-run}"
targets=(test_cuda cuda_bench_matvec cuda_bench_moe cuda_bench_prefill cuda_bench_attention)
stage=build-gpu-bin

build() {  # $1: build dir, $2: jobs
  if [ ! -f "$1/CMakeCache.txt" ]; then
    cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSV4_CUDA=ON || return 1
  fi
  cmake --build "$1" -j "$2" --target "${targets[@]}"
}

if [ "$mode" = prepare ]; then
  set -e
  dir="${DSV4_GPU_BUILD_DIR:-build-cuda}"  # any build dir configured with -DDSV4_CUDA=ON
  build "$dir" "${DSV4_JOBS:-2}"
  rm -rf "$stage" && mkdir -p "$stage/lib" "$stage/compat"
  cp "$dir"/tests/test_cuda "$dir"/bench/cuda_bench_* "$stage/"
  # Libraries outside the C runtime and the CUDA toolkit's large ones (cuBLAS comes from the
  # GPU machine's toolkit); libstdc++ separately, used only if the GPU machine's is older.
  for bin in "$stage"/test_cuda "$stage"/cuda_bench_*; do
    ldd "$bin" | awk '/=> \//{print $3}'
  done | sort -u | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|libgcc_s.so*|ld-linux*|libcublas*) ;;
      libstdc++.so*) cp -L "$lib" "$stage/compat/" ;;
      *) cp -L "$lib" "$stage/lib/" ;;
    esac
  done
  du -sh "$stage"
  exit 0
fi

out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
{
  echo "== $(date -u +%FT%TZ) $(uname -m) $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv
  nvcc --version | tail -2
  for h in /usr/include/fmt/format.h /usr/include/gtest/gtest.h /usr/include/nlohmann/json.hpp /usr/include/CLI/CLI.hpp \
           /usr/include/pcre2.h /usr/include/utf8proc.h; do
    [ -e "$h" ] && echo "have $h" || echo "missing $h"
  done
} >"$out/env.txt" 2>&1

bin=""
if [ -e /usr/include/fmt/format.h ] && [ -e /usr/include/gtest/gtest.h ] && [ -e /usr/include/nlohmann/json.hpp ] &&
   [ -e /usr/include/pcre2.h ] && [ -e /usr/include/utf8proc.h ]; then
  echo "== building on this machine (build-gpu)"
  if build build-gpu "$(nproc)" >"$out/build.log" 2>&1; then
    mkdir -p build-gpu/run && cp build-gpu/tests/test_cuda build-gpu/bench/cuda_bench_* build-gpu/run/ && bin=build-gpu/run
  else
    echo "build failed (tail of $out/build.log):"; tail -20 "$out/build.log"
  fi
fi
if [ -z "$bin" ]; then
  [ -x "$stage/test_cuda" ] || { echo "no build dependencies here and no staged $stage/ (run 'scripts/gpu.sh prepare' where they exist)"; exit 1; }
  echo "== build dependencies missing here: using the sm_90a binaries staged in $stage/"
  bin="$stage"
  libs="$PWD/$stage/lib"
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
           "$(python3 -c 'import nvidia.cublas, os; print(os.path.dirname(nvidia.cublas.__file__) + "/lib")' 2>/dev/null)"; do
    [ -n "$d" ] && ls "$d"/libcublasLt.so* >/dev/null 2>&1 && libs="$libs:$d"
  done
  export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if "$bin/test_cuda" --gtest_list_tests 2>&1 | grep -q GLIBCXX; then
    export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$PWD/$stage/compat"
  fi
  ldd "$bin/test_cuda" "$bin/cuda_bench_prefill" >>"$out/env.txt" 2>&1
fi

# One call may not fit every step in the device tool's 10 minutes: DSV4_GPU_CHECKS picks the
# checks ("tests memcheck racecheck", default all three; "" for none) and DSV4_GPU_BENCHES the
# benchmarks (below), e.g. DSV4_GPU_CHECKS=tests DSV4_GPU_BENCHES="" then
# DSV4_GPU_CHECKS="memcheck racecheck" DSV4_GPU_BENCHES=moe in a second call.
checks=" ${DSV4_GPU_CHECKS-tests memcheck racecheck} "
status=0
if [[ "$checks" == *" tests "* ]]; then
  echo "== test_cuda"
  "$bin/test_cuda" --gtest_color=no >"$out/test_cuda.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED  \]|Failure|error|seed" "$out/test_cuda.log" | head -60
fi
if command -v compute-sanitizer >/dev/null && [[ "$checks" == *" memcheck "* ]]; then
  echo "== compute-sanitizer memcheck (small checks)"
  timeout 240 compute-sanitizer --tool memcheck --error-exitcode 3 "$bin/test_cuda" --gtest_color=no \
    --gtest_filter='Types/MatvecTest.OddShapes*:Types/MoeTest.*q2_K_q3_K:Types/MoeTest.*iq2*:Types/PrefillTest.*q2_K:Types/MmqTest.OddShapes*:Types/MmqTest.KSplit*/q8_0:CudaBackendOps.GetRows*:CudaBackendOps.RmsNorm*:CudaBackendOps.HyperConnections:CudaBackendOps.Hadamard*:CudaBackendOps.Route*:CudaBackendOps.CopyRows*:CudaAttentionOps.*:Cases/CudaAttention.*tiny_hca:Cases/CudaIndexer.*tiny' \
    >"$out/memcheck.log" 2>&1
  rc=$?; echo "memcheck exit $rc"; [ $rc -eq 0 ] || { status=1; grep -E "ERROR SUMMARY|Invalid|FAILED" "$out/memcheck.log" | head -10; }
fi
if command -v compute-sanitizer >/dev/null && [[ "$checks" == *" racecheck "* ]]; then
  # Shared-memory hazards of the staged kernels (tensor-core tiles, fused decode experts).
  echo "== compute-sanitizer racecheck (shared-memory kernels)"
  timeout 240 compute-sanitizer --tool racecheck --error-exitcode 3 "$bin/test_cuda" --gtest_color=no \
    --gtest_filter='Types/MmqTest.OddShapes*/q2_K:Types/MmqTest.KSplit*/q3_K:MoeDecode.*' \
    >"$out/racecheck.log" 2>&1
  rc=$?; echo "racecheck exit $rc"; [ $rc -eq 0 ] || { status=1; grep -E "ERROR SUMMARY|Race|FAILED" "$out/racecheck.log" | head -10; }
fi
# DSV4_GPU_BENCHES="matvec moe" runs only those benchmarks (unset: all four; "": none).
for b in matvec:420 moe:300 prefill:120 attention:180; do
  name=${b%%:*}; limit=${b##*:}
  case " ${DSV4_GPU_BENCHES-matvec moe prefill attention} " in *" $name "*) ;; *) continue ;; esac
  echo "== cuda_bench_$name"
  timeout "$limit" "$bin/cuda_bench_$name" >"$out/bench_$name.log" 2>&1 || { status=1; echo "cuda_bench_$name failed:"; tail -5 "$out/bench_$name.log"; }
done

echo
echo "== table (value, ratio: matvec GB/s over the copy bandwidth; moe decode us, byte bound over time;"
echo "   moe batched us, weight GB/s over the read bandwidth; prefill TFLOP/s over cuBLAS BF16;"
echo "   attention us, the byte or FLOP bound over time)"
cat "$out"/bench_*.log 2>/dev/null | grep '^TABLE|' | tee "$out/table.txt" |
  awk -F'|' '{printf "%-9s %-52s %10s %-7s %6s  %s\n", $2, $3, $4, $5, $6, $7}'
[ -f "$out/test_cuda.log" ] && grep -E "^\[  (PASSED|FAILED) " "$out/test_cuda.log"
exit $status
