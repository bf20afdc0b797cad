"""`dsv4 synth` files read with the Python `gguf` package (llama.cpp's reference reader).

Writes the tiny preset with Q2_K experts and Q8_0 matrices, then checks with gguf.GGUFReader
that the architecture keys, the tokenizer and every tensor's name, ggml shape and type are
what llama.cpp's deepseek4 loader expects, and that the weights gguf-py dequantises follow
the recipe (norms near 1, embedding variance 1, expert gains 3.5 and 5, distinct hash
experts). `dsv4 info` must then describe the same file.
Run by ctest with DSV4_CLI set to the built dsv4 program.
"""
import os
import subprocess
import tempfile
import unittest

import numpy as np
import gguf
from gguf import quants

CLI = os.environ.get("DSV4_CLI", "dsv4")
SEED = int(os.environ.get("DSV4_TEST_SEED", "0")) or int.from_bytes(os.urandom(4), "little")

D, VOCAB, LAYERS, EXPERTS, FFN = 256, 129280, 6, 8, 128


def field(reader, key):
    f = reader.fields[key]
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode()
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        if f.types[1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode() for i in f.data]
        return [f.parts[i][0].item() for i in f.data]
    return f.parts[f.data[0]][0].item()


def values(t):
    """The tensor as float64, outer-first (numpy) shape."""
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.I32):
        return np.asarray(t.data, dtype=np.float64)
    return quants.dequantize(t.data, t.tensor_type).astype(np.float64)


class SynthGgufTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.path = os.path.join(cls.tmp.name, "tiny.gguf")
        # The bundled layout: every tensor in one file, read whole by gguf-py (the trunk +
        # sidecar layout is covered by tests/model/test_model_files.cpp and tests/llamacpp/).
        subprocess.run([CLI, "synth", "--preset", "tiny", "--experts", "q2_K", "--dense", "q8_0", "--bundled",
                        "--seed", str(SEED), "-o", cls.path], check=True, capture_output=True)
        cls.reader = gguf.GGUFReader(cls.path)
        cls.tensors = {t.name: t for t in cls.reader.tensors}

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_metadata(self):
        r = self.reader
        self.assertEqual(field(r, "general.architecture"), "deepseek4")
        self.assertEqual(field(r, "deepseek4.block_count"), LAYERS + 1)
        self.assertEqual(field(r, "deepseek4.nextn_predict_layers"), 1)
        self.assertEqual(field(r, "deepseek4.embedding_length"), D)
        self.assertEqual(field(r, "deepseek4.attention.compress_ratios"), [0, 4, 16, 4, 16, 0, 0])
        self.assertEqual(field(r, "deepseek4.expert_gating_func"), 4)
        self.assertEqual(field(r, "deepseek4.rope.scaling.type"), "yarn")
        self.assertEqual(field(r, "dsv4.synth.seed"), SEED)
        self.assertEqual(field(r, "tokenizer.ggml.model"), "gpt2")
        self.assertEqual(len(field(r, "tokenizer.ggml.tokens")), VOCAB)

    def test_names_shapes_types(self):
        q8, q2, f32, i32 = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q2_K,
                            gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.I32)
        want = {  # name: (ggml ne, type)
            "token_embd.weight": ([D, VOCAB], q8),
            "output_hc_fn.weight": ([4 * D, 4], f32),
            "blk.0.attn_q_b.weight": ([64, 4 * 256], q8),
            "blk.0.attn_output_a.weight": ([512, 64], q8),
            "blk.0.ffn_gate_tid2eid.weight": ([2, VOCAB], i32),
            "blk.1.attn_compressor_ape.weight": ([512, 4], f32),
            "blk.1.indexer.attn_q_b.weight": ([64, 512], q8),
            "blk.2.attn_compressor_kv.weight": ([D, 256], q8),
            "blk.2.attn_compressor_ape.weight": ([256, 16], f32),
            "blk.2.exp_probs_b.bias": ([EXPERTS], f32),
            "blk.2.ffn_gate_exps.weight": ([D, FFN, EXPERTS], q2),
            "blk.2.ffn_down_exps.weight": ([FFN, D, EXPERTS], q8),  # rows of 128: no Q2_K
            "blk.6.nextn.eh_proj.weight": ([2 * D, D], q8),
            "blk.6.nextn.hc_head_fn.weight": ([4 * D, 4], f32),
        }
        for name, (ne, ty) in want.items():
            with self.subTest(name=name):
                t = self.tensors[name]
                self.assertEqual([int(x) for x in t.shape], ne)
                self.assertEqual(t.tensor_type, ty)
        self.assertNotIn("blk.0.attn_compressor_kv.weight", self.tensors)
        self.assertNotIn("blk.2.indexer.proj.weight", self.tensors)
        self.assertNotIn("blk.2.ffn_gate_tid2eid.weight", self.tensors)

    def test_values_follow_the_recipe(self):
        emb = values(self.tensors["token_embd.weight"])
        self.assertAlmostEqual(emb.std(), 1.0, delta=0.01)
        norm = values(self.tensors["blk.3.attn_norm.weight"])
        self.assertAlmostEqual(norm.mean(), 1.0, delta=0.03)
        gate = values(self.tensors["blk.2.ffn_gate_exps.weight"])  # [E, FFN, D], Q2_K
        self.assertEqual(gate.shape, (EXPERTS, FFN, D))
        rms = np.sqrt((gate ** 2).mean(axis=(1, 2)))
        self.assertAlmostEqual(rms[7] / rms[0], 5.0, delta=0.6)
        self.assertAlmostEqual(rms[3] / rms[1], 3.5, delta=0.45)
        tid = values(self.tensors["blk.0.ffn_gate_tid2eid.weight"]).astype(np.int64)
        self.assertEqual(tid.shape, (VOCAB, 2))
        self.assertTrue(((tid >= 0) & (tid < EXPERTS)).all())
        self.assertTrue((tid[:, 0] != tid[:, 1]).all())
        for name, t in self.tensors.items():
            self.assertTrue(np.isfinite(values(t)).all(), name)

    def test_info_reads_it(self):
        out = subprocess.run([CLI, "info", self.path, "--ctx", "72"], check=True,
                             capture_output=True, text=True).stdout
        self.assertIn("catalog check: ok", out)
        self.assertIn(f"tensors: {len(self.tensors)} ", out)
        self.assertIn("schedule            WCHCHW | MTP W", out)


if __name__ == "__main__":
    unittest.main()
