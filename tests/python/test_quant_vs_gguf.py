#!/usr/bin/env python3
"""dsv4's block arithmetic against the Python `gguf` package (gguf.quants), bit for bit.

Dequantisation: random blocks of every type dsv4 decodes (random bytes, with the fp16
scale fields replaced by sane values of either sign, fp16 subnormals included; MXFP4
exponents and the plain types keep every byte pattern, NaN and infinity included) are
decoded by `dsv4 quant dequant` and by gguf.quants.dequantize; the f32 bits must agree.

Quantisation: where gguf-py's quantiser reproduces ggml's reference (F16, BF16, Q8_0,
MXFP4), `dsv4 quant quantize` must write the same bytes.

Run by ctest with DSV4_CLI set; DSV4_TEST_SEED replays a failure.
"""
import os
import random
import subprocess
import sys
import tempfile

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES

CLI = os.environ.get("DSV4_CLI", "dsv4")
SEED = int(os.environ.get("DSV4_TEST_SEED", random.SystemRandom().randrange(1 << 63)))

# Byte offsets of the fp16 scale fields in each block (quant_blocks.h / ggml-common.h).
FP16_SCALE_OFFSETS = {
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
    T.IQ2_XXS: [0],
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.IQ4_NL: [0],
    T.IQ4_XS: [0],
    T.IQ2_XS: [0],
    T.IQ2_S: [0],
    T.IQ3_XXS: [0],
    T.IQ3_S: [0],
    T.IQ1_S: [0],
}
# IQ1_M has no scale field: the fp16 scale is the top nibbles of the four u16 words at 48..55.
IQ1_M_SCALE_WORDS = 48
DEQUANT_TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ2_XXS, T.MXFP4,
                 T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL, T.IQ4_XS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S,
                 T.IQ1_S, T.IQ1_M]
QUANT_TYPES = [T.F16, T.BF16, T.Q8_0, T.MXFP4]
TYPE_NAMES = {T.F32: "f32", T.F16: "f16", T.BF16: "bf16", T.Q8_0: "q8_0", T.Q2_K: "q2_K", T.Q3_K: "q3_K",
              T.Q4_K: "q4_K", T.Q5_K: "q5_K", T.Q6_K: "q6_K", T.IQ2_XXS: "iq2_xxs", T.MXFP4: "mxfp4",
              T.Q4_0: "q4_0", T.Q4_1: "q4_1", T.Q5_0: "q5_0", T.Q5_1: "q5_1", T.IQ4_NL: "iq4_nl",
              T.IQ4_XS: "iq4_xs", T.IQ2_XS: "iq2_xs", T.IQ2_S: "iq2_s", T.IQ3_XXS: "iq3_xxs", T.IQ3_S: "iq3_s",
              T.IQ1_S: "iq1_s", T.IQ1_M: "iq1_m"}


def sane_scales(rng: np.random.Generator, count: int) -> np.ndarray:
    """fp16 values 2^-24 .. 2^8 of random sign (subnormals included), as uint16 bits."""
    exponent = rng.uniform(-24.0, 8.0, count)
    values = np.exp2(exponent) * rng.choice([-1.0, 1.0], count)
    return values.astype(np.float16).view(np.uint16)


