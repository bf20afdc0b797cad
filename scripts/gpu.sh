#!/usr/bin/env bash
# The one script for the GPU: every CUDA check, the kernel benchmarks, dsv4 on the full
# V4-Flash geometry and llama.cpp beside it on the same file, in one call of at most ~9
# minutes on one H200, with a short table last (docs/PERFORMANCE.md, "How the model is
# measured").
#
#   scripts/gpu.sh prepare   here (the project's build dependencies, no GPU needed): builds
#                            build-cuda for sm_90a (test_cuda, the cuda_bench_* programs,
#                            dsv4) and packs them with the shared libraries the GPU machine
#                            lacks into build-gpu-bin/stage.tar.xz; downloads the llama-cpp-python 0.3.36
#                            sdist (its vendor/llama.cpp, the peer) and packs its source,
#                            without docs and models, in build-gpu-llama/ (never committed).
#                            Prints the sizes: the device tool carries at most 64 MiB.
#   scripts/gpu.sh [run]     on the GPU machine, with build-gpu-bin and build-gpu-llama
#                            carried: the steps below, logs and results under $OUT.
#
# Steps (DSV4_GPU_STEPS, default all, in this order; the llama.cpp build runs in the
# background from the start while the checks run):
#   tests      test_cuda (every GPU check; DSV4_GPU_TEST_FILTER: a gtest filter)
#   memcheck   compute-sanitizer memcheck on a subset (DSV4_GPU_MEMCHECK: a gtest filter)
#   racecheck  compute-sanitizer racecheck on the shared-memory kernels (DSV4_GPU_RACECHECK)
#              (DSV4_GPU_CHECKS, as before, picks among these three: "" for none)
#   llama      llama.cpp's CUDA build (sm_90a, llama-bench only), then llama-bench decode and
#              prefill on a cut of the geometry it loads (DSV4_GPU_CUT_LAYERS, default 4
#              layers, trunk only, q2k types) and dsv4 bench on the same file, as ratios
#   flash      dsv4 synth --fill random-blocks of the whole V4-Flash geometry (43 layers, q2k
#              types) into /dev/shm and dsv4 bench on it: decode at 4K/32K/128K, aggregate
#              decode of 16 and 64 sequences at 4K, prefill of 8K and 32K
#   spec       dsv4 bench --parts spec on the same file (it has its MTP block): MTP speculation's
#              verify, draft and rollback costs at batch 1 and 16 (issue 15; DSV4_GPU_SPEC_SHARED=1
#              again at batch 1 on the file written with --routing shared); the same and
#              decode at 1/16/64 sequences with --batch-invariant (its cost); dsv4 run
#              --spec 3 against --spec 0 (DSV4_GPU_SPEC_MODES: exact fast invariant)
#   serve      dsv4 serve --backend cuda on the same file, 1/16/64 streaming clients
#              (bench/bench_serve_load.py: time to first token, per output token, tok/s)
#   profile    ncu's per-kernel GPU time of decode steps (no graphs; 1 and 16 sequences) and a
#              prefill chunk on a 4-layer cut of the geometry (DSV4_GPU_PROFILE_LAYERS; 4 holds
#              a window, a CSA and an HCA layer): profile.txt, the kernels by total time
#              (DSV4_GPU_PROFILE_PARTS: "decode prefill batch" by default; "verify" adds an MTP
#              verify step of 4 rows, one sequence (the file then has its MTP block); "batch64" a
#              decode step of 64 sequences; "moe" adds ncu's
#              sections for the wgmma expert kernels of one 4096-token layer, "decode_detail"
#              those of a decode step's heaviest small kernels, "batch_detail" those of the
#              16-row int8 tensor-core products of a 16-sequence step, "hc_source" hc_pre's stall
#              samples per instruction)
#   upstream   issue 12's check 3: llama.cpp's own converter (convert_hf_to_gguf.py, torch) turns
#              a synthetic official checkpoint into a trunk and an MTP sidecar, and dsv4 and
#              llama.cpp's logits on it are compared (tests/llamacpp/upstream_convert.sh; needs
#              build-gpu-llama/upstream.tar.gz from prepare)
#   kernels    the kernel benchmarks (cuda_bench_*; DSV4_GPU_BENCHES names a subset, "" none)
# Other settings: DSV4_GPU_BIN (a folder of binaries to use instead), DSV4_GPU_BUILD=0 (use
# the staged binaries even where the build dependencies exist), DSV4_GPU_SHM (where the
# model files go, /dev/shm), DSV4_GPU_FLASH_LAYERS (43), DSV4_GPU_WORK (/tmp/dsv4-gpu);
# DSV4_GPU_FLASH_PARTS / _DEPTHS / _PREFILL (the flash figures), DSV4_GPU_SPEC_DEFAULT=0 (no default-kernel
# spec part), DSV4_GPU_INVARIANT=0 (no --batch-invariant figures), DSV4_GPU_INVARIANT_BATCHES
# (16,64), DSV4_GPU_SPEC_RUN=0 (no dsv4 run comparison), DSV4_GPU_LANES_OFF=1 (decode again with
# the backend's lanes off, DSV4_CUDA_LANES=0), DSV4_GPU_HC_CLUSTER_OFF=1 (decode again with a
# site's mixes and hc_pre as two kernels, DSV4_CUDA_HC_CLUSTER=0), DSV4_GPU_MOE_STAGE_BYTES="8192 ..."
# (decode again with the decode experts' stages of that many bytes), DSV4_GPU_BASELINE=1 (decode
# again with the baseline dsv4 that prepare staged from DSV4_GPU_BASELINE_DIR), DSV4_GPU_MOE_VARIANTS="1 2"
# (decode again with the decode experts' kernel variant, DSV4_MOE_DECODE_VARIANT),
# DSV4_GPU_LEGACY_RUNS="bulk f32tiles" (decode again with each set of kernels switched back;
# DSV4_GPU_LEGACY_PARTS: which bench parts, default decode,aggregate), DSV4_GPU_SPLIT_RUNS="3 6"
# (prefill again with the Float32 products split into BF16 terms; DSV4_GPU_SPLIT_PARTS).
# Every step has a time cap and the call a budget (DSV4_GPU_BUDGET seconds, default 550):
# a step gets what is left of it at most, so one that hangs cannot eat the call. With the
# peer or the whole geometry in the call, the checks get the llama.cpp build's time (the
# first DSV4_GPU_CHECKS_SECONDS, 220) and the kernel benchmarks what remains at the end;
# e.g. DSV4_GPU_STEPS="tests memcheck racecheck kernels" in a second call runs those fully. What comes back
# ($OUT holds at most 8 files): table.txt, steps.txt, the dsv4 and llama-bench JSON files
# and logs.tar.gz with every log, refreshed after each step.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mode="${1:-run}"
stage=build-gpu-bin
llama_stage=build-gpu-llama
llama_version=0.3.36

