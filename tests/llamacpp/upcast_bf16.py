#!/usr/bin/env python3
"""Copies a GGUF file with every BF16 tensor widened to F32 (exact), all else unchanged:
llama-quantize leaves the routers (ffn_gate_inp) in their BF16 even for the F32 target, and
llama.cpp then rounds the router's activations to BF16, which flips near-tied experts.
  upcast_bf16.py IN.gguf OUT.gguf   (needs llama.cpp's gguf-py on PYTHONPATH)
"""
import sys

import gguf
import numpy as np


def main(src, dst):
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"]
    w = gguf.GGUFWriter(dst, bytes(arch.parts[arch.data[0]]).decode())
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        t = field.types[0]
        if t == gguf.GGUFValueType.ARRAY:
            sub = field.types[1]
            if sub == gguf.GGUFValueType.STRING:
                vals = [bytes(field.parts[i]).decode() for i in field.data]
            else:
                vals = [field.parts[i].tolist()[0] for i in field.data]
            w.add_key_value(name, vals, t, sub_type=sub)
        elif t == gguf.GGUFValueType.STRING:
            w.add_key_value(name, bytes(field.parts[field.data[0]]).decode(), t)
        else:
            w.add_key_value(name, field.parts[field.data[0]].tolist()[0], t)
    for t in r.tensors:
        shape = list(reversed([int(x) for x in t.shape]))  # numpy order
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:
            bits = np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16
            w.add_tensor(t.name, bits.view(np.float32).reshape(shape))
        elif t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.I32):
            w.add_tensor(t.name, np.asarray(t.data).reshape(shape))
        else:
            raise SystemExit(f"{src}: tensor {t.name} is {t.tensor_type.name}; expected F32, BF16 or I32 only "
                             "(run llama-quantize ... F32 first)")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
