"""Bad input to `dsv4 serve`, over plain HTTP: each case gets its API's own error JSON
and status (OpenAI {"error": {...}} or Anthropic {"type": "error", ...}), the process
never crashes or hangs, and still serves a good request afterwards. Covers malformed
JSON, wrong types and ranges, unknown fields, unknown models, prompts over the context,
bodies over --max-body (413), missing or wrong API keys (401), unknown endpoints and
methods, invalid schemas and tool lists, and a client that hangs up mid-request.
Run by ctest with DSV4_CLI set to the built dsv4 program.
"""
import json
import socket
import unittest

from serve_fixture import MODEL_NAME, Server

KEY = "sk-bad-input"
AUTH = {"Authorization": "Bearer " + KEY}
MSG = [{"role": "user", "content": "Hi"}]


class BadInputTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server("--api-key", KEY, "--max-body", "64K", "--nothink")

    @classmethod
    def tearDownClass(cls):
        cls.server.close(cls())

    def openai(self, path, body=None, status=400, raw=None, headers=AUTH, method="POST"):
        got, hdrs, j = self.server.request(method, path, body, headers=headers, raw=raw)
        self.assertEqual(got, status, j)
        self.assertIsInstance(j, dict, j)
        self.assertEqual(sorted(j), ["error"], j)
        self.assertEqual(sorted(j["error"]), ["code", "message", "param", "type"])
        self.assertTrue(j["error"]["message"])
        return j["error"], hdrs

    def anthropic(self, body=None, status=400, raw=None, headers=None, path="/v1/messages"):
        h = {"x-api-key": KEY, "anthropic-version": "2023-06-01"} if headers is None else headers
        got, _, j = self.server.request("POST", path, body, headers=h, raw=raw)
        self.assertEqual(got, status, j)
        self.assertEqual(j["type"], "error", j)
        self.assertTrue(j["error"]["type"] and j["error"]["message"])
        return j["error"]

    def test_openai_chat(self):
        chat = "/v1/chat/completions"
        ok = {"model": MODEL_NAME, "messages": MSG, "max_tokens": 2}
        self.openai(chat, raw=b"{not json")
        self.openai(chat, raw=b"")
        self.openai(chat, raw=b"[1, 2]")
        self.openai(chat, raw=b"\xff\xfe{}")
        self.openai(chat, raw=b"[" * 5000 + b"]" * 5000)
        self.assertEqual(self.openai(chat, {**ok, "model": "gpt-9"}, 404)[0]["code"], "model_not_found")
        self.assertEqual(self.openai(chat, {**ok, "bogus": True})[0]["param"], "bogus")
        for field, value in [("temperature", "hot"), ("temperature", 3), ("top_p", 0), ("max_tokens", -1),
                             ("max_tokens", 10**30), ("n", 2), ("stop", [""]), ("stop", 5), ("logit_bias", {"x": 1}),
                             ("logit_bias", {"5": 1000}), ("messages", "hi"), ("messages", []), ("stream", "yes"),
                             ("top_logprobs", 3), ("tools", [{"type": "function"}]), ("tool_choice", "sometimes"),
                             ("response_format", {"type": "xml"}), ("reasoning_effort", "extreme"),
                             ("seed", 1.5), ("tools", "x")]:
            with self.subTest(field=field, value=value):
                self.assertTrue(self.openai(chat, {**ok, field: value})[0]["param"].startswith(field.split(".")[0])
                                or field == "top_logprobs")
        for messages in ([{"role": "wizard", "content": "x"}], [{"content": "x"}], [{"role": "user", "content": 5}],
                         [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                         [{"role": "tool", "content": "x"}], [{"role": "assistant", "tool_calls": [{"id": 1}]}], [5]):
            with self.subTest(messages=messages):
                self.openai(chat, {**ok, "messages": messages})
        err, _ = self.openai(chat, {**ok, "messages": [{"role": "user", "content": "word " * 1500}]})
        self.assertEqual(err["code"], "context_length_exceeded")
        self.assertIn("1024", err["message"])
        self.openai(chat, {**ok, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}})
        self.openai(chat, {**ok, "response_format": {"type": "json_schema",
                                                     "json_schema": {"schema": {"$ref": "#/$defs/missing"}}}})
        self.openai(chat, {**ok, "tool_choice": {"type": "function", "function": {"name": "absent"}},
                           "tools": [{"type": "function", "function": {"name": "present"}}]})
        err, _ = self.openai(chat, {**ok, "tool_choice": "required", "max_tokens": 1,
                                    "tools": [{"type": "function", "function": {"name": "present"}}]})
        self.assertIn("at least", err["message"])

    def test_other_openai_endpoints(self):
        self.openai("/v1/completions", {"model": MODEL_NAME, "prompt": [1, -5]})
        self.openai("/v1/completions", {"model": MODEL_NAME, "prompt": {"a": 1}})
        self.openai("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "suffix": "y"})
        self.openai("/v1/responses", {"model": MODEL_NAME, "input": 5})
        self.openai("/v1/responses", {"model": MODEL_NAME, "input": "x", "previous_response_id": "resp_1"})
        self.openai("/v1/responses", {"model": MODEL_NAME, "input": [{"type": "item_reference", "id": "x"}]})
        self.openai("/v1/responses", {"model": MODEL_NAME, "input": [{"type": "function_call", "name": "f"}]})
        self.openai("/v1/nowhere", {}, 404)
        self.openai("/v1/chat/completions", None, 404, method="GET")
        self.openai("/v1/models/unknown", None, 404, method="GET")

    def test_auth_and_body_limit(self):
        err, hdrs = self.openai("/v1/chat/completions", {"model": MODEL_NAME, "messages": MSG}, 401, headers={})
        self.assertEqual(err["code"], "invalid_api_key")
        self.openai("/v1/models", None, 401, headers={"Authorization": "Bearer nope"}, method="GET")
        self.openai("/metrics", None, 401, headers={}, method="GET")
        self.assertEqual(self.anthropic({"model": MODEL_NAME}, 401, headers={"x-api-key": "nope"})["type"],
                         "authentication_error")
        self.assertEqual(self.server.request("GET", "/health")[0], 200)  # open to probes
        big = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x" * 70000}], "max_tokens": 1}
        err, _ = self.openai("/v1/chat/completions", big, 413)
        self.assertIn("65536", err["message"])
        self.assertEqual(self.anthropic({**big, "max_tokens": 1}, 413)["type"], "request_too_large")

    def test_anthropic(self):
        ok = {"model": MODEL_NAME, "messages": MSG, "max_tokens": 2}
        self.anthropic(raw=b"{")
        self.assertEqual(self.anthropic({"model": MODEL_NAME, "messages": MSG})["message"], "max_tokens: required")
        self.assertEqual(self.anthropic({**ok, "model": "claude-x"}, 404)["type"], "not_found_error")
        for field, value in [("temperature", 1.5), ("system", 5), ("stop_sequences", "x"), ("thinking", {"type": "on"}),
                             ("tool_choice", {"type": "sometimes"}), ("tools", [{"description": "no name"}]),
                             ("unknown", 1), ("messages", [{"role": "system", "content": "x"}]),
                             ("messages", [{"role": "user", "content": [{"type": "document"}]}])]:
            with self.subTest(field=field):
                self.anthropic({**ok, field: value})
        self.anthropic({"model": MODEL_NAME, "messages": 5}, path="/v1/messages/count_tokens")

    def test_hang_up_mid_request(self):
        body = json.dumps({"model": MODEL_NAME, "messages": MSG, "max_tokens": 500, "stream": True}).encode()
        for cut in (False, True):
            s = socket.create_connection(("127.0.0.1", self.server.port))
            head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
            s.sendall(head + (body[:10] if cut else body))
            if not cut:
                s.recv(100)  # the stream has started
            s.close()
        # The server is fine and the abandoned request is freed.
        got, _, j = self.server.request("POST", "/v1/chat/completions", {"model": MODEL_NAME, "messages": MSG,
                                                                         "max_tokens": 2}, headers=AUTH)
        self.assertEqual(got, 200, j)
        self.assertEqual(j["choices"][0]["finish_reason"], "length")


if __name__ == "__main__":
    unittest.main()