cuda_targets() {
  local t=(test_cuda dsv4_cli) f
  for f in bench/cuda/bench_*.cu; do t+=("cuda_$(basename "$f" .cu)"); done
  echo "${t[@]}"
}

build() {  # $1: build dir, $2: jobs
  if [ ! -f "$1/CMakeCache.txt" ]; then
    cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDSV4_CUDA=ON || return 1
  fi
  # shellcheck disable=SC2046
  cmake --build "$1" -j "$2" --target $(cuda_targets)
}

# The peer's source: the sdist's vendor/llama.cpp without what a CUDA build of llama-bench
# does not read (documentation, model vocabularies, the web UI and server, tests, examples).
stage_llama() {
  local cache="${DSV4_CACHE_DIR:-$HOME/.cache/dsv4}" tmp src
  local sdist="$cache/llama_cpp_python-$llama_version.tar.gz"
  mkdir -p "$cache" "$llama_stage"
  if [ ! -f "$sdist" ]; then
    python3 -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
      "llama-cpp-python==$llama_version" -d "$cache" || return 1
  fi
  tmp="$(mktemp -d)"
  tar -xzf "$sdist" -C "$tmp" || return 1
  src="$tmp/llama_cpp_python-$llama_version/vendor/llama.cpp"
  rm -rf "$src"/{docs,models,media,examples,pocs,tests,benches,app,gguf-py,conversion,.github,.devops} \
         "$src"/tools/{ui,server} "$src"/vendor/miniaudio/*.h \
         "$src"/ggml/src/ggml-{cann,et,hexagon,metal,opencl,openvino,sycl,virtgpu,vulkan,webgpu,zdnn,zendnn}
  tar -czf "$llama_stage/llama.cpp.tar.gz" -C "$(dirname "$src")" llama.cpp || return 1
  rm -rf "$tmp"
}

# Issue 12's check 3 on the GPU machine (it has torch): llama.cpp's converter (the script,
# its conversion/ package and gguf-py, pure Python) and llama_logits, our program over the
# CPU build of libllama (tests/llamacpp/build.sh, built here).
stage_upstream() {
  local cache="${DSV4_CACHE_DIR:-$HOME/.cache/dsv4}" src lbuild
  src="$cache/llama_cpp_python-$llama_version/vendor/llama.cpp"
  lbuild="$(bash tests/llamacpp/build.sh | tail -1)" || return 1
  tar -czf "$llama_stage/upstream.tar.gz" -C "$src" convert_hf_to_gguf.py conversion gguf-py \
    -C "$lbuild" llama_logits llama_quant || return 1
}

if [ "$mode" = prepare ]; then
  set -e
  dir="${DSV4_GPU_BUILD_DIR:-build-cuda}"  # any build dir configured with -DDSV4_CUDA=ON
  build "$dir" "${DSV4_JOBS:-2}"
  # Binaries and libraries go into one gzip archive: device code compresses 3-5x, and the
  # device tool carries 64 MiB.
  files="$(mktemp -d)"
  mkdir -p "$files/lib" "$files/compat"
  # DSV4_GPU_STAGE_BENCHES: the kernel benchmarks to stage (default all; each binary carries
  # every kernel's device code, ~60 MB, so a carry near the limit stages fewer).
  for b in ${DSV4_GPU_STAGE_BENCHES:-$(cd "$dir/bench" && ls cuda_bench_* | sed 's/^cuda_bench_//')}; do
    cp "$dir/bench/cuda_bench_$b" "$files/"
  done
  cp "$dir"/tests/test_cuda "$dir"/dsv4 "$files/"
  strip --strip-unneeded "$files"/test_cuda "$files"/cuda_bench_* "$files"/dsv4 2>/dev/null || true
  # Libraries outside the C runtime and the CUDA toolkit's large ones (cuBLAS comes from the
  # GPU machine's toolkit); libstdc++ separately, used only if the GPU machine's is older.
  for bin in "$files"/test_cuda "$files"/cuda_bench_* "$files"/dsv4; do
    ldd "$bin" | awk '/=> \//{print $3}'
  done | sort -u | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libdl.so*|librt.so*|libpthread.so*|libgcc_s.so*|ld-linux*|libcublas*) ;;
      libstdc++.so*) cp -L "$lib" "$files/compat/" ;;
      *) cp -L "$lib" "$files/lib/" ;;
    esac
  done
  rm -rf "$stage" && mkdir -p "$stage"
  # xz: device code compresses about 6x (gzip: 4x), and the device tool carries 64 MiB.
  XZ_OPT="-6 -T${DSV4_JOBS:-2}" tar -cJf "$stage/stage.tar.xz" -C "$files" .
  (cd "$files" && ls -l . lib compat) >"$stage/contents.txt"
  rm -rf "$files"
  # DSV4_GPU_BASELINE_DIR: a second build dir (say main before a change, with the same
  # libraries) whose dsv4 is staged as the baseline (DSV4_GPU_BASELINE=1 in the run).
  if [ -n "${DSV4_GPU_BASELINE_DIR:-}" ]; then
    files="$(mktemp -d)"
    cp "$DSV4_GPU_BASELINE_DIR/dsv4" "$files/" && strip --strip-unneeded "$files/dsv4"
    git -C "$DSV4_GPU_BASELINE_DIR/.." rev-parse --short HEAD >"$files/COMMIT" 2>/dev/null || echo unknown >"$files/COMMIT"
    XZ_OPT="-6 -T${DSV4_JOBS:-2}" tar -cJf "$stage/baseline.tar.xz" -C "$files" .
    rm -rf "$files"
  fi
  # DSV4_GPU_STAGE_PEER=0: without the peer's source and the upstream check's programs (calls
  # without the llama and upstream steps).
  if [ "${DSV4_GPU_STAGE_PEER:-1}" = 1 ]; then
    stage_llama
    stage_upstream
  fi
  mkdir -p "$llama_stage"
  du -sh "$stage" "$llama_stage"
  total=$(du -cb "$stage" "$llama_stage" | tail -1 | cut -f1)
  tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  echo "carried: $(( (total + tree) >> 20 )) MiB of the device tool's 64 (tracked files $(( tree >> 20 )) MiB)"
  [ $((total + tree)) -lt $((62 << 20)) ] || { echo "too large to carry"; exit 1; }
  exit 0
fi

# ---- on the GPU machine ------------------------------------------------------------------
out="${OUT:-$PWD/gpu-out}"
work="${DSV4_GPU_WORK:-/tmp/dsv4-gpu}"
shm="${DSV4_GPU_SHM:-/dev/shm}"
steps=" ${DSV4_GPU_STEPS:-${DSV4_GPU_CHECKS-tests memcheck racecheck} llama flash spec serve profile upstream kernels} "
budget="${DSV4_GPU_BUDGET:-550}"
cut_layers="${DSV4_GPU_CUT_LAYERS:-4}"
mkdir -p "$out" "$work"
rm -f "$work"/*.log "$work"/*.json "$work"/*.txt
start=$SECONDS
has() { case "$steps" in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
left() { echo $((budget - (SECONDS - start))); }
# Seconds kept for the whole-geometry step while the steps before it run.
reserve=0
has flash && reserve="${DSV4_GPU_FLASH_RESERVE:-200}"
# With the peer or the whole geometry in the call, the checks run while llama.cpp builds and
# end with that phase (DSV4_GPU_CHECKS_SECONDS after the start); alone they have the budget.
phase=$budget
{ has llama || has flash; } && phase="${DSV4_GPU_CHECKS_SECONDS:-220}"
# The time a step may take: its cap, or what is left of the budget (less the reserve and a
# margin for the table), whichever is smaller.
cap() { local l; l=$(($(left) - 15 - reserve)); echo $(($1 < l ? $1 : l)); }
check_cap() { local c l; c=$(cap "$1"); l=$((phase - (SECONDS - start))); echo $((c < l ? c : l)); }

# What comes back, refreshed after each step (at most 8 files under $OUT).
refresh_out() {
  cat "$work"/*.log 2>/dev/null | grep -a '^TABLE|' >"$work/table.txt"
  cp "$work/table.txt" "$work/steps.txt" "$out/" 2>/dev/null
  for j in dsv4_flash dsv4_cut llama_bench; do [ -f "$work/$j.json" ] && cp "$work/$j.json" "$out/"; done
  [ -f "$work/profile.txt" ] && cp "$work/profile.txt" "$out/"
  tar -czf "$out/logs.tar.gz" -C "$work" $(cd "$work" && ls ./*.log ./*.txt ./*.json ./*.csv 2>/dev/null)
}
# step NAME CAP COMMAND...: runs with a time cap, output in $work/NAME.log, status in steps.txt.
step() {
  local name=$1 limit t0 rc
  case "$2" in check:*) limit=$(check_cap "${2#check:}") ;; *) limit=$(cap "$2") ;; esac
  shift 2
  if [ "$limit" -lt 10 ]; then
    echo "$name skipped: no time left for it" | tee -a "$work/steps.txt"
    return 1
  fi
  echo "== $name (at $((SECONDS - start)) s, cap $limit s)"
  t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$work/$name.log" 2>&1
  rc=$?
  local what=ok
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && what="timed out"
  [ $rc -ne 0 ] && [ "$what" = ok ] && what="failed"
  echo "$name: $what (exit $rc, $((SECONDS - t0)) s)" | tee -a "$work/steps.txt"
  [ $rc -eq 0 ] || tail -5 "$work/$name.log"
  refresh_out
  return $rc
}

{
  echo "== $(date -u +%FT%TZ) $(uname -m) $(hostname), $(nproc) cores"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv
  nvcc --version | tail -2
  cmake --version | head -1
  free -g
  df -h "$shm" /tmp
} >"$work/env.log" 2>&1
: >"$work/steps.txt"

# The binaries: DSV4_GPU_BIN's, else built here when the build dependencies exist, else
# the staged ones.
bin="${DSV4_GPU_BIN:-}"
if [ -z "$bin" ] && [ "${DSV4_GPU_BUILD:-auto}" != 0 ] && [ -e /usr/include/fmt/format.h ] && [ -e /usr/include/gtest/gtest.h ] && [ -e /usr/include/nlohmann/json.hpp ] &&
   [ -e /usr/include/pcre2.h ] && [ -e /usr/include/utf8proc.h ] && [ -e /usr/include/CLI/CLI.hpp ]; then
  echo "== building on this machine (build-gpu)"
  if build build-gpu "$(nproc)" >"$work/build.log" 2>&1; then
    mkdir -p build-gpu/run && cp build-gpu/tests/test_cuda build-gpu/bench/cuda_bench_* build-gpu/dsv4 build-gpu/run/ &&
      bin=build-gpu/run
  else
    echo "build failed (tail of build.log):"; tail -20 "$work/build.log"
  fi
fi
if [ -z "$bin" ]; then
  [ -f "$stage/stage.tar.xz" ] || { echo "no build dependencies here and no $stage/stage.tar.xz (run 'scripts/gpu.sh prepare' where they exist)"; exit 1; }
  rm -rf "$work/stage" && mkdir -p "$work/stage" && tar -xJf "$stage/stage.tar.xz" -C "$work/stage" || exit 1
  echo "== using the sm_90a binaries staged in $stage/"
  bin="$work/stage"
  libs="$bin/lib"
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
           "$(python3 -c 'import nvidia.cublas, os; print(os.path.dirname(nvidia.cublas.__file__) + "/lib")' 2>/dev/null)"; do
    [ -n "$d" ] && ls "$d"/libcublasLt.so* >/dev/null 2>&1 && libs="$libs:$d"
  done
  export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if "$bin/test_cuda" --gtest_list_tests 2>&1 | grep -q GLIBCXX; then
    export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$bin/compat"
  fi
  ldd "$bin/test_cuda" "$bin/dsv4" >>"$work/env.log" 2>&1
fi
bin="$(cd "$bin" && pwd)"

# ---- the peer's build, in the background from the start ----------------------------------
# In a session of its own (setsid), so that stopping it stops every compiler it started.
llama_pid=""
llama_bin="$work/llama/build/bin/llama-bench"
stop_llama_build() {
  [ -n "$llama_pid" ] && kill -0 "$llama_pid" 2>/dev/null && kill -- -"$llama_pid" 2>/dev/null
  return 0
}
trap stop_llama_build EXIT
if has llama; then
  if [ -f "$llama_stage/llama.cpp.tar.gz" ]; then
    cat >"$work/llama_build.sh" <<BUILD
set -ex
rm -rf "$work/llama" && mkdir -p "$work/llama"
tar -xzf "$PWD/$llama_stage/llama.cpp.tar.gz" -C "$work/llama"
cmake -S "$work/llama/llama.cpp" -B "$work/llama/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \\
  -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DGGML_NATIVE=ON -DGGML_OPENMP=OFF -DGGML_CCACHE=OFF \\
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \\
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
cmake --build "$work/llama/build" -j "$(nproc)" --target llama-bench
BUILD
    setsid bash "$work/llama_build.sh" >"$work/llama_build.log" 2>&1 &
    llama_pid=$!
    echo "== llama.cpp $llama_version: CUDA build of llama-bench started in the background"
  else
    echo "llama: no $llama_stage/llama.cpp.tar.gz (run 'scripts/gpu.sh prepare' and carry $llama_stage)" |
      tee -a "$work/steps.txt"
  fi
fi

# ---- checks (no timing: they share the machine with the build) ---------------------------
if has tests; then
  step test_cuda check:300 "$bin/test_cuda" --gtest_color=no --gtest_filter="${DSV4_GPU_TEST_FILTER:-*}"
  grep -aE "^\[  (PASSED|FAILED) |^\[  FAILED  \]" "$work/test_cuda.log" | head -40
fi
if command -v compute-sanitizer >/dev/null; then
  memcheck="${DSV4_GPU_MEMCHECK:-Types/MatvecTest.OddShapes*:Types/MoeTest.*q2_K_q3_K:MoeWgmma.*:Types/MoeTest.*iq2*:Types/PrefillTest.*q2_K:Types/MmqTest.OddShapes*:Types/MmqTest.KSplit*/q8_0:CudaBackendOps.GetRows*:CudaBackendOps.RmsNorm*:CudaBackendOps.HyperConnections*:CudaMatmul.Grouped*:CudaMatmul.Float32FewRows*:CudaBackendOps.Hadamard*:CudaBackendOps.FinishRows*:CudaMatmul.MatmulMany*:CudaBackendAttention.CompressEntries*:CudaBackendOps.Route*:CudaBackendOps.CopyRows*:CudaAttentionOps.*:Cases/CudaAttention.*tiny_hca:Cases/CudaIndexer.*tiny}"
  # Shared-memory hazards of the staged kernels (tensor-core tiles, fused decode experts).
  racecheck="${DSV4_GPU_RACECHECK:-Types/MmqTest.OddShapes*/q2_K:Types/MmqTest.KSplit*/q3_K:MoeDecode.*:MoeWgmma.*:CudaBackendOps.FinishRows*:CudaBackendAttention.CompressEntries*}"
  if has memcheck; then
    step memcheck check:240 compute-sanitizer --tool memcheck --error-exitcode 3 "$bin/test_cuda" --gtest_color=no \
      --gtest_filter="$memcheck"
    grep -aE "ERROR SUMMARY|^\[  (PASSED|FAILED) " "$work/memcheck.log" | head -5
  fi
  if has racecheck; then
    step racecheck check:240 compute-sanitizer --tool racecheck --error-exitcode 3 "$bin/test_cuda" --gtest_color=no \
      --gtest_filter="$racecheck"
    grep -aE "ERROR SUMMARY|RACECHECK SUMMARY|^\[  (PASSED|FAILED) " "$work/racecheck.log" | head -5
  fi
