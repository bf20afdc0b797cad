"""`dsv4 serve --spec K` and `--backend` (docs/SERVER.md): with MTP speculative decoding
the server gives the same greedy completions as without it, for concurrent requests,
streaming and not, with the same usage counts (and the same log-probabilities for a
request that asks for them, which decodes without drafts); /metrics counts drafted and
accepted tokens. Refused at start with a usage error (exit 2): --backend cuda where this
build or this machine has no CUDA device, --spec outside 0..4, --spec with --kv-graft;
and (exit 1, before anything is allocated) a model and caches over --device-memory, which
`dsv4 info --backend cuda` plans the same way.
Run by ctest with DSV4_CLI set to the built dsv4 program.
"""
import json
import os
import subprocess
import threading
import unittest
import urllib.request

from serve_fixture import BINARY_DIR, CLI, MODEL_NAME, Server

PROMPTS = ["Count to ten", "Name three rivers", "Why is the sky blue?", "Write a haiku"]


def serve_refusal(*args):
    """(exit status, stderr) of a serve command that must stop before serving."""
    env = dict(os.environ, DSV4_CACHE_DIR=os.path.join(BINARY_DIR, "test-cache-text"))
    p = subprocess.run([CLI, "serve", "--port", "0", *args], env=env, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stderr


def chat(server, prompt, max_tokens, stream=False, logprobs=False):
    """(content, finish_reason, usage, logprobs) of one greedy chat completion."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if logprobs:
        body.update(logprobs=True, top_logprobs=2)
    req = urllib.request.Request(server.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=300) as r:
        if not stream:
            j = json.loads(r.read())
            c = j["choices"][0]
            return c["message"].get("content") or "", c["finish_reason"], j["usage"], c.get("logprobs")
        content, finish, usage = "", None, None
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            j = json.loads(line[6:])
            if j.get("usage"):
                usage = j["usage"]
            for c in j.get("choices", []):
                content += c["delta"].get("content") or ""
                finish = c.get("finish_reason") or finish
        return content, finish, usage, None


def run_concurrently(server, calls):
    results = [None] * len(calls)

    def one(i, args):
        results[i] = chat(server, *args)

    threads = [threading.Thread(target=one, args=(i, a)) for i, a in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


class SpecServerTest(unittest.TestCase):
    def test_refusals(self):
        if not os.path.exists("/dev/nvidiactl"):  # on a GPU machine --backend cuda starts
            rc, err = serve_refusal("--backend", "cuda")
            self.assertEqual(rc, 2, err)
            self.assertIn("--backend cuda", err)
        rc, err = serve_refusal("--spec", "5")
        self.assertEqual(rc, 2, err)
        graft = os.path.join(BINARY_DIR, "no-such.graft")
        with open(graft, "wb") as f:
            f.write(b"x")
        try:
            rc, err = serve_refusal("--backend", "cpu", "--spec", "2", "--kv-graft", graft)
        finally:
            os.remove(graft)
        self.assertEqual(rc, 2, err)
        self.assertIn("--spec", err)

    def test_device_memory_refused_before_allocation(self):
        # --device-memory on the CPU: checked as a device would allocate (docs/SERVER.md).
        rc, err = serve_refusal("--backend", "cpu", "--ctx", "1024", "--max-seqs", "2", "--device-memory", "1M")
        self.assertEqual(rc, 1, err)
        self.assertIn("does not fit in device memory, nothing was allocated", err)
        self.assertIn("(18 slots of 1024 tokens", err)  # --max-seqs 2 + --cache-entries 16
        self.assertIn("of 1.0 MiB (1048576 bytes) available", err)
        env = dict(os.environ, DSV4_CACHE_DIR=os.path.join(BINARY_DIR, "test-cache-text"))
        p = subprocess.run([CLI, "info", "--backend", "cuda", "--ctx", "1024", "--sequences", "3", "--device-memory",
                            "1M"], env=env, capture_output=True, text=True, timeout=300)
        self.assertEqual(p.returncode, 1, p.stderr)
        self.assertIn("device memory (--backend cuda, 3 slots of 1,024 tokens)", p.stdout)
        self.assertIn("fits: no", p.stdout)
        self.assertIn("does not fit in device memory", p.stderr)

    def test_same_greedy_completions_as_without(self):
        calls = [(p, 10 + 2 * i, i % 2 == 1) for i, p in enumerate(PROMPTS)] + [(PROMPTS[0], 1, False)]
        plain = Server("--nothink")
        try:
            want = run_concurrently(plain, calls)
            want_lp = chat(plain, PROMPTS[2], 6, logprobs=True)
        finally:
            plain.close(self)
        spec = Server("--nothink", "--spec", "2")
        try:
            got = run_concurrently(spec, calls)
            got_lp = chat(spec, PROMPTS[2], 6, logprobs=True)
            m = spec.metrics()
        finally:
            spec.close(self)
        for (prompt, max_tokens, _), w, g in zip(calls, want, got):
            with self.subTest(prompt=prompt, max_tokens=max_tokens):
                self.assertEqual(g[0], w[0])
                self.assertEqual(g[1], w[1])
                self.assertEqual(g[2]["completion_tokens"], w[2]["completion_tokens"])
                self.assertEqual(g[2]["prompt_tokens"], w[2]["prompt_tokens"])
                self.assertLessEqual(g[2]["completion_tokens"], max_tokens)
                if g[1] == "length":
                    self.assertEqual(g[2]["completion_tokens"], max_tokens)
        self.assertEqual(got_lp[0], want_lp[0])
        self.assertEqual(got_lp[3], want_lp[3])
        self.assertGreater(m["dsv4_spec_verify_steps_total"], 0)
        self.assertGreater(m["dsv4_spec_drafted_tokens_total"], 0)
        self.assertLessEqual(m["dsv4_spec_accepted_tokens_total"], m["dsv4_spec_drafted_tokens_total"])


if __name__ == "__main__":
    unittest.main()
