#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_safetensors into fuzz/corpus/safetensors/.

Valid files come from the `safetensors` package (the reference writer); malformed ones are
hand-built headers that each break one rule the reader checks. Usage:
    python3 fuzz/corpus/make_safetensors_seeds.py [out_dir]
"""
import json
import struct
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save


def raw(header, data=b""):
    """A file with `header` (a dict or a raw string) as its JSON header."""
    text = header if isinstance(header, str) else json.dumps(header)
    body = text.encode()
    return struct.pack("<Q", len(body)) + body + data


def main():
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "safetensors"
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    seeds = {
        "valid_f32.safetensors": save({"w": rng.standard_normal((2, 3)).astype(np.float32)},
                                      metadata={"format": "pt"}),
        "valid_mixed.safetensors": save({
            "a.weight": rng.standard_normal((4, 2)).astype(np.float16),
            "b.scale": rng.integers(0, 255, (3,), dtype=np.uint8),
            "c.bias": rng.integers(-9, 9, (2, 2), dtype=np.int64),
            "scalar": np.array(1.5, dtype=np.float64),
            "empty": np.zeros((0, 4), dtype=np.float32),
        }),
        "valid_fp8_names.safetensors": raw({
            "__metadata__": {"format": "pt"},
            "x.weight": {"dtype": "F8_E4M3", "shape": [2, 4], "data_offsets": [0, 8]},
            "x.scale": {"dtype": "F8_E8M0", "shape": [2], "data_offsets": [8, 10]},
            "y": {"dtype": "BF16", "shape": [3], "data_offsets": [10, 16]},
        }, bytes(range(16))),
        "bad_short.safetensors": b"\x05\x00\x00",
        "bad_header_len.safetensors": struct.pack("<Q", 1 << 40) + b"{}",
        "bad_truncated_header.safetensors": struct.pack("<Q", 64) + b'{"a":',
        "bad_json.safetensors": raw('{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]'),
        "bad_not_object.safetensors": raw("[1, 2]"),
        "bad_dtype.safetensors": raw({"a": {"dtype": "F7", "shape": [1], "data_offsets": [0, 1]}}, b"x"),
        "bad_missing_key.safetensors": raw({"a": {"dtype": "F32", "shape": [1]}}, b"xxxx"),
        "bad_size.safetensors": raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"xxxx"),
        "bad_range.safetensors": raw({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}, b"xxxx"),
        "bad_backwards.safetensors": raw({"a": {"dtype": "U8", "shape": [0], "data_offsets": [4, 0]}}, b"xxxx"),
        "bad_overflow.safetensors": raw({"a": {"dtype": "F64", "shape": [1 << 62, 8], "data_offsets": [0, 0]}}),
        "bad_negative.safetensors": raw({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, b"x"),
        "bad_overlap.safetensors": raw({
            "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
            "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
        }, b"xxxxxx"),
        "bad_metadata.safetensors": raw({"__metadata__": {"k": 1}}),
    }
    for name, data in seeds.items():
        (out / name).write_bytes(data)


if __name__ == "__main__":
    main()
