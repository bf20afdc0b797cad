"""`dsv4 serve` under load: 32 concurrent streaming clients send 96 requests (a shared
system prompt, so prefix reuse and forks happen; a few with a higher priority), a seeded
quarter of them hang up mid-stream. Every stream that was not cancelled must end
well-formed (one finish_reason, then [DONE] — the client checks), the KV memory must
stay within --kv-budget throughout, every sequence must be freed at the end, and the
server must exit cleanly (under the ASan build: no leak, no memory error).
Run by ctest with DSV4_CLI set to the built dsv4 program.
"""
import random
import threading
import time
import unittest
from concurrent.futures import ThreadPoolExecutor

import openai

from serve_fixture import MODEL_NAME, Server

CLIENTS, REQUESTS, BUDGET = 32, 96, 6 * 1024 * 1024
SEED = 20261201


class LoadTest(unittest.TestCase):
    def test_concurrent_streams_with_cancellations(self):
        server = Server("--nothink", "--max-seqs", "8", "--max-queue", "64", "--kv-budget", str(BUDGET),
                        "--batch-tokens", "64")
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
            rng = random.Random(SEED)
            plan = [(i, rng.randint(2, 10), rng.random() < 0.25, rng.randint(1, 3), rng.random() < 0.1)
                    for i in range(REQUESTS)]
            over_budget = []
            stop_polling = threading.Event()

            def poll():
                while not stop_polling.is_set():
                    m = server.metrics()
                    if m["dsv4_cache_bytes_used"] > BUDGET:
                        over_budget.append(m["dsv4_cache_bytes_used"])
                    time.sleep(0.2)

            def one(job):
                i, max_tokens, cancel, cancel_after, urgent = job
                stream = client.chat.completions.create(
                    model=MODEL_NAME, max_tokens=max_tokens, seed=i, stream=True,
                    extra_body={"priority": 5} if urgent else None,
                    messages=[{"role": "system", "content": "You are a helpful assistant for a load test. " * 4},
                              {"role": "user", "content": f"Request number {i}: tell me something."}])
                finishes, chunks = [], 0
                for chunk in stream:
                    chunks += 1
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finishes.append(chunk.choices[0].finish_reason)
                    if cancel and chunks >= cancel_after:
                        stream.close()
                        return "cancelled"
                self.assertIn(finishes, (["length"], ["stop"]), f"request {i}")
                return "done"

            poller = threading.Thread(target=poll)
            poller.start()
            with ThreadPoolExecutor(CLIENTS) as pool:
                outcomes = list(pool.map(one, plan))
            stop_polling.set()
            poller.join()
            self.assertEqual(outcomes.count("done"), sum(1 for p in plan if not p[2]))
            self.assertEqual(over_budget, [])
            # Cancelled sequences are freed within a step: soon nothing runs or waits.
            deadline = time.time() + 30
            while time.time() < deadline:
                m = server.metrics()
                if m["dsv4_running_sequences"] == 0 and m["dsv4_queue_depth"] == 0:
                    break
                time.sleep(0.1)
            self.assertEqual(m["dsv4_running_sequences"], 0)
            self.assertEqual(m["dsv4_queue_depth"], 0)
            self.assertEqual(m['dsv4_requests_total{outcome="finished"}'], REQUESTS)
            self.assertGreater(m["dsv4_prefix_cache_hits_total"], 0)
            self.assertLessEqual(m["dsv4_cache_bytes_used"], BUDGET)
            status, _, health = server.request("GET", "/health")
            self.assertEqual(status, 200)
        finally:
            server.close(self)


if __name__ == "__main__":
    unittest.main()
