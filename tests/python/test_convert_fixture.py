"""`dsv4 convert` of the tiny-v4 fixture, read back with the Python `gguf` package.

The official checkpoint is decoded here independently (own safetensors parsing, FP8 E4M3 /
FP4 E2M1 / E8M0 tables written from the spec, own official -> GGUF name map), checked
against the fixture's dequant.* samples, and compared with every tensor of the converted
file: exactly for the lossless recipes (bf16, f32; MXFP4 experts), within the type's error
bound for requantised tensors (q8).
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import gguf
from gguf import quants

CLI = os.environ.get("DSV4_CLI", "dsv4")
SHARED = os.environ.get("DSV4_SHARED_DIR", os.path.join(os.path.dirname(__file__), "../../../shared"))
FIXTURE = os.path.join(SHARED, "fixtures", "tiny-v4")
CHECKPOINT = os.path.join(FIXTURE, "checkpoint")


def e4m3_table():
    t = np.zeros(256, dtype=np.float64)
    for c in range(256):
        s = -1.0 if c & 0x80 else 1.0
        e, m = (c >> 3) & 0xF, c & 0x7
        if e == 0xF and m == 0x7:
            t[c] = np.nan
        elif e == 0:
            t[c] = s * m / 8.0 * 2.0 ** -6
        else:
            t[c] = s * (1 + m / 8.0) * 2.0 ** (e - 7)
    return t


E4M3 = e4m3_table()
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)


def e8m0(b):
    return np.ldexp(1.0, b.astype(np.int64) - 127)


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    data = raw[8 + n:]
    out = {}
    for name, e in header.items():
        b, end = e["data_offsets"]
        out[name] = (e["dtype"], e["shape"], data[b:end])
    return out


def decode(tensors, name):
    """The exact float64 values of an official tensor (FP8 / FP4 with their scales)."""
    dtype, shape, buf = tensors[name]
    if dtype == "BF16":
        u = np.frombuffer(buf, dtype=np.uint16).astype(np.uint32) << 16
        return u.view(np.float32).astype(np.float64).reshape(shape)
    if dtype == "F32":
        return np.frombuffer(buf, dtype=np.float32).astype(np.float64).reshape(shape)
    if dtype == "I64":
        return np.frombuffer(buf, dtype=np.int64).reshape(shape).astype(np.float64)
    sdtype, sshape, sbuf = tensors[name[: -len(".weight")] + ".scale"]
    assert sdtype == "F8_E8M0"
    scale = e8m0(np.frombuffer(sbuf, dtype=np.uint8).reshape(sshape))
    codes = np.frombuffer(buf, dtype=np.uint8).reshape(shape)
    if dtype == "F8_E4M3":
        rows, cols = shape
        s = np.repeat(np.repeat(scale, 128, axis=0), 128, axis=1)[:rows, :cols]
        return E4M3[codes] * s
    assert dtype == "I8"
    rows = shape[0]
    vals = np.empty((rows, shape[1] * 2), dtype=np.float64)
    vals[:, 0::2] = E2M1[codes & 0x0F]
    vals[:, 1::2] = E2M1[codes >> 4]
    return vals * np.repeat(scale, 32, axis=1)


def expected_gguf_tensors(tensors, config):
    """GGUF name -> exact values, from our own reading of llama.cpp's deepseek4 names."""
    n_layers = config["num_hidden_layers"]
    n_mtp = config.get("num_nextn_predict_layers", 0)
    out = {
        "token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight", "output.weight": "head.weight",
        "output_hc_fn.weight": "hc_head_fn", "output_hc_base.weight": "hc_head_base",
        "output_hc_scale.weight": "hc_head_scale",
    }
    per_block = {
        "attn_norm.weight": "attn_norm.weight", "attn_sinks.weight": "attn.attn_sink",
        "attn_q_a.weight": "attn.wq_a.weight", "attn_q_a_norm.weight": "attn.q_norm.weight",
        "attn_q_b.weight": "attn.wq_b.weight", "attn_kv.weight": "attn.wkv.weight",
        "attn_kv_a_norm.weight": "attn.kv_norm.weight", "attn_output_a.weight": "attn.wo_a.weight",
        "attn_output_b.weight": "attn.wo_b.weight",
        "hc_attn_fn.weight": "hc_attn_fn", "hc_attn_base.weight": "hc_attn_base", "hc_attn_scale.weight": "hc_attn_scale",
        "hc_ffn_fn.weight": "hc_ffn_fn", "hc_ffn_base.weight": "hc_ffn_base", "hc_ffn_scale.weight": "hc_ffn_scale",
        "attn_compressor_kv.weight": "attn.compressor.wkv.weight",
        "attn_compressor_gate.weight": "attn.compressor.wgate.weight",
        "attn_compressor_ape.weight": "attn.compressor.ape", "attn_compressor_norm.weight": "attn.compressor.norm.weight",
        "indexer.proj.weight": "attn.indexer.weights_proj.weight", "indexer.attn_q_b.weight": "attn.indexer.wq_b.weight",
        "indexer_compressor_kv.weight": "attn.indexer.compressor.wkv.weight",
        "indexer_compressor_gate.weight": "attn.indexer.compressor.wgate.weight",
        "indexer_compressor_ape.weight": "attn.indexer.compressor.ape",
        "indexer_compressor_norm.weight": "attn.indexer.compressor.norm.weight",
        "ffn_gate_inp.weight": "ffn.gate.weight", "ffn_gate_tid2eid.weight": "ffn.gate.tid2eid",
        "exp_probs_b.bias": "ffn.gate.bias", "ffn_norm.weight": "ffn_norm.weight",
        "ffn_gate_shexp.weight": "ffn.shared_experts.w1.weight", "ffn_up_shexp.weight": "ffn.shared_experts.w3.weight",
        "ffn_down_shexp.weight": "ffn.shared_experts.w2.weight",
        "nextn.enorm.weight": "enorm.weight", "nextn.hnorm.weight": "hnorm.weight",
        "nextn.shared_head_norm.weight": "norm.weight", "nextn.hc_head_fn.weight": "hc_head_fn",
        "nextn.hc_head_base.weight": "hc_head_base", "nextn.hc_head_scale.weight": "hc_head_scale",
    }
    want = {g: decode(tensors, o) for g, o in out.items()}
    for b in range(n_layers + n_mtp):
        prefix = f"layers.{b}." if b < n_layers else f"mtp.{b - n_layers}."
        for g, o in per_block.items():
            if prefix + o in tensors:
                want[f"blk.{b}.{g}"] = decode(tensors, prefix + o)
        for g, w in (("ffn_gate_exps", "w1"), ("ffn_up_exps", "w3"), ("ffn_down_exps", "w2")):
            want[f"blk.{b}.{g}.weight"] = np.stack(
                [decode(tensors, f"{prefix}ffn.experts.{e}.{w}.weight") for e in range(config["n_routed_experts"])])
        if b >= n_layers:
            want[f"blk.{b}.nextn.eh_proj.weight"] = np.concatenate(
                [decode(tensors, prefix + "e_proj.weight"), decode(tensors, prefix + "h_proj.weight")], axis=1)
    return want


