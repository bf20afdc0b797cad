#!/usr/bin/env python3
"""dsv4 against llama.cpp itself (llama-cpp-python 0.3.36's vendor/llama.cpp, built by
tests/llamacpp/build.sh): the issue-12 checks 1 and 2.

1. llama.cpp loads files dsv4 writes in its layout (trunk + MTP sidecar), from `dsv4 synth`
   and from `dsv4 convert` of a synthetic official checkpoint, and its logits on a few
   hundred tokens agree with `dsv4 score` on the same file (f32 weights, f32 KV cache on both
   sides, dsv4 without the official QAT roundings, which llama.cpp does not apply).
2. llama.cpp's quantiser (llama_model_quantize, what llama-quantize runs; through our
   llama_quant, with an importance matrix where the type needs one) turns the synthetic file
   into every type published DeepSeek-V4 GGUFs use (CI_FILES); dsv4 loads every result and
   its logits agree with llama.cpp's on it.

The agreement is measured as the relative L2 distance of each row of logits,
|dsv4 - llama| / |llama|, and the fraction of rows whose argmax agrees; both are printed and
held to F32_BOUND where both sides multiply in f32 (QUANT_TYPES says how quantised files are
checked; measured values: docs/MODEL-FILES.md).

Environment: DSV4_CLI (the dsv4 binary), LLAMACPP_BUILD (the build folder; default: run
build.sh), DSV4_LLAMACPP_FILE_TYPES (instead of CI's three quantised files, one per file type:
"all" or a comma-separated list of FILE_TYPES).
"""
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CLI = os.environ.get("DSV4_CLI", str(HERE.parent.parent / "build" / "dsv4"))
N_TOKENS = 300  # past two compressed entries of the ratio-128 layers (positions 128 and 256)
THREADS = str(os.cpu_count() or 2)

# Agreement bound on f32 products: the worst row's relative L2 and the least fraction of rows
# with the same argmax (measured: at most 7.7e-6 and 100%, docs/MODEL-FILES.md).
F32_BOUND, F32_SAME = 2e-3, 0.99
# Each quantised file is checked as dsv4 on the file against llama.cpp on its own
# dequantisation of it (llama_quant ... F32, as llama-quantize --allow-requantize): both then multiply in f32,
# so the check isolates the decoding of every block, held to F32_BOUND. llama.cpp on the
# quantised file itself multiplies by Q8_K/Q8_0-quantised activations, and on this random model
# that noise flips near-tied expert choices, so that comparison is printed (its logits are
# checked finite and of the right shape), not bounded.
#
# The ggml types published DeepSeek-V4 GGUFs use (issue 12). Quantising is most of this test's
# time (the very-low-bit types search their codebooks: ~17 CPU-s per file of this model), so CI
# covers them in three files instead of one per file type: upstream's own Q4_K_M mixture, and
# two files that give each of the six layers (every attention, expert, shared-expert and
# hyper-connection matrix of that layer) one type through llama-quantize's --tensor-type
# overrides. Every type then decodes the matrices of a whole layer, whose output feeds every
# later layer and the logits. Each file must hold each of its types (a shape fallback cannot
# drop one unnoticed). name -> (base file type, importance matrix needed, {regex: ggml type}).
PUBLISHED_TYPES = {"q4_K", "q6_K", "q5_K", "q5_0", "q4_0", "iq4_nl", "iq4_xs",
                   "iq3_s", "iq3_xxs", "iq2_s", "iq2_xs", "iq1_m", "iq1_s"}
CI_FILES = {
    "Q4_K_M": ("Q4_K_M", False, {}),
    "mix-k": ("Q6_K", False, {r"blk\.0\.": "q6_K", r"blk\.1\.": "q5_K", r"blk\.2\.": "q5_0",
                              r"blk\.3\.": "q4_0", r"blk\.4\.": "iq4_nl", r"blk\.5\.": "iq4_xs"}),
    # token embedding and output stay f32 here: llama-quantize's choice for them in the
    # very-low-bit files (q2_K, q5_K) costs as much time as the six layers.
    "mix-iq": ("IQ1_S", True, {r"blk\.0\.": "iq3_s", r"blk\.1\.": "iq3_xxs", r"blk\.2\.": "iq2_s",
                               r"blk\.3\.": "iq2_xs", r"blk\.4\.": "iq1_m", r"blk\.5\.": "iq1_s",
                               r"^token_embd\.": "f32", r"^output\.": "f32"}),
}
# By hand (DSV4_LLAMACPP_FILE_TYPES=all, or a comma-separated list): one file per file type as
# llama-quantize makes it, without overrides (IQ2_M is the file type whose tensors are iq2_s).
FILE_TYPES = {
    "Q6_K": False, "Q5_K_M": False, "Q4_K_M": False, "Q5_0": False, "Q4_0": False,
    "IQ4_NL": False, "IQ4_XS": False, "IQ3_S": False, "IQ3_XXS": True,
    "IQ2_M": True, "IQ2_XS": True, "IQ1_M": True, "IQ1_S": True,
}


COST: dict[str, list[float]] = {}  # per program: [runs, CPU seconds, wall seconds]


