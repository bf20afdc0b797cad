#!/usr/bin/env bash
# Issue 12, check 3 (run by hand on the GPU machine, which has torch): llama.cpp's own
# converter (convert_hf_to_gguf.py of llama-cpp-python 0.3.36's vendor/llama.cpp) turns a
# small synthetic official checkpoint (`dsv4 synth-checkpoint --preset interop`: ratios
# 0 / 4 / 128, which upstream accepts) into a trunk and, with --mtp, an MTP sidecar; then dsv4
# must load both and its logits must agree with llama.cpp's on them.
#   tests/llamacpp/upstream_convert.sh [OUT_DIR]   (needs build/dsv4 and python3 with torch)
# scripts/gpu.sh's `upstream` step runs it there with the staged pieces: DSV4_CLI (the dsv4
# binary), LLAMA_LOGITS and LLAMA_QUANTIZE (llama_logits and llama_quant, built by build.sh;
# upstream's llama-quantize takes the same command line here), LLAMA_CPP_SOURCE (a tree holding
# convert_hf_to_gguf.py, conversion/ and gguf-py/). Exits non-zero when the logits disagree
# by more than check 1's f32 bound (test_llamacpp_interop.py's F32_BOUND, F32_SAME).
# Leaves OUT_DIR/ckpt, OUT_DIR/upstream-f32.gguf, OUT_DIR/mtp-upstream-f32.gguf (small enough
# to commit as test data: tests/data/llamacpp-converted/) and prints the comparison.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$here/../.."
out="$(realpath -m "${1:-/tmp/dsv4-upstream-convert}")"
cli="${DSV4_CLI:-$root/build/dsv4}"
py="${PYTHON:-python3}"
mkdir -p "$out"
if [ -n "${LLAMA_LOGITS:-}" ]; then
  logits="$LLAMA_LOGITS"
  quantize="$LLAMA_QUANTIZE"
else
  lbuild="$("$here/build.sh" | tail -1)"
  logits="$lbuild/llama_logits"
  quantize="$lbuild/llama_quant"
fi
src="${LLAMA_CPP_SOURCE:-${DSV4_CACHE_DIR:-$HOME/.cache/dsv4}/llama_cpp_python-0.3.36/vendor/llama.cpp}"

"$py" -c "import torch" 2>/dev/null || { echo "upstream_convert: needs torch (pip install torch)" >&2; exit 1; }
"$py" -c "import transformers, sentencepiece, google.protobuf" 2>/dev/null ||
  "$py" -m pip install -q --disable-pip-version-check transformers sentencepiece protobuf >&2
# The converter's own gguf package, not whichever one is installed.
export PYTHONPATH="$src/gguf-py${PYTHONPATH:+:$PYTHONPATH}"

# synth-checkpoint writes tokenizer.json and tokenizer_config.json as the official folders have them.
"$cli" synth-checkpoint --preset interop --seed 21 --tokenizer -o "$out/ckpt" --force

"$py" "$src/convert_hf_to_gguf.py" "$out/ckpt" --outtype f32 --outfile "$out/upstream-f32.gguf"
"$py" "$src/convert_hf_to_gguf.py" "$out/ckpt" --outtype f32 --mtp --outfile "$out/mtp-upstream-f32.gguf"
"$cli" info "$out/upstream-f32.gguf" | head -20

"$py" -c "import numpy as np; np.random.seed(5); print(' '.join(map(str, np.random.randint(3, 128000, 300))))" > "$out/tokens.txt"
# upstream's converter writes Q8_0 attention and shared expert, MXFP4 experts and BF16
# compressors, indexer, router, embedding and head even at --outtype f32 (the checkpoint's
# FP8/FP4 weights), and llama.cpp multiplies those with Q8/BF16-rounded activations. So the
# bounded comparison is dsv4 on upstream's file against llama.cpp on llama.cpp's quantiser's F32
# dequantisation of that same file (both multiply in f32; the quantiser keeps the routers in
# BF16, so upcast_bf16.py widens those exactly); llama.cpp on the file itself is printed
# beside it.
"$quantize" --allow-requantize "$out/upstream-f32.gguf" "$out/upstream-q-f32.gguf" F32 >"$out/quantize.log" 2>&1 ||
  { tail -20 "$out/quantize.log"; exit 1; }
"$py" "$here/upcast_bf16.py" "$out/upstream-q-f32.gguf" "$out/upstream-as-f32.gguf"
"$logits" "$out/upstream-as-f32.gguf" "$out/tokens.txt" "$out/llama.npy"
"$logits" "$out/upstream-f32.gguf" "$out/tokens.txt" "$out/llama-native.npy"
"$logits" "$out/mtp-upstream-f32.gguf" "$out/tokens.txt" /dev/null --load-only
"$cli" score -m "$out/upstream-f32.gguf" --backend cpu --tokens "$out/tokens.txt" -o "$out/dsv4.npy" --no-qat
"$cli" score -m "$out/upstream-f32.gguf" --backend cpu --tokens "$out/tokens.txt" -o "$out/dsv4-mtp.npy" --no-qat --mtp
"$py" - "$out" <<'PY'
import sys, numpy as np
d = sys.argv[1]
def compare(label, a, b):
    rel = np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1)
    same = (a.argmax(1) == b.argmax(1)).mean()
    print(f"{label}: rel L2 median {np.median(rel):.2e} max {rel.max():.2e}, argmax agrees {same:.1%} ({len(rel)} rows)")
    return rel.max(), same
a = np.load(f"{d}/dsv4.npy").astype(np.float64)
worst, same = compare("dsv4 on upstream's file vs llama.cpp on its F32 dequantisation", a,
                      np.load(f"{d}/llama.npy").astype(np.float64))
compare("dsv4 on upstream's file vs llama.cpp on the same file (its Q8/BF16 activations; not bounded)", a,
        np.load(f"{d}/llama-native.npy").astype(np.float64))
m = np.load(f"{d}/dsv4-mtp.npy")
print(f"dsv4 MTP draft logits from the upstream sidecar: {m.shape}, finite {np.isfinite(m).all()}")
ok = worst <= 2e-3 and same >= 0.99 and np.isfinite(m).all() and np.isfinite(a).all()
print("upstream_convert: " + ("PASS" if ok else "FAIL") + " (bound: rel L2 <= 2e-3, argmax >= 99%)")
sys.exit(0 if ok else 1)
PY