fi

# Room in $shm for a synthetic file (dsv4 synth flags): /dev/shm holds half the RAM by
# default, so it is grown (as root) when the file would not fit. Prints the number of
# layers that fit (the flags' own when the file fits).
shm_layers() {
  local layers=$1 need have mem; shift
  need=$("$bin/dsv4" synth "$@" --layers "$layers" --dry-run -o "$shm/probe.gguf" |
         sed -n 's/.* \([0-9]*\) bytes of tensor data.*/\1/p')
  [ -n "$need" ] || { echo "$layers"; return; }
  have=$(df -B1 --output=avail "$shm" | tail -1)
  if [ "$have" -lt $((need + (2 << 30))) ]; then
    mem=$(awk '/MemTotal/{print $2 * 1024}' /proc/meminfo)
    mount -o remount,size=$((mem * 92 / 100)) "$shm" >&2 &&
      echo "$shm grown to $((mem * 92 / 100 >> 30)) GiB for $((need >> 30)) GiB" >&2
    have=$(df -B1 --output=avail "$shm" | tail -1)
  fi
  if [ "$have" -lt $((need + (2 << 30))) ]; then
    layers=$((layers * (have - (4 << 30)) / need))
    echo "$shm has $((have >> 30)) GiB for $((need >> 30)) GiB: cut to $layers layers" >&2
  fi
  echo "$layers"
}

