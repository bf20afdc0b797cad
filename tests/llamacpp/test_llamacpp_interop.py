#!/usr/bin/env python3
"""dsv4 against llama.cpp itself (llama-cpp-python 0.3.36's vendor/llama.cpp, built by
tests/llamacpp/build.sh): the issue-12 checks 1 and 2.

1. llama.cpp loads files dsv4 writes in its layout (trunk + MTP sidecar), from `dsv4 synth`
   and from `dsv4 convert` of a synthetic official checkpoint, and its logits on a few
   hundred tokens agree with `dsv4 score` on the same file (f32 weights, f32 KV cache on both
   sides, dsv4 without the official QAT roundings, which llama.cpp does not apply).
2. llama-quantize (with an importance matrix from llama-imatrix where the type needs one)
   turns the synthetic file into each type published DeepSeek-V4 GGUFs use; dsv4 loads every
   result and its logits agree with llama.cpp's on it.

The agreement is measured as the relative L2 distance of each row of logits,
|dsv4 - llama| / |llama|, and the fraction of rows whose argmax agrees; both are printed and
held to F32_BOUND where both sides multiply in f32 (QUANT_TYPES says how quantised files are
checked; measured values: docs/MODEL-FILES.md).

Environment: DSV4_CLI (the dsv4 binary), LLAMACPP_BUILD (the build folder; default: run
build.sh), DSV4_LLAMACPP_TYPES (a comma-separated subset of the quantisation types).
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CLI = os.environ.get("DSV4_CLI", str(HERE.parent.parent / "build" / "dsv4"))
N_TOKENS = 300  # past two compressed entries of the ratio-128 layers (positions 128 and 256)
THREADS = str(os.cpu_count() or 2)

# Agreement bound on f32 products: the worst row's relative L2 and the least fraction of rows
# with the same argmax (measured: at most 7.7e-6 and 100%, docs/MODEL-FILES.md).
F32_BOUND, F32_SAME = 2e-3, 0.99
# The types published DeepSeek-V4 GGUFs use -> whether llama-quantize needs an importance matrix.
# Each quantised file is checked as dsv4 on the file against llama.cpp on its own
# dequantisation of it (llama-quantize --allow-requantize ... F32): both then multiply in f32,
# so the check isolates the decoding of every block, held to F32_BOUND. llama.cpp on the
# quantised file itself multiplies by Q8_K/Q8_0-quantised activations, and on this random model
# that noise flips near-tied expert choices, so that comparison is printed, not bounded.
QUANT_TYPES = {
    "Q6_K": False, "Q5_K_M": False, "Q4_K_M": False, "Q5_0": False, "Q4_0": False,
    "IQ4_NL": False, "IQ4_XS": False, "IQ3_S": False, "IQ3_XXS": True,
    "IQ2_S": True, "IQ2_XS": True, "IQ1_M": True, "IQ1_S": True,
}


def run(cmd, **kw):
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, errors="replace", timeout=1800, **kw)
    if p.returncode != 0:
        raise SystemExit(f"FAIL {' '.join(map(str, cmd))} (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def llama_build() -> Path:
    if os.environ.get("LLAMACPP_BUILD"):
        return Path(os.environ["LLAMACPP_BUILD"])
    return Path(run(["bash", HERE / "build.sh"]).stdout.strip().splitlines()[-1])


def tool(build: Path, name: str) -> Path:
    for p in (build / name, build / "bin" / name, build / "llama.cpp" / "bin" / name):
        if p.exists():
            return p
    raise SystemExit(f"FAIL {name} not found under {build}")


def compare(ours: np.ndarray, theirs: np.ndarray) -> tuple[float, float, float]:
    ours, theirs = ours.astype(np.float64), theirs.astype(np.float64)
    rel = np.linalg.norm(ours - theirs, axis=1) / np.linalg.norm(theirs, axis=1)
    same = float((ours.argmax(1) == theirs.argmax(1)).mean())
    return float(np.median(rel)), float(rel.max()), same


def check_logits(label, model, tokens, work, logits_bin, bound, least_same, failures, mtp_file=None, llama_model=None):
    """dsv4 on `model` against llama.cpp on `llama_model` (default: the same file)."""
    llama_out, dsv4_out = work / f"{label}.llama.npy", work / f"{label}.dsv4.npy"
    run([logits_bin, llama_model or model, tokens, llama_out, "--threads", THREADS])
    score = [CLI, "score", "-m", model, "--tokens", tokens, "-o", dsv4_out, "--no-qat", "-t", THREADS]
    if mtp_file:
        score += ["--mtp-file", mtp_file]
    run(score)
    ours, theirs = np.load(dsv4_out), np.load(llama_out)
    if ours.shape != theirs.shape or not np.isfinite(ours).all() or not np.isfinite(theirs).all():
        failures.append(f"{label}: shapes {ours.shape} / {theirs.shape}, finite {np.isfinite(ours).all()} / "
                        f"{np.isfinite(theirs).all()}")
        return
    median, worst, same = compare(ours, theirs)
    print(f"{label:44s} rel L2 median {median:.2e} max {worst:.2e}, argmax agrees {same:6.1%} "
          + (f"(bounds {bound:.1e}, {least_same:.0%})" if bound is not None else "(not bounded)"))
    if bound is not None and (not worst <= bound or same < least_same):
        failures.append(f"{label}: rel L2 max {worst:.3e} (bound {bound:.1e}), argmax {same:.1%} (least {least_same:.0%})")
    llama_out.unlink()
    dsv4_out.unlink()


def check_quantized(label, model, tokens, work, logits_bin, quantize, failures):
    dequantized = work / f"{model.stem}.f32.gguf"
    run([quantize, "--allow-requantize", model, dequantized, "F32", THREADS])
    check_logits(label + " (llama.cpp dequantised)", model, tokens, work, logits_bin, F32_BOUND, F32_SAME, failures,
                 llama_model=dequantized)
    dequantized.unlink()
    check_logits(label + " (Q8 activations)", model, tokens, work, logits_bin, None, None, failures)


def main() -> int:
    build = llama_build()
    quantize, imatrix, logits_bin = (tool(build, n) for n in ("llama-quantize", "llama-imatrix", "llama_logits"))
    only = os.environ.get("DSV4_LLAMACPP_TYPES")
    types = [t for t in QUANT_TYPES if not only or t in only.split(",")]
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="dsv4-llamacpp-") as tmp:
        work = Path(tmp)
        rng = np.random.default_rng(20261001)
        tokens = work / "tokens.txt"
        tokens.write_text(" ".join(str(t) for t in rng.integers(3, 128000, N_TOKENS)))

        # 1. dsv4-written files, synthetic and converted, trunk + sidecar.
        synth = work / "synth.gguf"
        run([CLI, "synth", "--preset", "interop", "--experts", "f32", "--dense", "f32", "--seed", "12", "-o", synth])
        ckpt = work / "ckpt"
        run([CLI, "synth-checkpoint", "--preset", "interop", "--seed", "13", "--tokenizer", "-o", ckpt])
        # The f32 recipe keeps the official FP4 experts as MXFP4 (lossless); llama.cpp multiplies
        # those with Q8-quantised activations, so the f32 comparison converts them to F32 too,
        # and the MXFP4 file is checked with the quantised types below.
        conv = work / "conv.gguf"
        run([CLI, "convert", ckpt, "-o", conv, "--recipe", "f32", "--type", "experts=f32", "--type", "experts_down=f32"])
        conv_mxfp4 = work / "conv-mxfp4.gguf"
        run([CLI, "convert", ckpt, "-o", conv_mxfp4, "--recipe", "f32"])
        for model in (synth, conv):
            sidecar = model.with_name("mtp-" + model.name)
            if not sidecar.exists():
                failures.append(f"{model.name}: no MTP sidecar {sidecar.name} written")
            else:  # llama.cpp accepts the sidecar's tensors (it loads it as the MTP draft model)
                run([logits_bin, sidecar, tokens, work / "unused.npy", "--load-only"])
            check_logits(model.stem + " f32", model, tokens, work, logits_bin, F32_BOUND, F32_SAME, failures)
        check_quantized("conv MXFP4 experts", conv_mxfp4, tokens, work, logits_bin, quantize, failures)

        # 2. llama-quantize's output of every published type, read by dsv4.
        text = work / "imatrix.txt"
        text.write_text(("The quick brown fox jumps over the lazy dog. DeepSeek-V4 uses hyper-connections, "
                         "compressed sparse attention and a mixture of experts. 1 2 3 4 5 6 7 8 9 10.\n") * 40)
        imat = work / "imatrix.gguf"
        if any(QUANT_TYPES[t] for t in types):
            run([imatrix, "-m", synth, "-f", text, "-o", imat, "-c", "128", "-b", "128", "--chunks", "4",
                 "-t", THREADS])
        for qtype in types:
            out = work / f"q-{qtype}.gguf"
            # llama-imatrix collects no statistics for the hyper-connection mixers and the
            # compressor APE (not multiplied by ggml_mul_mat), and for the grouped output
            # projection attn_output_a it collects the statistics of all groups together (1024
            # values for its 512 inputs), which llama-quantize refuses; the very-low-bit types
            # keep those tensors in f32.
            low_bit = ["--imatrix", imat, "--tensor-type", "hc_=f32", "--tensor-type", "_ape=f32",
                       "--tensor-type", "attn_output_a=f32"]
            run([quantize, *(low_bit if QUANT_TYPES[qtype] else []), synth, out, qtype, THREADS])
            info = run([CLI, "info", out])
            kinds = [ln.split()[0] for ln in info.stdout.split("by type:")[1].split("by role:")[0].splitlines()
                     if ln.strip()]
            print(f"{qtype:8s} file types: {' '.join(kinds)}")
            check_quantized(f"quantized {qtype}", out, tokens, work, logits_bin, quantize, failures)
            out.unlink()
    for f in failures:
        print("FAIL", f)
    print(f"{2 * len(types) + 4 - len(failures)} checks passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
