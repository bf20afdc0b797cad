#!/usr/bin/env python3
"""dsv4 against llama.cpp on the same GGUF file, as ratios (scripts/gpu.sh's peer step).

    bench_peer.py LLAMA_BENCH.json DSV4_BENCH.json [LABEL]

LLAMA_BENCH.json is `llama-bench -o json` (one object per test: n_prompt, n_gen, n_depth,
avg_ts in tokens/s); DSV4_BENCH.json is `dsv4 bench --json`. Pairs: llama.cpp's tg<n> at
depth d with dsv4's batch-1 decode at depth d, llama.cpp's pp<P> at depth 0 with dsv4's
prefill of P tokens. Prints scripts/gpu.sh's `TABLE|bench|case|value|unit|ratio|note`
lines: llama.cpp's own figures (ratio 1), each followed by dsv4's with ratio dsv4 / llama.cpp
where dsv4 bench measured the pair. Exits 1 when no pair was found.
"""
import json
import sys


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        llama = json.load(f)
    with open(sys.argv[2]) as f:
        dsv4 = json.load(f)
    label = sys.argv[3] if len(sys.argv) > 3 else dsv4.get("label", "")
    prefix = f"{label} " if label else ""
    decode = {r["depth"]: r for r in dsv4["results"] if r["kind"] == "decode"}
    prefill = {r["prompt"]: r for r in dsv4["results"] if r["kind"] == "prefill"}
    pairs = 0
    for t in llama:
        n_prompt, n_gen, depth, ts = t["n_prompt"], t["n_gen"], t.get("n_depth", 0), t["avg_ts"]
        if n_gen > 0 and n_prompt == 0:
            name, ours = f"tg{n_gen} d={depth}", decode.get(depth)
            what = f"dsv4 decode B=1 D={depth}"
        elif n_prompt > 0 and n_gen == 0:
            name, ours = f"pp{n_prompt} d={depth}", prefill.get(n_prompt) if depth == 0 else None
            what = f"dsv4 prefill P={n_prompt}"
        else:
            continue
        print(f"TABLE|llama.cpp|{prefix}{name}|{ts:.2f}|tok/s|1.000|llama-bench, +-{t.get('stddev_ts', 0):.1f}")
        if ours is None:  # llama-bench's pp at a depth, or a depth dsv4 bench was not asked for
            continue
        mine = ours["tokens_per_second"]
        print(f"TABLE|peer|{prefix}{name}: dsv4 / llama.cpp|{mine:.2f}|tok/s|{mine / ts:.3f}|"
              f"{what} {mine:.1f} vs llama.cpp {ts:.1f} tok/s")
        pairs += 1
    return 0 if pairs else 1


if __name__ == "__main__":
    sys.exit(main())
