#!/usr/bin/env python3
"""GGUF interop with the Python `gguf` package (llama.cpp's reference implementation).

(a) gguf.GGUFWriter writes files with every value type, nested arrays, several tensor types,
    a custom alignment and a split set; `dsv4 gguf dump --json --tensor-data-hash` (our
    reader) must report identical metadata and tensor bytes.
(b) `dsv4 gguf copy` (our reader + writer, optionally re-aligning or splitting) rewrites
    those files; gguf.GGUFReader must read back identical fields and tensor bytes.
Run by ctest with DSV4_CLI set to the built dsv4 program.
"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import zlib

import numpy as np
import gguf
from gguf import GGUFValueType as VT

CLI = os.environ.get("DSV4_CLI", "dsv4")
SEED = int(os.environ.get("DSV4_TEST_SEED", "0")) or int.from_bytes(os.urandom(4), "little")

FAILURES = []


def check(cond, what):
    if not cond:
        FAILURES.append(what)
        print("FAIL:", what, file=sys.stderr)


def cli(*args):
    r = subprocess.run([CLI, "gguf", *map(str, args)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"dsv4 gguf {' '.join(map(str, args))} failed ({r.returncode}): {r.stderr}")
    return r.stdout


def dump(path):
    return json.loads(cli("dump", "--json", "--tensor-data-hash", path))


# key -> (value, GGUF type, array element type); every type GGUF defines.
METADATA = {
    "test.u8": (255, VT.UINT8, None),
    "test.i8": (-128, VT.INT8, None),
    "test.u16": (65535, VT.UINT16, None),
    "test.i16": (-32768, VT.INT16, None),
    "test.u32": (4294967295, VT.UINT32, None),
    "test.i32": (-2147483648, VT.INT32, None),
    "test.u64": (18446744073709551615, VT.UINT64, None),
    "test.i64": (-9223372036854775808, VT.INT64, None),
    "test.f32": (float(np.float32(-1.5e-7)), VT.FLOAT32, None),
    "test.f64": (3.141592653589793, VT.FLOAT64, None),
    "test.bool": (True, VT.BOOL, None),
    "test.string": ("h\u00e9llo \"w\"\n\tworld <\uff5cbegin\u2581of\u2581sentence\uff5c>", VT.STRING, None),
    "test.empty_string": ("", VT.STRING, None),
    "test.array_u8": ([0, 7, 255], VT.ARRAY, VT.UINT8),
    "test.array_i8": ([-1, 127], VT.ARRAY, VT.INT8),
    "test.array_u16": ([1, 65535], VT.ARRAY, VT.UINT16),
    "test.array_i16": ([-300, 300], VT.ARRAY, VT.INT16),
    "test.array_u32": ([0, 0, 4, 128, 4], VT.ARRAY, VT.UINT32),
    "test.array_i32": ([-1, 2, -3], VT.ARRAY, VT.INT32),
    "test.array_u64": ([1 << 63, 5], VT.ARRAY, VT.UINT64),
    "test.array_i64": ([-(1 << 62)], VT.ARRAY, VT.INT64),
    "test.array_f32": ([10.0, -0.25, float(np.float32(1e-6))], VT.ARRAY, VT.FLOAT32),
    "test.array_f64": ([1e300, -2.5], VT.ARRAY, VT.FLOAT64),
    "test.array_bool": ([True, False, True], VT.ARRAY, VT.BOOL),
    "test.array_string": (["<\uff5cUser\uff5c>", "", "\u0120the", "a b"], VT.ARRAY, VT.STRING),
    "test.array_nested": ([[1, 2, 3], [7]], VT.ARRAY, VT.ARRAY),
    "test.array_nested_strings": ([["x", "yz"], ["w"]], VT.ARRAY, VT.ARRAY),
}
TYPE_NAMES = {VT.UINT8: "u8", VT.INT8: "i8", VT.UINT16: "u16", VT.INT16: "i16", VT.UINT32: "u32", VT.INT32: "i32",
              VT.UINT64: "u64", VT.INT64: "i64", VT.FLOAT32: "f32", VT.FLOAT64: "f64", VT.BOOL: "bool",
              VT.STRING: "string", VT.ARRAY: "array"}


def make_tensors(rng):
    """name -> (numpy array as GGUFWriter takes it, raw dtype or None, raw bytes)."""
    out = {}
    f32 = rng.standard_normal((3, 64)).astype(np.float32)
    out["blk.0.attn_norm.weight"] = (f32, None)
    out["blk.0.hc_attn_base.weight"] = (rng.standard_normal(24).astype(np.float16), None)
    out["blk.0.ffn_gate_tid2eid.weight"] = (rng.integers(-1000, 1000, (5, 6)).astype(np.int32), None)
    # A Q8_0 tensor of 2 rows x 64 elements: raw blocks of 34 bytes.
    q8 = rng.integers(0, 256, (2, 2 * 34)).astype(np.uint8)
    out["blk.0.attn_q_a.weight"] = (q8, gguf.GGMLQuantizationType.Q8_0)
    return out


def write_python_file(path, tensors, alignment=None, split_max_tensors=0):
    w = gguf.GGUFWriter(path, "deepseek4", split_max_tensors=split_max_tensors)
    if alignment:
        w.add_custom_alignment(alignment)
    for key, (value, vtype, sub) in METADATA.items():
        w.add_key_value(key, value, vtype, sub_type=sub if sub != VT.ARRAY else None)
    for name, (arr, raw) in tensors.items():
        if raw is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def same_value(got, want, vtype):
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(
            same_value(g, x, vtype) for g, x in zip(got, want))
    if vtype == VT.FLOAT32:
        return got == float(np.float32(want))
    return got == want and type(got) is type(want)


def check_dump_matches(d, tensors, where, alignment=32):
    md = {m["key"]: m for m in d["metadata"]}
    check(md["general.architecture"]["value"] == "deepseek4", f"{where}: general.architecture")
    check(d["alignment"] == alignment, f"{where}: alignment {d['alignment']} != {alignment}")
    for key, (value, vtype, sub) in METADATA.items():
        m = md.get(key)
        check(m is not None, f"{where}: {key} missing")
        if m is None:
            continue
        check(m["type"] == TYPE_NAMES[vtype], f"{where}: {key} type {m['type']} != {TYPE_NAMES[vtype]}")
        if sub is not None:
            check(m["elem_type"] == TYPE_NAMES[sub], f"{where}: {key} elem_type {m['elem_type']}")
        elem = sub if sub not in (None, VT.ARRAY) else vtype
        check(same_value(m["value"], value, elem), f"{where}: {key} = {m['value']!r}, want {value!r}")
    by_name = {t["name"]: t for t in d["tensors"]}
    check(len(by_name) == len(tensors), f"{where}: {len(by_name)} tensors, want {len(tensors)}")
    for name, (arr, raw) in tensors.items():
        t = by_name.get(name)
        check(t is not None, f"{where}: tensor {name} missing")
        if t is None:
            continue
        data = np.ascontiguousarray(arr).tobytes()
        check(t["nbytes"] == len(data), f"{where}: {name} nbytes {t['nbytes']} != {len(data)}")
        check(t["crc32"] == f"{zlib.crc32(data):08x}", f"{where}: {name} bytes differ")
        if raw is None:
            check(t["ne"] == list(reversed(arr.shape)), f"{where}: {name} ne {t['ne']} vs shape {arr.shape}")
        else:
            check(t["type"] == "q8_0" and t["ne"] == [64, 2], f"{where}: {name} {t['type']} {t['ne']}")


def reader_fields(path):
    """GGUFReader's view: key -> (types, raw bytes of the value), and tensors."""
    r = gguf.GGUFReader(path)
    fields = {}
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name.startswith("split."):
            continue
        # parts[0..1] are the key's length and bytes, parts[2] the type; the rest encode the value.
        fields[name] = (list(f.types), b"".join(bytes(p.tobytes()) for p in f.parts[3:]))
    tensors = {t.name: (int(t.tensor_type), [int(x) for x in t.shape], bytes(t.data.tobytes())) for t in r.tensors}
    return fields, tensors, r