def gguf_values(t):
    if t.tensor_type == gguf.GGMLQuantizationType.I32:
        return np.asarray(t.data, dtype=np.float64)
    return np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float64)


class ConvertFixtureTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tensors = read_safetensors(os.path.join(CHECKPOINT, "model.safetensors"))
        with open(os.path.join(CHECKPOINT, "config.json")) as f:
            cls.config = json.load(f)
        cls.want = expected_gguf_tensors(cls.tensors, cls.config)
        cls.tmp = tempfile.TemporaryDirectory()

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def convert(self, recipe, *extra):
        out = os.path.join(self.tmp.name, f"tiny-{recipe}.gguf")
        r = subprocess.run([CLI, "convert", CHECKPOINT, "-o", out, "--recipe", recipe, "--force", "--bundled", *extra],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr + r.stdout)
        return gguf.GGUFReader(out), r.stdout

    def test_decoder_matches_reference_dequant_samples(self):
        ref = read_safetensors(os.path.join(FIXTURE, "reference.safetensors"))
        names = [n for n in ref if n.startswith("dequant.")]
        self.assertEqual(len(names), 4)
        for n in names:
            np.testing.assert_array_equal(decode(self.tensors, n[len("dequant."):]), decode(ref, n), err_msg=n)

    def check(self, recipe, exact_types, bounds):
        reader, _ = self.convert(recipe)
        got_names = {t.name for t in reader.tensors}
        self.assertEqual(got_names, set(self.want), "tensor names differ from the deepseek4 convention")
        arch = reader.fields["general.architecture"]
        self.assertEqual(bytes(arch.parts[arch.data[0]]).decode(), "deepseek4")
        for t in reader.tensors:
            want = self.want[t.name]
            got = gguf_values(t).reshape(want.shape)
            self.assertFalse(np.isnan(got).any(), t.name)
            kind = t.tensor_type.name
            if kind in exact_types:
                np.testing.assert_array_equal(got, want, err_msg=f"{recipe}: {t.name} ({kind})")
            else:
                amax = np.max(np.abs(want.reshape(-1, want.shape[-1])), axis=1, keepdims=True)
                err = np.abs(got - want).reshape(-1, want.shape[-1])
                self.assertTrue(np.all(err <= bounds[kind] * amax), f"{recipe}: {t.name} ({kind}) error")

    def test_bf16_recipe_is_exact(self):
        self.check("bf16", {"BF16", "F32", "I32", "MXFP4"}, {})

    def test_f32_recipe_is_exact(self):
        self.check("f32", {"F32", "I32", "MXFP4"}, {})

    def test_q8_recipe_within_bounds(self):
        self.check("q8", {"F32", "I32"}, {"Q8_0": 1 / 127, "BF16": 1 / 128, "MXFP4": 1 / 3})

    def test_info_accepts_the_converted_file(self):
        self.convert("bf16")
        out = os.path.join(self.tmp.name, "tiny-bf16.gguf")
        r = subprocess.run([CLI, "info", out], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("catalog check: ok", r.stdout)
        self.assertIn("architecture: deepseek4", r.stdout)

    def test_refuses_to_overwrite_without_force(self):
        out = os.path.join(self.tmp.name, "precious.gguf")
        with open(out, "w") as f:
            f.write("keep me")
        r = subprocess.run([CLI, "convert", CHECKPOINT, "-o", out], capture_output=True, text=True)
        self.assertEqual(r.returncode, 1)
        self.assertIn("--force", r.stderr)
        with open(out) as f:
            self.assertEqual(f.read(), "keep me")

    def test_truncated_checkpoint_fails_without_output(self):
        broken = os.path.join(self.tmp.name, "broken")
        shutil.copytree(CHECKPOINT, broken)
        shard = os.path.join(broken, "model.safetensors")
        os.truncate(shard, os.path.getsize(shard) - 4096)
        out = os.path.join(self.tmp.name, "broken.gguf")
        r = subprocess.run([CLI, "convert", broken, "-o", out, "--recipe", "bf16"], capture_output=True, text=True)
        self.assertEqual(r.returncode, 1)
        self.assertIn("model.safetensors", r.stderr)
        self.assertIn("truncated", r.stderr)
        self.assertEqual([f for f in os.listdir(self.tmp.name) if f.startswith("broken.gguf")], [])

    def test_all_f32_override_is_exact(self):
        reader, _ = self.convert("bf16", "--type", "all=f32")
        types = {t.tensor_type.name for t in reader.tensors}
        self.assertEqual(types, {"F32", "I32"})
        for t in reader.tensors:
            want = self.want[t.name]
            np.testing.assert_array_equal(gguf_values(t).reshape(want.shape), want, err_msg=t.name)


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0], "-v"])