# ---- the peer: llama.cpp and dsv4 on the same cut of the geometry ------------------------
cut="$shm/dsv4-flash$cut_layers.gguf"
if has llama; then
  step synth_cut 90 "$bin/dsv4" synth --preset flash --layers "$cut_layers" --no-mtp --recipe q2k \
    --fill random-blocks --seed 1 --force -o "$cut"
  grep -a "wrote" "$work/synth_cut.log"
  if [ -n "$llama_pid" ]; then
    echo "== waiting for the llama.cpp build (at $((SECONDS - start)) s)"
    # The peer's two runs need about 100 s after the build.
    while kill -0 "$llama_pid" 2>/dev/null && [ "$(cap 1000)" -gt 100 ]; do sleep 2; done
    if kill -0 "$llama_pid" 2>/dev/null; then
      stop_llama_build
      echo "llama_build: stopped, over its share of the budget (at $((SECONDS - start)) s)" | tee -a "$work/steps.txt"
    else
      wait "$llama_pid"; rc=$?
      echo "llama_build: $([ $rc -eq 0 ] && echo ok || echo failed) (exit $rc, done at $((SECONDS - start)) s)" |
        tee -a "$work/steps.txt"
      [ $rc -eq 0 ] || tail -20 "$work/llama_build.log"
    fi
    refresh_out
  fi
  if [ -x "$llama_bin" ] && [ -f "$cut" ]; then
    step llama_bench 120 sh -c "'$llama_bin' -m '$cut' -ngl 99 -p 2048 -n 64 -d 0,4096,32768 -r 3 -o json \
      >'$work/llama_bench.json'"
    python3 -c "import json,sys; [print(f\"{t['n_prompt']:>5} {t['n_gen']:>3} d={t['n_depth']:<6} {t['avg_ts']:9.1f} tok/s\") for t in json.load(open(sys.argv[1]))]" \
      "$work/llama_bench.json" 2>/dev/null
  fi
  if [ -f "$cut" ]; then
    step dsv4_cut 120 "$bin/dsv4" bench -m "$cut" --backend cuda --label "flash$cut_layers" \
      --parts decode,prefill --depths 0,4096,32768 --prefill 2048 --chunk 2048 --json "$work/dsv4_cut.json"
    grep -a '^TABLE|' "$work/dsv4_cut.log" | cut -d'|' -f3-6
  fi
  if [ -f "$work/llama_bench.json" ] && [ -f "$work/dsv4_cut.json" ]; then
    step peer 20 python3 scripts/bench_peer.py "$work/llama_bench.json" "$work/dsv4_cut.json"
  fi
  rm -f "$cut"  # room for the whole geometry
fi
stop_llama_build
reserve=0

