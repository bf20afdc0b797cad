#!/usr/bin/env python3
"""Writes a sparse GGUF file the size of a large model (291 GB of holes) whose header is
as big as a real deepseek4 file's: 129,280 vocabulary strings, token types, 127,741 merges
and 1,328 tensor infos. `dsv4 gguf dump` / `dsv4 info` on it time header-only parsing
(docs/PERFORMANCE.md). Usage: bench/make_big_gguf_header.py OUT.gguf
"""
import pathlib
import struct
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "data"))
from make_malformed_gguf import ARRAY, I32, STRING, gstr, kv, kv_str, tinfo  # noqa: E402

N_VOCAB = 129280
N_MERGES = 127741
N_TENSORS = 1328
GGML_F16 = 1


def main(out):
    tokens = b"".join(gstr(f"tok{i}\u0120x") for i in range(N_VOCAB))
    merges = b"".join(gstr(f"a{i} b{i}") for i in range(N_MERGES))
    kvs = [kv_str("general.architecture", "deepseek4"),
           kv("tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", STRING, N_VOCAB) + tokens),
           kv("tokenizer.ggml.token_type", ARRAY, struct.pack("<IQ", I32, N_VOCAB) + struct.pack("<i", 1) * N_VOCAB),
           kv("tokenizer.ggml.merges", ARRAY, struct.pack("<IQ", STRING, N_MERGES) + merges)]
    infos, offset = [], 0
    for i in range(N_TENSORS):
        ne = [4096, 28672]
        infos.append(tinfo(f"blk.{i // 31}.t{i % 31}.weight", ne, GGML_F16, offset))
        offset += ne[0] * ne[1] * 2
    head = b"GGUF" + struct.pack("<IQQ", 3, len(infos), len(kvs)) + b"".join(kvs) + b"".join(infos)
    head += b"\0" * ((32 - len(head) % 32) % 32)
    with open(out, "wb") as f:
        f.write(head)
        f.truncate(len(head) + offset)
    print(f"{out}: header {len(head)} bytes, file {len(head) + offset} bytes (sparse)")


if __name__ == "__main__":
    main(sys.argv[1])
