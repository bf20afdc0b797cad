#!/usr/bin/env python3
"""Tokenizer throughput, one thread: dsv4's tokenizer (`dsv4 tokenize --json --time`, encode
time only) against Hugging Face `tokenizers` (Tokenizer.encode per string, RAYON_NUM_THREADS=1)
on the same strings: the 10,000-string test corpus plus a prose/code/CJK document repeated.

usage: bench/bench_tokenizer.py [path/to/dsv4]   (default build/dsv4)"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
here = Path(__file__).resolve().parent
sys.path.insert(0, str(here.parent / "tests" / "python"))
from tokenizer_corpus import corpus  # noqa: E402
from test_tokenizer_vs_hf import tokenizer_json_path  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

DOC = ("The quick brown fox jumps over the lazy dog. DeepSeek-V4 uses a byte-level BPE with 128,000 "
       "base tokens; its pre-tokenizer splits digits in groups of three (1234567 -> 123 456 7).\n"
       "def tokenize(text: str) -> list[int]:\n    return [ord(c) for c in text if c.isalnum()]\n\n"
       "深度求索的模型在推理时会先思考，然后回答。日本語のテキストも含まれています。\n") * 20


def main():
    cli = sys.argv[1] if len(sys.argv) > 1 else "build/dsv4"
    texts = corpus(tokenizer_json_path()) + [DOC] * 200
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    hf = Tokenizer.from_file(str(tokenizer_json_path()))
    best_hf = best_batch = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for t in texts:
            hf.encode(t, add_special_tokens=False)
        best_hf = min(best_hf, time.perf_counter() - t0)
        t0 = time.perf_counter()
        hf.encode_batch(texts, add_special_tokens=False)  # one Rust call; rayon held to 1 thread
        best_batch = min(best_batch, time.perf_counter() - t0)
    stdin = "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in texts).encode("utf-8")
    best_ours = float("inf")
    for _ in range(3):
        p = subprocess.run([cli, "tokenize", "--json", "--time"], input=stdin, capture_output=True, check=True)
        line = p.stderr.decode().strip().splitlines()[-1]
        best_ours = min(best_ours, float(line.split("encode ")[1].split(" s")[0]))
    print(f"{len(texts)} strings, {nbytes / 1e6:.2f} MB")
    print(f"tokenizers {hf_version()} encode per string: {best_hf:.3f} s, {nbytes / best_hf / 1e6:.2f} MB/s")
    print(f"tokenizers {hf_version()} encode_batch:      {best_batch:.3f} s, {nbytes / best_batch / 1e6:.2f} MB/s")
    print(f"dsv4 encode per string:              {best_ours:.3f} s, {nbytes / best_ours / 1e6:.2f} MB/s "
          f"({best_hf / best_ours:.2f}x per-string, {best_batch / best_ours:.2f}x batch)")


def hf_version():
    import tokenizers
    return tokenizers.__version__


if __name__ == "__main__":
    main()
