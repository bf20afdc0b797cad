"""`dsv4 score` end to end on the tiny-v4 fixture: the checkpoint converted with
`dsv4 convert --recipe f32`, logits written as .npy, compared with DeepSeek's official
reference outputs (fixtures/tiny-v4/README.md): QAT off strict (every row within 1e-4
relative L2, same argmax), QAT on statistical (median <= 2e-2, argmax >= 90 %), chunked
prefill identical to one call, and the MTP draft logits."""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors import safe_open


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, timeout=600)
    if p.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{p.stderr.decode(errors='replace')}")


def row_errors(got, want):
    got = got.astype(np.float64)
    want = want.astype(np.float64)
    rel = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
    return rel, float((got.argmax(1) == want.argmax(1)).mean())


def main():
    cli = os.environ.get("DSV4_CLI", "build/dsv4")
    fixture = Path(os.environ.get("DSV4_SHARED_DIR", "../shared")) / "fixtures" / "tiny-v4"
    with safe_open(str(fixture / "reference.safetensors"), framework="numpy") as f:
        ref = {k: f.get_tensor(k) for k in ["tokens", "logits_noqat", "logits_qat",
                                             "mtp_logits_noqat", "mtp_logits_qat"]}
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tmp / "tiny.gguf"
        run([cli, "convert", str(fixture / "checkpoint"), "-o", str(model), "--recipe", "f32"])
        tokens = tmp / "tokens.txt"
        tokens.write_text(" ".join(str(int(t)) for t in ref["tokens"]) + "\n")

        def score(name, *flags):
            out = tmp / f"{name}.npy"
            run([cli, "score", "-m", str(model), "--tokens", str(tokens), "-o", str(out), "-t", "2", *flags])
            return np.load(out)

        cases = [
            ("logits_noqat", score("noqat", "--no-qat"), True),
            ("logits_noqat chunk 7", score("noqat7", "--no-qat", "--chunk", "7"), True),
            ("logits_qat", score("qat", "--chunk", "5"), False),
            ("mtp_logits_noqat", score("mtp_noqat", "--no-qat", "--mtp"), True),
            ("mtp_logits_qat", score("mtp_qat", "--mtp", "--chunk", "16"), False),
        ]
        for name, got, strict in cases:
            want = ref[name.split()[0]]
            if got.shape != want.shape or got.dtype != np.float32:
                failures.append(f"{name}: shape {got.shape} {got.dtype}, expected {want.shape} float32")
                continue
            rel, argmax = row_errors(got, want)
            print(f"{name}: median {np.median(rel):.3g} max {rel.max():.3g} argmax {argmax:.1%}")
            ok = np.isfinite(got).all() and (
                (rel.max() <= 1e-4 and argmax == 1.0) if strict else (np.median(rel) <= 2e-2 and argmax >= 0.9))
            if not ok:
                failures.append(name)
        if not np.array_equal(cases[0][1], cases[1][1]):
            failures.append("chunked prefill differs from one call")
    if failures:
        sys.exit("FAILED: " + ", ".join(failures))
    print("ok")


if __name__ == "__main__":
    main()
