#!/usr/bin/env python3
"""Writes the malformed GGUF corpus (tests/data/gguf-malformed/) and the GGUF fuzz seeds
(fuzz/corpus/gguf/: small valid files plus the malformed ones).

Each malformed file breaks one rule the reader checks; tests/gguf/test_gguf_malformed.cpp
opens each and checks that the error names the field. The bytes are built by hand with
struct so every field can be made wrong on purpose. Deterministic: rerunning rewrites the
same bytes. Usage: python3 tests/data/make_malformed_gguf.py
"""
import base64
import pathlib
import shutil
import struct

ROOT = pathlib.Path(__file__).resolve().parents[2]
MALFORMED_DIR = ROOT / "tests" / "data" / "gguf-malformed"
SEED_DIR = ROOT / "fuzz" / "corpus" / "gguf"

# Issue 9's reproducer, as fuzz_gguf found it: general.alignment = 2^30 in a 64-byte file
# with no tensors. The reader accepted it and `dsv4 gguf copy` padded the copy's header to
# 1 GiB (std::bad_alloc under a 2 GiB limit). "alignment_huge.gguf" must be these bytes.
ISSUE_9_REPRODUCER = "R0dVRgMAAAAAAAAAAAAAAAEAAAAAAAAAEQAAAAAAAABnZW5lcmFsLmFsaWdubWVudAQAAAAAAABAAAAAAAAAAA=="

# GGUF value type ids
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
# ggml type ids used here
GGML_F32, GGML_Q8_0, GGML_I32 = 0, 8, 26


def gstr(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype, payload):
    return gstr(key) + struct.pack("<I", vtype) + payload


def kv_u32(key, x):
    return kv(key, U32, struct.pack("<I", x))


def kv_str(key, s):
    return kv(key, STRING, gstr(s))


def split_kvs(no, count, total):
    return [kv("split.no", U16, struct.pack("<H", no)), kv("split.count", U16, struct.pack("<H", count)),
            kv("split.tensors.count", I32, struct.pack("<i", total))]


def tinfo(name, ne, ggml_type, offset):
    return gstr(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne) + \
        struct.pack("<IQ", ggml_type, offset)


def gguf(kvs=(), tensors=(), data=b"", alignment=32, version=3, magic=b"GGUF", n_kv=None, n_tensors=None,
         pad=True):
    """A GGUF image: header, key-values, tensor infos, padding to `alignment`, data."""
    head = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    if pad:
        body += b"\0" * ((alignment - len(body) % alignment) % alignment)
    return body + data


def f32_tensor_data(n, seed):
    return b"".join(struct.pack("<f", (seed * 31 + i) * 0.25 - 3.0) for i in range(n))


def valid_files():
    """Small well-formed files: fuzz seeds, and the base the malformed ones are cut from."""
    a = f32_tensor_data(8, 1)
    b = f32_tensor_data(4, 2)
    two_tensors = [tinfo("a.weight", [8], GGML_F32, 0), tinfo("b.weight", [2, 2], GGML_F32, 32)]
    two_data = a + b + b"\0" * 16
    every_type = [
        kv_str("general.architecture", "deepseek4"),
        kv("t.u8", U8, b"\xff"), kv("t.i8", I8, b"\x80"), kv("t.u16", U16, struct.pack("<H", 65535)),
        kv("t.i16", I16, struct.pack("<h", -2)), kv_u32("t.u32", 7), kv("t.i32", I32, struct.pack("<i", -7)),
        kv("t.f32", F32, struct.pack("<f", 0.5)), kv("t.bool", BOOL, b"\x01"), kv_str("t.str", "h\xe9llo"),
        kv("t.u64", U64, struct.pack("<Q", 1 << 63)), kv("t.i64", I64, struct.pack("<q", -(1 << 62))),
        kv("t.f64", F64, struct.pack("<d", 1e-300)),
        kv("t.arr_u32", ARRAY, struct.pack("<IQ", U32, 3) + struct.pack("<3I", 0, 4, 128)),
        kv("t.arr_str", ARRAY, struct.pack("<IQ", STRING, 2) + gstr("x") + gstr("")),
        kv("t.arr_nested", ARRAY, struct.pack("<IQ", ARRAY, 2) + struct.pack("<IQ", I8, 1) + b"\x05" +
           struct.pack("<IQ", STRING, 1) + gstr("yz")),
    ]
    q8 = struct.pack("<e", 0.5) + bytes(range(32))
    return {
        "valid_empty.gguf": gguf(),
        "valid_every_type.gguf": gguf(every_type),
        "valid_two_tensors.gguf": gguf([kv_str("general.architecture", "deepseek4")], two_tensors, two_data),
        "valid_align64.gguf": gguf([kv_u32("general.alignment", 64)],
                                   [tinfo("a", [8], GGML_F32, 0), tinfo("q", [32], GGML_Q8_0, 64)],
                                   a + b"\0" * 32 + q8 + b"\0" * 30, alignment=64),
        # The largest alignment the reader accepts; no tensors, so no padding is needed.
        "valid_align_max.gguf": gguf([kv_u32("general.alignment", 1 << 16)], pad=False),
        "valid_i32.gguf": gguf([], [tinfo("ids", [3, 2], GGML_I32, 0)], struct.pack("<6i", 1, 2, 3, 4, 5, 6) +
                               b"\0" * 8),
    }