# ---- dsv4 on the whole V4-Flash geometry -------------------------------------------------
if has flash || has serve || has spec; then
  # With its MTP block, for the speculation figures (issue 15); the peer's cut above has none.
  flash_flags=(--preset flash --recipe q2k --fill random-blocks --seed 1)
  layers=$(shm_layers "${DSV4_GPU_FLASH_LAYERS:-43}" "${flash_flags[@]}")
  flash="$shm/dsv4-flash$layers.gguf"
  step synth_flash 120 "$bin/dsv4" synth "${flash_flags[@]}" --layers "$layers" --force -o "$flash"
  grep -a "wrote" "$work/synth_flash.log"
  if has flash && [ -f "$flash" ]; then
    step dsv4_flash 300 "$bin/dsv4" bench -m "$flash" --backend cuda --label "flash$layers" \
      --parts "${DSV4_GPU_FLASH_PARTS:-prefill,decode,aggregate}" \
      --depths "${DSV4_GPU_FLASH_DEPTHS:-4096,32768,131072}" --batches 16,64 --batch-depth 4096 --prefill "${DSV4_GPU_FLASH_PREFILL:-8192,32768}" --chunk 4096 \
      --steps 16 --repeats 3 --prefill-repeats 1 --json "$work/dsv4_flash.json"
    grep -a '^TABLE|' "$work/dsv4_flash.log" | cut -d'|' -f3-6
  fi
  # DSV4_GPU_LANES_OFF=1: decode and aggregate decode at 4K with every op on one stream
  # (DSV4_CUDA_LANES=0), beside the figures above: what the backend's lanes gain.
  if [ "${DSV4_GPU_LANES_OFF:-0}" = 1 ] && [ -f "$flash" ]; then
    step dsv4_nolanes 120 env DSV4_CUDA_LANES=0 "$bin/dsv4" bench -m "$flash" --backend cuda \
      --label "flash$layers-nolanes" --parts decode,aggregate --depths 4096 --batches 16,64 --batch-depth 4096 \
      --steps 16 --repeats 3
    grep -a '^TABLE|' "$work/dsv4_nolanes.log" | cut -d'|' -f3-6
  fi
  # DSV4_GPU_HC_CLUSTER_OFF=1: decode and aggregate decode at 4K with each hyper-connection
  # site's mixes and hc_pre as two kernels (DSV4_CUDA_HC_CLUSTER=0): what the cluster launch gains.
  if [ "${DSV4_GPU_HC_CLUSTER_OFF:-0}" = 1 ] && [ -f "$flash" ]; then
    step dsv4_nohccluster 120 env DSV4_CUDA_HC_CLUSTER=0 "$bin/dsv4" bench -m "$flash" --backend cuda \
      --label "flash$layers-nohccluster" --parts decode,aggregate --depths 4096 --batches 16,64 --batch-depth 4096 \
      --steps 16 --repeats 3
    grep -a '^TABLE|' "$work/dsv4_nohccluster.log" | cut -d'|' -f3-6
  fi
  # DSV4_GPU_BASELINE=1: the same decode and aggregate decode at 4K with the baseline dsv4
  # staged by prepare (DSV4_GPU_BASELINE_DIR), on the same file in the same call, interleaved
  # with this build's own runs of them (the first run of a call measured ~3% slow once, on an
  # H100, 2026-12-07): what the commits between the two gain.
  if [ "${DSV4_GPU_BASELINE:-0}" = 1 ] && [ -f "$stage/baseline.tar.xz" ] && [ -f "$flash" ]; then
    rm -rf "$work/baseline" && mkdir -p "$work/baseline" && tar -xJf "$stage/baseline.tar.xz" -C "$work/baseline"
    base_commit="$(cat "$work/baseline/COMMIT" 2>/dev/null)"
    for run in baseline current baseline2 current2; do
      exe="$work/baseline/dsv4" label="flash$layers-base-$base_commit"
      case "$run" in current*) exe="$bin/dsv4" label="flash$layers-current" ;; esac
      step "dsv4_ab_$run" 120 "$exe" bench -m "$flash" --backend cuda --label "$label" --parts decode,aggregate \
        --depths 4096 --batches 16,64 --batch-depth 4096 --steps 16 --repeats 5
      grep -a '^TABLE|' "$work/dsv4_ab_$run.log" | cut -d'|' -f3-6
    done
  fi
  # DSV4_GPU_MOE_STAGE_BYTES="8192 16384": decode and aggregate decode at 4K again with the
  # decode experts' stages sized so (DSV4_MOE_DECODE_STAGE_BYTES; 4096 by default): more rows a
  # stage amortise a stage's copies and bookkeeping (docs/PERFORMANCE.md, fourteenth run).
  for stage_bytes in ${DSV4_GPU_MOE_STAGE_BYTES:-}; do
    [ -f "$flash" ] || break
    step "dsv4_moestage$stage_bytes" 120 env DSV4_MOE_DECODE_STAGE_BYTES="$stage_bytes" "$bin/dsv4" bench -m "$flash" \
      --backend cuda --label "flash$layers-moestage$stage_bytes" --parts decode,aggregate --depths 4096 --batches 16,64 \
      --batch-depth 4096 --steps 16 --repeats 3
    grep -a '^TABLE|' "$work/dsv4_moestage$stage_bytes.log" | cut -d'|' -f3-6
  done
  # DSV4_GPU_MOE_VARIANTS="1 2": decode and aggregate decode at 4K again with the decode experts'
  # kernel variant (DSV4_MOE_DECODE_VARIANT, moe_decode.cu: 1 two rows a pass, 2 gate/up blocks of
  # 8 warps), all with the default's bits; the default run above is the baseline in the same call.
  for variant in ${DSV4_GPU_MOE_VARIANTS:-}; do
    [ -f "$flash" ] || break
    step "dsv4_moevariant$variant" 120 env DSV4_MOE_DECODE_VARIANT="$variant" "$bin/dsv4" bench -m "$flash" \
      --backend cuda --label "flash$layers-moevariant$variant" --parts decode,aggregate --depths 4096 --batches 16,64 \
      --batch-depth 4096 --steps 16 --repeats 3
    grep -a '^TABLE|' "$work/dsv4_moevariant$variant.log" | cut -d'|' -f3-6
  done
  # The flash bench again under one environment setting (step name, label suffix, parts, then
  # the env assignment), beside this build's default run above: what a change gains, in the
  # same call.
  flash_again() {
    local name="$1" suffix="$2" parts="$3" setting="$4"
    step "$name" 120 env "$setting" "$bin/dsv4" bench -m "$flash" --backend cuda --label "flash$layers-$suffix" \
      --parts "$parts" --depths 4096 --batches 16,64 --batch-depth 4096 \
      --prefill "${DSV4_GPU_FLASH_PREFILL:-8192,32768}" --chunk 4096 --prefill-repeats 1 --steps 16 --repeats 3
    grep -a '^TABLE|' "$work/$name.log" | cut -d'|' -f3-6
  }
  # DSV4_GPU_LEGACY_RUNS="bulk f32tiles": each set of kernels switched back (DSV4_CUDA_LEGACY,
  # matvec.h), without the spec part of LEGACY_AB. DSV4_GPU_LEGACY_PARTS (default
  # decode,aggregate) picks the parts, e.g. "prefill" for kernels of prefill chunks.
  for legacy in ${DSV4_GPU_LEGACY_RUNS:-}; do
    [ -f "$flash" ] || break
    flash_again "dsv4_legacy_$legacy" "legacy-$legacy" "${DSV4_GPU_LEGACY_PARTS:-decode,aggregate}" \
      DSV4_CUDA_LEGACY="$legacy"
  done
  # DSV4_GPU_SPLIT_RUNS="3 6": the Float32 products of 65+ rows split into that many BF16
  # terms (DSV4_CUDA_FLOAT32_SPLIT, matvec.h; off by default until measured), parts
  # DSV4_GPU_SPLIT_PARTS (default prefill).
  for terms in ${DSV4_GPU_SPLIT_RUNS:-}; do
    [ -f "$flash" ] || break
    flash_again "dsv4_split$terms" "split$terms" "${DSV4_GPU_SPLIT_PARTS:-prefill}" DSV4_CUDA_FLOAT32_SPLIT="$terms"
  done
  # DSV4_GPU_FLASH_NO_MTP=1: the same decode on the same layers written without the MTP block
  # (does carrying the MTP block change a trunk step?).
  if [ "${DSV4_GPU_FLASH_NO_MTP:-0}" = 1 ] && [ -f "$flash" ]; then
    rm -f "$flash"
    step synth_nomtp 120 "$bin/dsv4" synth "${flash_flags[@]}" --no-mtp --layers "$layers" --force -o "$flash"
    step dsv4_nomtp 120 "$bin/dsv4" bench -m "$flash" --backend cuda --label "flash$layers-nomtp" \
      --parts decode,aggregate --depths 4096 --batches 16,64 --batch-depth 4096 --steps 16 --repeats 3
    grep -a '^TABLE|' "$work/dsv4_nomtp.log" | cut -d'|' -f3-6
  fi
  # MTP speculation's parts at 43 layers: plain step, verify k = 1..4, draft, rollback (rewind).
  if has spec && [ -f "$flash" ]; then
    if [ "${DSV4_GPU_SPEC_DEFAULT:-1}" = 1 ]; then
      step dsv4_spec 150 "$bin/dsv4" bench -m "$flash" --backend cuda --label "flash$layers" --parts spec \
        --batches 16 --batch-depth 4096 --steps 8 --repeats 3 --json "$work/dsv4_spec.json"
      grep -a '^TABLE|' "$work/dsv4_spec.log" | cut -d'|' -f3-6
    fi
    # DSV4_GPU_LEGACY_AB="rows,grouped" (names of DSV4_CUDA_LEGACY, matvec.h): the same, and
    # decode and aggregate at 4K, with those kernels switched back (rows: 2-8-row steps on the
    # tensor-core products and occupancy-planned attention splits; grouped: a product per group
    # of wo_a), beside the figures above: what they change, in the same call.
    if [ -n "${DSV4_GPU_LEGACY_AB:-}" ]; then
      step dsv4_spec_legacy 150 env DSV4_CUDA_LEGACY="$DSV4_GPU_LEGACY_AB" "$bin/dsv4" bench -m "$flash" --backend cuda \
        --label "flash$layers-legacy-$DSV4_GPU_LEGACY_AB" --parts spec --batches 16 --batch-depth 4096 --steps 8 --repeats 3 \
        --json "$work/dsv4_spec_legacy.json"
      grep -a '^TABLE|' "$work/dsv4_spec_legacy.log" | cut -d'|' -f3-6
      for run in current legacy; do
        legacy_env=()
        [ $run = legacy ] && legacy_env=(DSV4_CUDA_LEGACY="$DSV4_GPU_LEGACY_AB")
        step "dsv4_ab_$run" 120 env "${legacy_env[@]}" "$bin/dsv4" bench -m "$flash" --backend cuda \
          --label "flash$layers-$run" --parts decode,aggregate --depths 4096 --batches 4,16,64 --batch-depth 4096 \
          --steps 16 --repeats 3
        grep -a '^TABLE|' "$work/dsv4_ab_$run.log" | cut -d'|' -f3-6
      done
    fi
    # The batch-invariant kernels' cost (--batch-invariant: decode at 1, 16 and 64 sequences
    # and speculation's verify), against the default kernels' figures of the steps above.
    if [ "${DSV4_GPU_INVARIANT:-1}" = 1 ]; then
      step dsv4_invariant 150 "$bin/dsv4" bench -m "$flash" --backend cuda --batch-invariant \
        --label "flash$layers-invariant" --parts decode,aggregate --depths 4096 --batches "${DSV4_GPU_INVARIANT_BATCHES:-16,64}" \
        --batch-depth 4096 --steps 8 --repeats 3 --json "$work/dsv4_invariant.json"
      grep -a '^TABLE|' "$work/dsv4_invariant.log" | cut -d'|' -f3-6
      # Apart: the speculation part's caches (MTP, k extra rows) at 64 sequences on top of
      # the aggregate's leave the 43-layer file too little memory.
      step dsv4_invariant_spec 150 "$bin/dsv4" bench -m "$flash" --backend cuda --batch-invariant \
        --label "flash$layers-invariant" --parts spec --batches 16 --batch-depth 4096 --steps 8 --repeats 3 \
        --json "$work/dsv4_invariant_spec.json"
      grep -a '^TABLE|' "$work/dsv4_invariant_spec.log" | cut -d'|' -f3-6
    fi
    # `dsv4 run` greedy on the same file with speculation and without (--spec 0): the replies
    # must be the same tokens (asserted) in every mode: exact, the default quantised kernels
    # (`fast`: a verify row is its decode step's bits, docs/CUDA.md) and the batch-invariant
    # ones (`invariant`: --fast --batch-invariant). `fast` speculates by default (--spec auto,
    # no flag given: the reply must say so); the others with --spec 3.
    if [ "${DSV4_GPU_SPEC_RUN:-1}" = 1 ]; then
      for mode in ${DSV4_GPU_SPEC_MODES:-exact fast invariant}; do
        mode_flags=("--$mode")
        [ "$mode" = invariant ] && mode_flags=(--fast --batch-invariant)
        run_flags=(run -m "$flash" --backend cuda "${mode_flags[@]}" --temp 0 -n "${DSV4_GPU_SPEC_RUN_TOKENS:-24}" --raw
                   -p "The quick brown fox" --json)
        spec_on=(--spec 3)
        [ "$mode" = fast ] && spec_on=()
        step "run_spec_${mode}_on" 200 "$bin/dsv4" "${run_flags[@]}" "${spec_on[@]}"
        step "run_spec_${mode}_off" 200 "$bin/dsv4" "${run_flags[@]}" --spec 0
        python3 - "$work/run_spec_${mode}_on.log" "$work/run_spec_${mode}_off.log" "$mode" <<'PY' | tee -a "$work/steps.txt"