def check_reader_equal(a_path, b_path, where, drop_keys=()):
    fa, ta, _ = reader_fields(a_path)
    fb, tb, _ = reader_fields(b_path)
    for k in drop_keys:
        fa.pop(k, None)
        fb.pop(k, None)
    check(list(fa) == list(fb), f"{where}: keys differ: {list(fa)} vs {list(fb)}")
    for k in fa:
        check(fa[k] == fb.get(k), f"{where}: field {k} differs")
    check(ta == tb, f"{where}: tensors differ")


def main():
    rng = np.random.default_rng(SEED)
    tensors = make_tensors(rng)
    with tempfile.TemporaryDirectory(dir=os.environ.get("DSV4_BINARY_DIR")) as tmp:
        tmp = pathlib.Path(tmp)
        # (a) Python writes, we read.
        py_file = tmp / "py.gguf"
        write_python_file(py_file, tensors)
        check_dump_matches(dump(py_file), tensors, "python file")
        py64 = tmp / "py64.gguf"
        write_python_file(py64, tensors, alignment=64)
        check_dump_matches(dump(py64), tensors, "python file, alignment 64", alignment=64)
        py_split = tmp / "pysplit.gguf"
        write_python_file(py_split, tensors, split_max_tensors=2)
        parts = sorted(tmp.glob("pysplit-*.gguf"))
        check(len(parts) == 2, f"python split wrote {parts}")
        d = dump(parts[-1])
        check(len(d["parts"]) == 2, "python split set: both parts opened")
        check_dump_matches(d, tensors, "python split set")

        # (b) We write (copy), Python reads.
        ours = tmp / "ours.gguf"
        cli("copy", py_file, ours)
        check(ours.read_bytes() == py_file.read_bytes(), "copy of a python file is byte-identical")
        check_reader_equal(py_file, ours, "copy")
        ours128 = tmp / "ours128.gguf"
        cli("copy", "--alignment", 128, py_file, ours128)
        check_reader_equal(py_file, ours128, "copy --alignment 128", drop_keys=("general.alignment",))
        _, _, r128 = reader_fields(ours128)
        check(int(r128.alignment) == 128, f"GGUFReader sees alignment {r128.alignment}")
        check(all(t.data_offset % 128 == 0 for t in r128.tensors), "tensor data 128-aligned for GGUFReader")
        merged = tmp / "merged.gguf"
        cli("copy", parts[0], merged)
        check_reader_equal(py_file, merged, "merge of the python split set")
        cli("copy", "--split-max-tensors", 3, py_file, tmp / "oursplit.gguf")
        our_parts = sorted(tmp.glob("oursplit-*.gguf"))
        check([p.name for p in our_parts] == ["oursplit-00001-of-00002.gguf", "oursplit-00002-of-00002.gguf"],
              f"our split names {our_parts}")
        _, t1, r1 = reader_fields(our_parts[0])
        _, t2, r2 = reader_fields(our_parts[1])
        for i, r in enumerate((r1, r2)):
            check(int(r.fields["split.no"].contents()) == i, f"part {i}: split.no")
            check(int(r.fields["split.count"].contents()) == 2, f"part {i}: split.count")
            check(int(r.fields["split.tensors.count"].contents()) == 4, f"part {i}: split.tensors.count")
            check(r.fields["split.no"].types == [VT.UINT16], f"part {i}: split.no is u16")
            check(r.fields["split.tensors.count"].types == [VT.INT32], f"part {i}: split.tensors.count is i32")
        _, t_all, _ = reader_fields(py_file)
        check({**t1, **t2} == t_all and len(t1) == 3, "our split parts hold the tensors")
        check_dump_matches(dump(our_parts[1]), tensors, "our split set")

    if FAILURES:
        print(f"{len(FAILURES)} failures (seed {SEED})", file=sys.stderr)
        return 1
    print("gguf interop: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