def malformed_files():
    one_tensor = [tinfo("w", [8], GGML_F32, 0)]
    data32 = f32_tensor_data(8, 3)
    files = {
        "empty.gguf": b"",
        "bad_magic.gguf": gguf(magic=b"GGML"),
        "version_1.gguf": gguf(version=1),
        "version_big_endian.gguf": gguf(version=3 << 24),
        "truncated_counts.gguf": b"GGUF" + struct.pack("<IQ", 3, 0)[:10],
        "kv_count_huge.gguf": gguf(n_kv=1 << 60),
        "tensor_count_huge.gguf": gguf(n_tensors=1 << 40),
        "tensor_count_cannot_fit.gguf": gguf(n_tensors=1000),
        "key_length_past_end.gguf": gguf([struct.pack("<Q", 1000) + b"key" + b"\0" * 16], pad=False),
        "duplicate_key.gguf": gguf([kv_u32("a", 1), kv_u32("a", 2)]),
        "empty_key.gguf": gguf([kv_u32("a", 1), kv_u32("", 2)]),
        "unknown_value_type.gguf": gguf([kv("a", 13, b"\0" * 8)]),
        "string_value_past_end.gguf": gguf([kv("general.name", STRING, struct.pack("<Q", 1000) + b"abc")],
                                           pad=False),
        "string_value_huge.gguf": gguf([kv("general.name", STRING, struct.pack("<Q", (1 << 64) - 1))], pad=False),
        "array_length_huge.gguf": gguf([kv("arr", ARRAY, struct.pack("<IQ", U32, 1 << 62))]),
        "array_unknown_elem_type.gguf": gguf([kv("arr", ARRAY, struct.pack("<IQ", 99, 1) + b"\0" * 8)]),
        "array_nested_too_deep.gguf": gguf([kv("deep", ARRAY, struct.pack("<IQ", ARRAY, 1) * 20 +
                                               struct.pack("<IQ", U8, 0))]),
        "array_string_elem_past_end.gguf": gguf([kv("words", ARRAY, struct.pack("<IQ", STRING, 2) + gstr("ok") +
                                                    struct.pack("<Q", 1000))], pad=False),
        "invalid_bool.gguf": gguf([kv("flag", BOOL, b"\x02")]),
        "truncated_in_value.gguf": gguf([kv_u32("a", 1)])[:24 + 9 + 4 + 2],
        "alignment_not_power_of_two.gguf": gguf([kv_u32("general.alignment", 48)]),
        "alignment_zero.gguf": gguf([kv_u32("general.alignment", 0)]),
        "alignment_wrong_type.gguf": gguf([kv("general.alignment", U64, struct.pack("<Q", 64))]),
        # Powers of two above the 64 KiB limit: with no tensors nothing else bounds them.
        "alignment_huge.gguf": gguf([kv_u32("general.alignment", 1 << 30)]),
        "alignment_largest_u32.gguf": gguf([kv_u32("general.alignment", 1 << 31)]),
        "alignment_above_limit.gguf": gguf([kv_u32("general.alignment", 1 << 17)], one_tensor, data32,
                                           alignment=1 << 17, pad=False),
        # Lengths inside nested arrays are bounded like top-level ones.
        "array_nested_length_huge.gguf": gguf([kv("nest", ARRAY, struct.pack("<IQ", ARRAY, 1) +
                                                  struct.pack("<IQ", U8, 1 << 60))]),
        "array_string_count_huge.gguf": gguf([kv("tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", STRING, 1 << 40))]),
        "array_nested_string_length_huge.gguf": gguf([kv("nest", ARRAY, struct.pack("<IQ", ARRAY, 1) +
                                                         struct.pack("<IQ", STRING, 1) + struct.pack("<Q", 1 << 63))],
                                                     pad=False),
        "tensor_name_length_huge.gguf": gguf([], [struct.pack("<Q", 1 << 50) + b"w" + b"\0" * 32], pad=False),
        "tensor_empty_name.gguf": gguf([], [tinfo("", [8], GGML_F32, 0)], data32),
        "tensor_too_many_dims.gguf": gguf([], [tinfo("w", [1, 1, 1, 1, 1], GGML_F32, 0)], data32),
        "tensor_zero_dim.gguf": gguf([], [tinfo("w", [8, 0], GGML_F32, 0)], data32),
        "tensor_dims_overflow.gguf": gguf([], [tinfo("w", [1 << 32, 1 << 32], GGML_F32, 0)], data32),
        "tensor_bytes_overflow.gguf": gguf([], [tinfo("w", [1 << 31, 1 << 31], GGML_F32, 0)], data32),
        "tensor_unknown_type.gguf": gguf([], [tinfo("w", [8], 99, 0)], data32),
        "tensor_row_not_whole_blocks.gguf": gguf([], [tinfo("w", [33], GGML_Q8_0, 0)], data32 + data32),
        "tensor_misaligned_offset.gguf": gguf([], [tinfo("w", [4], GGML_F32, 4)], data32),
        "tensor_data_past_end.gguf": gguf([], [tinfo("w", [16], GGML_F32, 0)], data32),
        "tensor_offset_overflow.gguf": gguf([], [tinfo("w", [8], GGML_F32, (1 << 64) - 32)], data32),
        "tensor_data_section_missing.gguf": gguf([], one_tensor, pad=False),
        "tensors_overlap.gguf": gguf([], [tinfo("w1", [16], GGML_F32, 0), tinfo("w2", [8], GGML_F32, 32)],
                                     data32 + data32),
        "duplicate_tensor_name.gguf": gguf([], [tinfo("w", [8], GGML_F32, 0), tinfo("w", [8], GGML_F32, 32)],
                                           data32 + data32),
        "truncated_tensor_info.gguf": gguf([], one_tensor, data32)[:24 + 8 + 1 + 4 + 8 + 4 + 6],
        "split_count_wrong_type.gguf": gguf([kv_str("split.count", "two")]),
        "split_count_huge.gguf": gguf([kv("split.no", U16, struct.pack("<H", 0)), kv_u32("split.count", 100000)]),
        "split_no_missing.gguf": gguf([kv("split.count", U16, struct.pack("<H", 2))]),
        "split_no_out_of_range-00001-of-00002.gguf": gguf([kv("split.no", U16, struct.pack("<H", 5)),
                                                           kv("split.count", U16, struct.pack("<H", 2))]),
        "split_wrong_name.gguf": gguf(split_kvs(0, 2, 1), one_tensor, data32),
        "split_missing-00001-of-00002.gguf": gguf(split_kvs(0, 2, 2), one_tensor, data32),
    }
    # Sets whose parts disagree; the first part is the one the test opens.
    w2 = [tinfo("w2", [8], GGML_F32, 0)]
    files["split_count_disagree-00001-of-00002.gguf"] = gguf(split_kvs(0, 2, 2), one_tensor, data32)
    files["split_count_disagree-00002-of-00002.gguf"] = gguf(split_kvs(1, 3, 2), w2, data32)
    files["split_total_disagree-00001-of-00002.gguf"] = gguf(split_kvs(0, 2, 2), one_tensor, data32)
    files["split_total_disagree-00002-of-00002.gguf"] = gguf(split_kvs(1, 2, 3), w2, data32)
    files["split_tensor_count_wrong-00001-of-00002.gguf"] = gguf(split_kvs(0, 2, 5), one_tensor, data32)
    files["split_tensor_count_wrong-00002-of-00002.gguf"] = gguf(split_kvs(1, 2, 5), w2, data32)
    files["split_part_swapped-00001-of-00002.gguf"] = gguf(split_kvs(0, 2, 2), one_tensor, data32)
    files["split_part_swapped-00002-of-00002.gguf"] = gguf(split_kvs(0, 2, 2), w2, data32)
    files["split_duplicate_tensor-00001-of-00002.gguf"] = gguf(split_kvs(0, 2, 2), one_tensor, data32)
    files["split_duplicate_tensor-00002-of-00002.gguf"] = gguf(split_kvs(1, 2, 2), one_tensor, data32)
    files["split_part_corrupt-00001-of-00002.gguf"] = gguf(split_kvs(0, 2, 2), one_tensor, data32)
    files["split_part_corrupt-00002-of-00002.gguf"] = gguf(split_kvs(1, 2, 2), w2, data32)[:30]
    return files


def write_dir(directory, files):
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    for name, data in sorted(files.items()):
        (directory / name).write_bytes(data)


def main():
    malformed = malformed_files()
    assert malformed["alignment_huge.gguf"] == base64.b64decode(ISSUE_9_REPRODUCER)
    write_dir(MALFORMED_DIR, malformed)
    seeds = dict(valid_files())
    seeds.update({"malformed_" + k: v for k, v in malformed.items()})
    write_dir(SEED_DIR, seeds)
    print(f"wrote {len(malformed)} files to {MALFORMED_DIR} and {len(seeds)} to {SEED_DIR}")


if __name__ == "__main__":
    main()