import json, sys
def reply(path):  # the JSON object printed last (stderr's progress lines come before it)
    text = open(path, errors="replace").read()
    at = 0 if text.startswith("{") else text.find("\n{") + 1
    try:
        return json.JSONDecoder().raw_decode(text[at:])[0] if at > 0 or text.startswith("{") else None
    except ValueError:
        return None
a, b, mode = reply(sys.argv[1]), reply(sys.argv[2]), sys.argv[3]
if not a or not b:
    print(f"run_spec_{mode}: failed (no JSON reply)")
    sys.exit(0)
same = a.get("content") == b.get("content") and a.get("reasoning") == b.get("reasoning")
spec = a.get("speculative", {})
verdict = "ok" if same and spec and (mode != "fast" or spec.get("auto")) else "failed"
print(f"run_spec_{mode}: {verdict} (same reply: {same}; {spec.get('accepted')} of {spec.get('drafted')} drafts "
      f"accepted, {spec.get('tokens_per_step', 0):.2f} tokens/step; {a.get('generation_tokens_per_second', 0):.1f} "
      f"against {b.get('generation_tokens_per_second', 0):.1f} tok/s)")
PY
      done
    fi
  fi
  # The server on the same file: 1, 16 and 64 streaming clients (bench/bench_serve_load.py).
  if has serve && [ -f "$flash" ]; then
    step serve 240 env DSV4_SERVE_LOG="$work/serve_server.log" python3 bench/bench_serve_load.py \
      --cli "$bin/dsv4" -m "$flash" --backend cuda --clients 1,16,64 --prompt 512 --tokens 128 \
      --json "$work/serve.json"
    grep -a '^TABLE|' "$work/serve.log" | cut -d'|' -f3-7
  fi
  # DSV4_GPU_SPEC_SHARED=1: the spec part at batch 1 again on the same layers written with
  # `--routing shared` (every token experts 0..k-1, synth.h): a verify step's rows then read
  # each expert once, the premise of issue 15's goal, where random routing reads ~4x the
  # experts at k = 3. What is left over a plain step is the kernels' per-row work.
  if has spec && [ "${DSV4_GPU_SPEC_SHARED:-0}" = 1 ] && [ -f "$flash" ]; then
    rm -f "$flash"
    step synth_shared 180 "$bin/dsv4" synth "${flash_flags[@]}" --routing shared --layers "$layers" --force -o "$flash"
    step dsv4_spec_shared 150 "$bin/dsv4" bench -m "$flash" --backend cuda --label "flash$layers-shared-routing" \
      --parts spec --batches 1 --batch-depth 4096 --steps 8 --repeats 3 --json "$work/dsv4_spec_shared.json"
    grep -a '^TABLE|' "$work/dsv4_spec_shared.log" | cut -d'|' -f3-6
  fi
  rm -f "$flash"
