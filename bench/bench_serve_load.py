"""`dsv4 serve` under load, measured from the client side: C concurrent streaming clients
(1, 16, 64 by default), each sending one /v1/completions request of P random prompt token ids
and asking for exactly N output tokens (greedy; the end-of-sentence token is banned with
logit_bias, so every stream runs to max_tokens). Reported per concurrency: time to first
token (median, p90), time per output token after the first (median over requests), and
aggregate output tokens/s (all output tokens over the wall time from the first request sent
to the last stream ended). Not a test: the numbers depend on the machine (docs/PERFORMANCE.md,
"The server under load"). Standard library only, so it runs where the openai package is not
installed (the GPU machine).

  python3 bench/bench_serve_load.py --cli build/dsv4 -m MODEL.gguf --backend cuda \
      [--clients 1,16,64] [--prompt 512] [--tokens 128] [--json out.json]
"""
import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request


def post_stream(url, body, timeout):
    """Yields the decoded JSON of every SSE data line until [DONE]."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return
            yield json.loads(data)


def one_request(base, model, prompt, tokens, seed, out, timeout):
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}, "logit_bias": {"1": -100}}
    sent = time.perf_counter()
    first = last = None
    usage = None
    error = None
    try:
        for chunk in post_stream(base + "/v1/completions", body, timeout):
            now = time.perf_counter()
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                first = first if first is not None else now
                last = now
            if chunk.get("usage"):
                usage = chunk["usage"]
    except Exception as e:  # noqa: BLE001 (reported, not raised: one failed stream must not hide the rest)
        error = repr(e)
    end = time.perf_counter()
    out.append({"sent": sent, "first": first, "last": last, "end": end, "error": error,
                "completion_tokens": usage["completion_tokens"] if usage else 0})


def wait_ready(base, proc, seconds):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"dsv4 serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if json.load(r).get("status") == "ok":
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"dsv4 serve was not ready after {seconds} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cli", default="build/dsv4")
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--clients", default="1,16,64")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--ready-seconds", type=int, default=300, help="time the server may take to load")
    ap.add_argument("--json", help="write the measurements here")
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    port_dir = tempfile.mkdtemp(prefix="dsv4-serve-")
    port_file = os.path.join(port_dir, "port")
    cmd = [args.cli, "serve", "-m", args.model, "--backend", args.backend, "--port", "0", "--port-file", port_file,
           "--ctx", str(args.ctx), "--max-seqs", str(max(clients)), "--max-queue", str(2 * max(clients)),
           "--batch-tokens", str(max(512, max(clients) + args.prompt)), "--cache-entries", "0", "--any-model",
           "--http-threads", str(max(clients) + 8)]
    log = open(os.environ.get("DSV4_SERVE_LOG", os.devnull), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    results = {"command": cmd, "prompt_tokens": args.prompt, "output_tokens": args.tokens, "runs": []}
    try:
        for _ in range(args.ready_seconds * 2):
            if os.path.exists(port_file) and open(port_file).read().strip():
                break
            if proc.poll() is not None:
                raise SystemExit(f"dsv4 serve exited with {proc.returncode}")
            time.sleep(0.5)
        base = f"http://127.0.0.1:{int(open(port_file).read())}"
        wait_ready(base, proc, args.ready_seconds)
        rng = random.Random(7)
        # Warm-up: one request (first launches, graph recording of the small buckets).
        one_request(base, "m", [rng.randrange(3, 128000) for _ in range(args.prompt)], 8, 0, [], 600)
        print(f"{'clients':>7} {'ttft p50 ms':>11} {'ttft p90 ms':>11} {'tpot p50 ms':>11} {'tok/s':>8} {'errors':>6}")
        for c in clients:
            out = []
            prompts = [[rng.randrange(3, 128000) for _ in range(args.prompt)] for _ in range(c)]
            threads = [threading.Thread(target=one_request, args=(base, "m", prompts[i], args.tokens, i, out, 900))
                       for i in range(c)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            ok = [r for r in out if r["error"] is None and r["first"] is not None]
            ttft = sorted((r["first"] - r["sent"]) * 1e3 for r in ok)
            tpot = [(r["last"] - r["first"]) * 1e3 / (r["completion_tokens"] - 1) for r in ok if r["completion_tokens"] > 1]
            wall = max(r["end"] for r in out) - min(r["sent"] for r in out)
            total = sum(r["completion_tokens"] for r in ok)
            row = {"clients": c, "ttft_ms_p50": statistics.median(ttft) if ttft else None,
                   "ttft_ms_p90": ttft[math.ceil(0.9 * len(ttft)) - 1] if ttft else None,  # nearest rank
                   "tpot_ms_p50": statistics.median(tpot) if tpot else None,
                   "tokens_per_s": total / wall, "output_tokens": total, "wall_s": wall,
                   "errors": [r["error"] for r in out if r["error"]],
                   "short": sum(1 for r in ok if r["completion_tokens"] != args.tokens)}
            results["runs"].append(row)
            fmt = lambda v: f"{v:11.1f}" if v is not None else f"{'-':>11}"  # noqa: E731
            print(f"{c:7d} {fmt(row['ttft_ms_p50'])} {fmt(row['ttft_ms_p90'])} {fmt(row['tpot_ms_p50'])} "
                  f"{row['tokens_per_s']:8.1f} {len(row['errors']):6d}", flush=True)
            print(f"TABLE|serve|serve {c} clients P={args.prompt} N={args.tokens}|{row['tokens_per_s']:.1f}|tok/s|"
                  f"|ttft p50 {fmt(row['ttft_ms_p50']).strip()} ms, tpot p50 {fmt(row['tpot_ms_p50']).strip()} ms",
                  flush=True)
            if args.json:
                json.dump(results, open(args.json, "w"), indent=1)
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            results["metrics"] = r.read().decode()
        if args.json:
            json.dump(results, open(args.json, "w"), indent=1)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        if os.path.exists(port_file):
            os.unlink(port_file)
        os.rmdir(port_dir)
    bad = [r for r in results["runs"] if r["errors"] or r["short"]]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