def run(cmd, **kw):
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, errors="replace", timeout=1800, **kw)
    if p.returncode != 0:
        raise SystemExit(f"FAIL {' '.join(map(str, cmd))} (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    name = Path(str(cmd[0])).name + (" " + str(cmd[1]) if Path(str(cmd[0])).name == "dsv4" else "")
    cost = COST.setdefault(name, [0, 0.0, 0.0])
    cost[0] += 1
    cost[1] += after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    cost[2] += time.monotonic() - start
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


def dsv4_logits(model, tokens, work, mtp_file=None) -> np.ndarray:
    out = work / f"{Path(model).stem}.dsv4.npy"
    score = [CLI, "score", "-m", model, "--tokens", tokens, "-o", out, "--no-qat", "-t", THREADS]
    if mtp_file:
        score += ["--mtp-file", mtp_file]
    run(score)
    logits = np.load(out)
    out.unlink()
    return logits


def check_logits(label, ours, llama_model, tokens, work, logits_bin, bound, least_same, failures):
    """dsv4's logits `ours` against llama.cpp's on `llama_model`."""
    llama_out = work / f"{Path(llama_model).stem}.llama.npy"
    run([logits_bin, llama_model, tokens, llama_out, "--threads", THREADS])
    theirs = np.load(llama_out)
    llama_out.unlink()
    if ours.shape != theirs.shape or not np.isfinite(ours).all() or not np.isfinite(theirs).all():
        failures.append(f"{label}: shapes {ours.shape} / {theirs.shape}, finite {np.isfinite(ours).all()} / "
                        f"{np.isfinite(theirs).all()}")
        return
    median, worst, same = compare(ours, theirs)
    print(f"{label:44s} rel L2 median {median:.2e} max {worst:.2e}, argmax agrees {same:6.1%} "
          + (f"(bounds {bound:.1e}, {least_same:.0%})" if bound is not None else "(not bounded)"), flush=True)
    if bound is not None and (not worst <= bound or same < least_same):
        failures.append(f"{label}: rel L2 max {worst:.3e} (bound {bound:.1e}), argmax {same:.1%} (least {least_same:.0%})")


def check_quantized(label, model, tokens, work, logits_bin, quantize, failures):
    """dsv4 on a quantised file, once, against llama.cpp on its own F32 dequantisation of the
    file (bounded) and on the file itself (finite, same shape)."""
    ours = dsv4_logits(model, tokens, work)
    dequantized = work / f"{model.stem}.f32.gguf"
    run([quantize, model, dequantized, "F32", "--threads", THREADS])
    check_logits(label + " (llama.cpp dequantised)", ours, dequantized, tokens, work, logits_bin, F32_BOUND, F32_SAME,
                 failures)
    dequantized.unlink()
    check_logits(label + " (Q8 activations)", ours, model, tokens, work, logits_bin, None, None, failures)


def main() -> int:
    started = time.monotonic()
    build = llama_build()
    quantize, logits_bin = (tool(build, n) for n in ("llama_quant", "llama_logits"))
    failures: list[str] = []
    checks = 6  # two sidecars, synth f32, conv f32 and the MXFP4 file's two comparisons
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
            check_logits(model.stem + " f32", dsv4_logits(model, tokens, work), model, tokens, work, logits_bin,
                         F32_BOUND, F32_SAME, failures)
        check_quantized("conv MXFP4 experts", conv_mxfp4, tokens, work, logits_bin, quantize, failures)

        # 2. llama.cpp's quantiser's output in every published type, read by dsv4. llama-quantize
        # refuses the very-low-bit types without an importance matrix; llama_quant gives one to
        # every matrix (its --imatrix), so no tensor needs to keep a wider type.
        only = os.environ.get("DSV4_LLAMACPP_FILE_TYPES")
        if only:
            files = {t: (t, FILE_TYPES[t], {}) for t in (FILE_TYPES if only == "all" else only.split(","))}
        else:
            files = CI_FILES
        covered: set[str] = set()
        for name, (ftype, imatrix, overrides) in files.items():
            out = work / f"q-{name}.gguf"
            cmd = [quantize, synth, out, ftype, "--threads", THREADS, *(["--imatrix", "20261001"] if imatrix else [])]
            for pattern, ggml_type in overrides.items():
                cmd += ["--tensor-type", f"{pattern}={ggml_type}"]
            run(cmd)
            info = run([CLI, "info", out])
            kinds = [ln.split()[0] for ln in info.stdout.split("by type:")[1].split("by role:")[0].splitlines()
                     if ln.strip()]
            print(f"{name:8s} file types: {' '.join(kinds)}", flush=True)
            main_type = ftype[:-2] if ftype.endswith("_K_M") else "IQ2_S" if ftype == "IQ2_M" else ftype
            wanted = {t.lower() for t in overrides.values() if t != "f32"} or {main_type.lower()}
            missing = wanted - {k.lower() for k in kinds}
            if missing:
                failures.append(f"{name}: the quantised file holds no {' '.join(sorted(missing))} tensor")
            covered |= set(kinds)
            checks += 3  # its types, and its two comparisons
            check_quantized(f"quantized {name}", out, tokens, work, logits_bin, quantize, failures)
            out.unlink()
        checks += 0 if only else 1
        if not only and PUBLISHED_TYPES - covered:
            failures.append(f"published types not covered: {' '.join(sorted(PUBLISHED_TYPES - covered))}")
    for name, (n, cpu, wall) in sorted(COST.items(), key=lambda kv: -kv[1][1]):
        print(f"cost: {name:14s} {n:3d} runs {cpu:7.1f} CPU-s {wall:7.1f} s")
    print(f"cost: {time.monotonic() - started:.0f} s in all")
    for f in failures:
        print("FAIL", f)
    print(f"llama.cpp interop: {checks - len(failures)} of {checks} checks passed (ggml types decoded: "
          f"{' '.join(sorted(covered - {'f32', 'i32'}))})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