fi

# ---- where a decode step's time goes: ncu on a cut of the geometry -----------------------
if has profile && command -v ncu >/dev/null; then
  prof_layers="${DSV4_GPU_PROFILE_LAYERS:-4}"
  prof="$shm/dsv4-flash-profile$prof_layers.gguf"
  : >"$work/profile.txt"
  parts=" ${DSV4_GPU_PROFILE_PARTS:-decode prefill batch} "
  mtp_flag=(--no-mtp)
  [[ $parts == *" verify "* ]] && mtp_flag=()  # the spec part wants the MTP block
  step synth_profile 60 "$bin/dsv4" synth --preset flash --layers "$prof_layers" "${mtp_flag[@]}" --recipe q2k \
    --fill random-blocks --seed 1 --force -o "$prof"
  # 1 warm-up + 4 timed steps without graphs: each kernel of a step shows up 5 times.
  [[ $parts == *" decode "* ]] && step profile 150 ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    --log-file "$work/ncu.csv" "$bin/dsv4" bench -m "$prof" --backend cuda --parts decode --depths 4096 \
    --steps 4 --repeats 1 --warmup 1 --no-graphs --label "profile$prof_layers"
  # Prefill: one untimed and one timed chunk of 4096 tokens.
  [[ $parts == *" prefill "* ]] && step profile_prefill 150 ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    --log-file "$work/ncu_prefill.csv" "$bin/dsv4" bench -m "$prof" --backend cuda --parts prefill \
    --prefill 4096 --chunk 4096 --prefill-repeats 1 --label "profile$prof_layers"
  # Batched decode: 16 sequences, 1 warm-up + 2 timed steps.
  [[ $parts == *" batch "* ]] && step profile_batch 150 ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    --log-file "$work/ncu_batch.csv" "$bin/dsv4" bench -m "$prof" --backend cuda --parts aggregate \
    --batches 16 --batch-depth 4096 --steps 2 --repeats 1 --warmup 1 --no-graphs --label "profile$prof_layers"
  # "batch64": the same at 64 sequences.
  [[ $parts == *" batch64 "* ]] && step profile_batch64 150 ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    --log-file "$work/ncu_batch64.csv" "$bin/dsv4" bench -m "$prof" --backend cuda --parts aggregate \
    --batches 64 --batch-depth 4096 --steps 2 --repeats 1 --warmup 1 --no-graphs --label "profile$prof_layers"
  # An MTP verify step of one sequence, 4 rows (k = 3): 1 warm-up + 2 timed steps.
  [[ $parts == *" verify "* ]] && step profile_verify 150 ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    --log-file "$work/ncu_verify.csv" "$bin/dsv4" bench -m "$prof" --backend cuda --parts spec --batches 1 \
    --batch-depth 4096 --verify-rows 4 --steps 2 --repeats 1 --warmup 1 --no-graphs --label "profile$prof_layers"
  for what in decode prefill batch batch64 verify; do
    csv="$work/ncu_$what.csv"; [ $what = decode ] && csv="$work/ncu.csv"
    [ -f "$csv" ] || continue
    python3 - "$csv" "$what" >>"$work/profile.txt" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