def random_blocks(rng: np.random.Generator, qtype: T, n_blocks: int) -> np.ndarray:
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for off in FP16_SCALE_OFFSETS.get(qtype, []):
        data[:, off:off + 2] = sane_scales(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    if qtype == T.IQ1_M:
        d = sane_scales(rng, n_blocks).astype(np.uint16)
        words = data[:, IQ1_M_SCALE_WORDS:IQ1_M_SCALE_WORDS + 8].copy().view(np.uint16)
        for k in range(4):
            words[:, k] = (words[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
        data[:, IQ1_M_SCALE_WORDS:IQ1_M_SCALE_WORDS + 8] = words.view(np.uint8)
    return data


def run_cli(*args: str) -> None:
    r = subprocess.run([CLI, "quant", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise AssertionError(f"dsv4 quant {' '.join(args)} failed ({r.returncode}): {r.stderr}")


def same_bits(ours: np.ndarray, theirs: np.ndarray) -> np.ndarray:
    """Per-element equality of f32 bit patterns; two NaNs count as equal only with equal bits."""
    return ours.view(np.uint32) == theirs.view(np.uint32)


def check_dequantize(tmp: str, rng: np.random.Generator) -> list[str]:
    failures = []
    for qtype in DEQUANT_TYPES:
        block_elems, _ = GGML_QUANT_SIZES[qtype]
        n_blocks = 4096 if block_elems > 1 else 64 * 1024
        blocks = random_blocks(rng, qtype, n_blocks)
        src, dst = os.path.join(tmp, "in.bin"), os.path.join(tmp, "out.f32")
        blocks.tofile(src)
        run_cli("dequant", "--type", TYPE_NAMES[qtype], src, dst)
        ours = np.fromfile(dst, dtype=np.float32)
        with np.errstate(over="ignore", invalid="ignore"):  # MXFP4 exponents near 255 overflow to inf
            theirs = np.asarray(quants.dequantize(blocks.reshape(-1), qtype), dtype=np.float32).reshape(-1)
        if ours.shape != theirs.shape:
            failures.append(f"{qtype.name}: {ours.size} values, gguf gives {theirs.size}")
            continue
        ok = same_bits(ours, theirs)
        finite = np.isfinite(theirs).mean()
        print(f"dequant {qtype.name:8s} {ours.size:8d} values, {finite:7.2%} finite: "
              f"{int((~ok).sum())} differ")
        if not ok.all():
            i = int(np.argmax(~ok))
            failures.append(f"{qtype.name}: {int((~ok).sum())} of {ok.size} values differ; first at {i}: "
                            f"dsv4 {ours[i]!r} (0x{ours.view(np.uint32)[i]:08x}) vs gguf {theirs[i]!r} "
                            f"(0x{theirs.view(np.uint32)[i]:08x}), block {i // block_elems}: "
                            f"{blocks[i // block_elems].tobytes().hex()}")
    return failures


def check_quantize(tmp: str, rng: np.random.Generator) -> list[str]:
    failures = []
    for qtype in QUANT_TYPES:
        block_elems, _ = GGML_QUANT_SIZES[qtype]
        n = 4096 * 32
        # Normal values with a per-block spread of magnitudes, exact zeros and ties for rounding.
        x = (rng.standard_normal(n) * np.exp2(rng.integers(-20, 10, n // 32)).repeat(32)).astype(np.float32)
        x[rng.integers(0, n, n // 50)] = 0.0
        x[: 32 * 8] = np.round(x[: 32 * 8] * 4) / 4
        src, dst = os.path.join(tmp, "in.f32"), os.path.join(tmp, "out.bin")
        x.tofile(src)
        run_cli("quantize", "--type", TYPE_NAMES[qtype], src, dst)
        ours = np.fromfile(dst, dtype=np.uint8)
        theirs = np.asarray(quants.quantize(x, qtype)).view(np.uint8).reshape(-1)
        block_bytes = GGML_QUANT_SIZES[qtype][1]
        differ = (ours.reshape(-1, block_bytes) != theirs.reshape(-1, block_bytes)).any(axis=1)
        print(f"quant   {qtype.name:8s} {differ.size:8d} blocks: {int(differ.sum())} differ")
        if differ.any():
            b = int(np.argmax(differ))
            failures.append(f"{qtype.name}: {int(differ.sum())} of {differ.size} blocks differ; first block {b}: "
                            f"dsv4 {ours.reshape(-1, block_bytes)[b].tobytes().hex()} vs gguf "
                            f"{theirs.reshape(-1, block_bytes)[b].tobytes().hex()} "
                            f"input {x[b * block_elems:(b + 1) * block_elems].tolist()}")
    return failures


def check_cli_errors(tmp: str) -> list[str]:
    """Bad input is refused with exit code 1 and a message naming the problem."""
    failures = []
    short = os.path.join(tmp, "short.bin")
    with open(short, "wb") as f:
        f.write(bytes(35))  # one Q8_0 block is 34 bytes
    out = os.path.join(tmp, "out.bin")
    cases = [
        (["dequant", "--type", "q9_9", short, out], "not a ggml type name"),
        (["dequant", "--type", "tq1_0", short, out], "does not decode"),
        (["dequant", "--type", "q8_0", short, out], "not a whole number of q8_0 blocks"),
        (["quantize", "--type", "iq2_xxs", short, out], "no quantiser"),
        (["dequant", "--type", "q8_0", os.path.join(tmp, "missing.bin"), out], "cannot open"),
    ]
    for args, expected in cases:
        r = subprocess.run([CLI, "quant", *args], capture_output=True, text=True)
        if r.returncode != 1 or expected not in r.stderr:
            failures.append(f"dsv4 quant {' '.join(args)}: exit {r.returncode}, stderr {r.stderr!r}; "
                            f"expected exit 1 and {expected!r}")
    return failures


def main() -> int:
    print(f"seed {SEED} (DSV4_TEST_SEED to replay)")
    rng = np.random.default_rng(SEED)
    with tempfile.TemporaryDirectory() as tmp:
        failures = check_dequantize(tmp, rng) + check_quantize(tmp, rng) + check_cli_errors(tmp)
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
