"""Steering and KV grafts in `dsv4 serve` (docs/STEERING.md, docs/SERVER.md): with --glp a
request's "dsv4": {"glp_alpha": A} sets its strength (0: exactly the unsteered log-
probabilities, even right after a steered request on the same prompt, so the prefix cache
keeps strengths apart; another strength changes them); bad strengths and a strength asked
of a server without --glp get 400 naming the field. With --kv-graft every sequence starts
at the graft's footprint, prefix reuse still works, and nothing is persisted.
Run by ctest with DSV4_CLI set to the built dsv4 program.
"""
import glob
import os
import subprocess
import tempfile
import unittest

import openai

from serve_fixture import BINARY_DIR, CLI, MODEL_NAME, Server

PROMPT = "The quick brown fox jumps over"


def builtin_model():
    env = dict(os.environ, DSV4_CACHE_DIR=os.path.join(BINARY_DIR, "test-cache-text"))
    subprocess.run([CLI, "info"], env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    found = glob.glob(os.path.join(BINARY_DIR, "test-cache-text", "**", MODEL_NAME + ".gguf"), recursive=True)
    assert found, "the built-in model was not written"
    return found[0]


class SteeringServerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.model = builtin_model()
        pos, neg = os.path.join(cls.tmp.name, "pos.txt"), os.path.join(cls.tmp.name, "neg.txt")
        with open(pos, "w") as f:
            f.write("Sunny, warm and bright\nWe are delighted\n")
        with open(neg, "w") as f:
            f.write("Cold, dark and wet\nWe are miserable\n")
        cls.glp = os.path.join(cls.tmp.name, "dir.gguf")
        subprocess.run([CLI, "glp", "make", "-t", "2", "-m", cls.model, "--positive", pos, "--negative", neg,
                        "--hook", "residual_stream_post_layer", "--alpha", "4", "-o", cls.glp], check=True,
                       stdout=subprocess.DEVNULL)
        tokens = os.path.join(cls.tmp.name, "p.tok")
        with open(tokens, "w") as f:
            f.write(" ".join(str(100 + 7 * i) for i in range(70)))
        cls.bank = os.path.join(cls.tmp.name, "bank.gguf")
        subprocess.run([CLI, "graft", "make", "-t", "2", "-m", cls.model, "--tokens", tokens, "--truncate", "-o",
                        cls.bank], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def logprobs(self, server, alpha=None, prompt=PROMPT):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        extra = {"dsv4": {"glp_alpha": alpha}} if alpha is not None else None
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=3,
                                      extra_body=extra)
        return r.choices[0].logprobs.token_logprobs, r.usage

    def test_per_request_strength(self):
        plain = Server("-m", self.model)
        try:
            unsteered, _ = self.logprobs(plain)
            status, _, body = plain.request("POST", "/v1/completions", {
                "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "dsv4": {"glp_alpha": 0.5}})
            self.assertEqual(status, 400, body)
            self.assertIn("dsv4.glp_alpha", str(body))
            self.assertIn("no steering file is bound", str(body))
        finally:
            plain.close(self)

        steered = Server("-m", self.model, "--glp", self.glp)
        try:
            default, _ = self.logprobs(steered)
            zero, _ = self.logprobs(steered, 0)
            strong, _ = self.logprobs(steered, -6)
            self.assertEqual(zero, unsteered)
            self.assertNotEqual(default, unsteered)
            self.assertNotEqual(strong, unsteered)
            self.assertNotEqual(strong, default)
            for bad in (1000, -65, "strong", None, [1]):
                for path, body in (("/v1/completions", {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2}),
                                   ("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 2,
                                                             "messages": [{"role": "user", "content": "Hi"}]}),
                                   ("/v1/messages", {"model": MODEL_NAME, "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": "Hi"}]}),
                                   ("/v1/responses", {"model": MODEL_NAME, "max_output_tokens": 16, "input": "Hi"})):
                    if bad is None:
                        body = dict(body, dsv4={"glp_alpha": 1, "other": 2})
                    else:
                        body = dict(body, dsv4={"glp_alpha": bad})
                    status, _, reply = steered.request("POST", path, body)
                    self.assertEqual(status, 400, (path, bad, reply))
                    self.assertIn("dsv4.", str(reply))
            # Every endpoint takes the field.
            status, _, reply = steered.request("POST", "/v1/messages", {
                "model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
                "dsv4": {"glp_alpha": 64}})
            self.assertEqual(status, 200, reply)
        finally:
            steered.close(self)

    def test_graft(self):
        with tempfile.TemporaryDirectory() as folder:
            server = Server("-m", self.model, "--kv-graft", self.bank, "--kv-persist", folder)
            try:
                first, usage1 = self.logprobs(server, prompt=PROMPT * 6)
                second, usage2 = self.logprobs(server, prompt=PROMPT * 6)
                self.assertEqual(first, second)
                self.assertEqual(usage1.prompt_tokens, usage2.prompt_tokens)
                self.assertGreater(server.metrics()["dsv4_cached_prompt_tokens_total"], 0)
            finally:
                server.close(self)
            self.assertEqual([f for f in os.listdir(folder) if f.endswith(".dsv4kv")], [])
        plain = Server("-m", self.model)
        try:
            ungrafted, _ = self.logprobs(plain, prompt=PROMPT * 6)
        finally:
            plain.close(self)
        self.assertNotEqual(first, ungrafted)


if __name__ == "__main__":
    unittest.main()