head, rows = rows[0], rows[1:]
name, value = head.index("Kernel Name"), head.index("Metric Value")
total, count = collections.Counter(), collections.Counter()
for r in rows:
    k = r[name].split("(")[0][:90]
    total[k] += float(r[value].replace(",", "")) / 1e3
    count[k] += 1
what = {"decode": "5 decode steps", "prefill": "2 prefill chunks of 4096 tokens",
        "batch": "3 decode steps of 16 sequences", "batch64": "3 decode steps of 64 sequences", "verify": "3 verify steps of 4 rows"}[sys.argv[2]]
print(f"== {sys.argv[2]}: all launches of the run (load, fill, {what})")
print(f"{'us total':>10} {'launches':>8} {'us each':>9}  kernel")
for k, t in total.most_common(40):
    print(f"{t:10.1f} {count[k]:8d} {t / count[k]:9.1f}  {k}")
print(f"{sum(total.values()):10.1f} {sum(count.values()):8d}            all")
PY
  done
  # The decode step's heaviest small kernels on the 4-layer cut ("decode_detail"): ncu's
  # sections for the hyper-connection, attention, expert and one-row product kernels of one
  # step (throughput against peak, warp stall reasons, occupancy): why a 4096-wide row takes
  # 20 us where its bytes take 1.
  if [[ $parts == *" decode_detail "* ]]; then
    step profile_decode_detail 150 ncu --clock-control none \
      -k 'regex:hc_pre_kernel|attention_mma_kernel|attention_combine|moe_decode|matvec_row_kernel|float32_rows|rms_norm_kernel|rope_kernel' \
      --launch-skip 80 --launch-count 40 --section SpeedOfLight --section WarpStateStats --section Occupancy \
      --section LaunchStats --log-file "$work/ncu_decode_detail.txt" "$bin/dsv4" bench -m "$prof" --backend cuda \
      --parts decode --depths 4096 --steps 2 --repeats 1 --warmup 1 --no-graphs --label "profile$prof_layers"
    [ -f "$work/ncu_decode_detail.txt" ] && cat "$work/ncu_decode_detail.txt" >>"$work/profile.txt"
  fi
  # "batch_detail": ncu's sections for the int8 tensor-core products of a 16-sequence step
  # (mmq_kernel: Q8_0 attention and shared-expert products of 16 rows), ~2 layers' launches
  # after the warm-up step: grid, occupancy, stall reasons, issue and memory throughput.
  if [[ $parts == *" batch_detail "* ]]; then
    step profile_batch_detail 150 ncu --clock-control none -k regex:mmq_kernel --launch-skip 40 --launch-count 20 \
      --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis --log-file "$work/ncu_batch_detail.txt" \
      "$bin/dsv4" bench -m "$prof" --backend cuda --parts aggregate --batches 16 --batch-depth 4096 --steps 1 \
      --repeats 1 --warmup 1 --no-graphs --label "profile$prof_layers"
    [ -f "$work/ncu_batch_detail.txt" ] && cat "$work/ncu_batch_detail.txt" >>"$work/profile.txt"
  fi
  # "hc_source": hc_pre_kernel's warp-stall samples per SASS instruction (one launch of a
  # decode step), into ncu_hc_source.csv in the logs: which instructions its 18 us wait on.
  if [[ $parts == *" hc_source "* ]]; then
    step profile_hc_source 120 ncu --clock-control none -k regex:hc_pre_kernel --launch-skip 8 --launch-count 1 \
      --section WarpStateStats --section SourceCounters --page source --print-source sass --csv \
      --log-file "$work/ncu_hc_source.csv" "$bin/dsv4" bench -m "$prof" --backend cuda \
      --parts decode --depths 4096 --steps 1 --repeats 1 --warmup 1 --no-graphs --label "profile$prof_layers"
  fi
  # The wgmma expert kernels of one 4096-token layer (cuda_bench_moe): where their time goes
  # (throughput of the SMs, L2 and L1 against peak; warp stall reasons).
  # Then the same with the f32 weight decoders ("wgdecode" switched back), for comparison.
  if [[ $parts == *" moe "* ]] && [ -x "$bin/cuda_bench_moe" ]; then
    for variant in "" " f32 decode"; do
      name=moe${variant// /_}
      step "profile_$name" 150 env DSV4_BENCH_ONLY="batched layer 256 experts, 4096 tokens q2_K/q3_K$variant\$" \
        ncu --clock-control none -k regex:moe_wgmma --launch-count 2 --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats --section Occupancy --log-file "$work/ncu_$name.txt" "$bin/cuda_bench_moe"
      [ -f "$work/ncu_$name.txt" ] && cat "$work/ncu_$name.txt" >>"$work/profile.txt"
    done
  fi
  head -25 "$work/profile.txt"
  rm -f "$prof"
  refresh_out
fi

# ---- issue 12, check 3: llama.cpp's converter's files in dsv4 -----------------------------
if has upstream; then
  if [ -f "$llama_stage/upstream.tar.gz" ]; then
    rm -rf "$work/upstream" && mkdir -p "$work/upstream/src" &&
      tar -xzf "$llama_stage/upstream.tar.gz" -C "$work/upstream/src"
    step upstream 150 env DSV4_CLI="$bin/dsv4" LLAMA_LOGITS="$work/upstream/src/llama_logits" \
      LLAMA_QUANTIZE="$work/upstream/src/llama_quant" \
      LLAMA_CPP_SOURCE="$work/upstream/src" bash tests/llamacpp/upstream_convert.sh "$work/upstream/out"
    tail -6 "$work/upstream.log"
  else
    echo "upstream: no $llama_stage/upstream.tar.gz (run 'scripts/gpu.sh prepare')" | tee -a "$work/steps.txt"
  fi
fi

# ---- kernel benchmarks, with what is left ------------------------------------------------
if has kernels; then
  # DSV4_GPU_BENCHES="matvec moe" runs only those (unset: all; "": none).
  for exe in "$bin"/cuda_bench_*; do
    name=${exe##*/cuda_bench_}
    case " ${DSV4_GPU_BENCHES-$name} " in *" $name "*) ;; *) continue ;; esac
    case $name in matvec) limit=420 ;; moe) limit=300 ;; prefill) limit=120 ;; *) limit=180 ;; esac
    step "bench_$name" "$limit" "$exe"
  done
fi

echo
echo "== steps"
cat "$work/steps.txt"
echo
echo "== table (value, unit, ratio to its bound: dsv4 decode over the byte bound, prefill over the BF16"
echo "   tensor-core bound; peer: dsv4 / llama.cpp on the same file; kernels: see each bench's header)"
refresh_out
awk -F'|' '{printf "%-10s %-58s %10s %-8s %6s  %s\n", $2, $3, $4, $5, $6, substr($7, 1, 90)}' "$work/table.txt"
! grep -q "failed\|timed out" "$work/steps.txt"
