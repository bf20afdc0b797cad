"""`dsv4 serve` through the official `anthropic` Python client (pinned in
scripts/requirements.txt): messages streaming and not with the events in Anthropic's
order, thinking blocks, a forced tool_use whose tool_result round trip is read from the
cache (cache_read_input_tokens counted exactly), stop sequences, token counting and
errors in Anthropic's shape. Random weights (the built-in tiny model): structure only.
Run by ctest with DSV4_CLI set to the built dsv4 program.
"""
import unittest

import anthropic

from serve_fixture import MODEL_NAME, Server

TOOLS = [{
    "name": "read_file",
    "description": "Read a file of the project",
    "input_schema": {"type": "object",
                     "properties": {"path": {"type": "string", "enum": ["README.md", "main.c"]},
                                    "lines": {"type": "integer"}},
                     "required": ["path"]},
}]


class AnthropicClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server("--api-key", "sk-test-key")
        cls.client = anthropic.Anthropic(base_url=cls.server.url, api_key="sk-test-key", max_retries=0)

    @classmethod
    def tearDownClass(cls):
        cls.server.close(cls())

    def create(self, **kw):
        kw.setdefault("model", MODEL_NAME)
        kw.setdefault("messages", [{"role": "user", "content": "Hello"}])
        return self.client.messages.create(**kw)

    def test_message(self):
        m = self.create(max_tokens=5, extra_body={"temperature": 0}, system="Be brief.")
        self.assertEqual(m.type, "message")
        self.assertEqual(m.role, "assistant")
        self.assertEqual(m.stop_reason, "max_tokens")
        self.assertEqual([b.type for b in m.content], ["text"])
        self.assertEqual(m.usage.output_tokens, 5)
        self.assertTrue(m.id.startswith("msg_"))

    def test_stream_event_order(self):
        events = []
        with self.client.messages.stream(model=MODEL_NAME, max_tokens=5, extra_body={"temperature": 0}, system="Be brief.",
                                         messages=[{"role": "user", "content": "Hello"}]) as stream:
            for e in stream:
                events.append(e.type)
            final = stream.get_final_message()
        raw = [e for e in events if e in ("message_start", "content_block_start", "content_block_delta",
                                          "content_block_stop", "message_delta", "message_stop")]
        self.assertEqual(raw[:2], ["message_start", "content_block_start"])
        self.assertEqual(raw[-3:], ["content_block_stop", "message_delta", "message_stop"])
        self.assertTrue(all(e == "content_block_delta" for e in raw[2:-3]))
        self.assertEqual(final.content[0].text, self.create(max_tokens=5, extra_body={"temperature": 0}, system="Be brief.").content[0].text)
        self.assertEqual(final.stop_reason, "max_tokens")

    def test_thinking(self):
        with self.client.messages.stream(model=MODEL_NAME, max_tokens=4, thinking={"type": "enabled", "budget_tokens": 1024},
                                         messages=[{"role": "user", "content": "Think"}]) as stream:
            kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
            final = stream.get_final_message()
        self.assertEqual(final.content[0].type, "thinking")
        self.assertTrue(final.content[0].thinking)
        self.assertIn("thinking_delta", kinds)
        self.assertEqual(kinds[-1], "signature_delta")

    def test_tool_use_round_trip(self):
        messages = [{"role": "user", "content": "Show me the README"}]
        first = self.create(messages=messages, tools=TOOLS, tool_choice={"type": "tool", "name": "read_file"},
                            max_tokens=80, thinking={"type": "enabled", "budget_tokens": 1024})
        self.assertEqual(first.stop_reason, "tool_use")
        self.assertEqual([b.type for b in first.content], ["thinking", "tool_use"])
        use = first.content[1]
        self.assertEqual(use.name, "read_file")
        self.assertIn(use.input["path"], ["README.md", "main.c"])
        self.assertTrue(use.id.startswith("toolu_"))
        # Claude Code's next turn: the assistant blocks as received, then the result.
        follow = self.create(
            tools=TOOLS, max_tokens=3, thinking={"type": "enabled", "budget_tokens": 1024},
            messages=messages + [
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "# dsv4"}]},
            ])
        self.assertEqual(follow.usage.cache_read_input_tokens,
                         first.usage.input_tokens + first.usage.output_tokens - 1)
        self.assertGreater(follow.usage.input_tokens, 0)
        # Streaming: the call as one tool_use block with its input as JSON.
        with self.client.messages.stream(model=MODEL_NAME, messages=messages, tools=TOOLS, tool_choice={"type": "any"},
                                         max_tokens=80) as stream:
            kinds = [e.type for e in stream]
            final = stream.get_final_message()
        self.assertEqual(final.stop_reason, "tool_use")
        self.assertEqual(final.content[-1].type, "tool_use")
        self.assertIn("input_json", kinds)

    def test_stop_sequence(self):
        text = self.create(max_tokens=6, extra_body={"temperature": 0}).content[0].text
        stop = text[len(text) // 2:len(text) // 2 + 2]
        self.assertTrue(stop)
        m = self.create(max_tokens=6, extra_body={"temperature": 0}, stop_sequences=[stop])
        self.assertEqual(m.stop_reason, "stop_sequence")
        self.assertEqual(m.stop_sequence, stop)
        self.assertEqual("".join(b.text for b in m.content), text[:text.find(stop)])

    def test_count_tokens(self):
        n = self.client.messages.count_tokens(model=MODEL_NAME, messages=[{"role": "user", "content": "Hello"}])
        self.assertEqual(n.input_tokens, self.create(max_tokens=1).usage.input_tokens)

    def test_errors(self):
        with self.assertRaises(anthropic.BadRequestError) as e:
            self.create(max_tokens=0)
        self.assertEqual(e.exception.body["type"], "error")
        self.assertEqual(e.exception.body["error"]["type"], "invalid_request_error")
        with self.assertRaises(anthropic.NotFoundError):
            self.create(model="claude-nonexistent", max_tokens=1)
        with self.assertRaises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=self.server.url, api_key="wrong", max_retries=0).messages.create(
                model=MODEL_NAME, max_tokens=1, messages=[{"role": "user", "content": "x"}])
        self.assertEqual(e.exception.body["error"]["type"], "authentication_error")
        with self.assertRaises(anthropic.BadRequestError):
            self.create(max_tokens=2, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])


if __name__ == "__main__":
    unittest.main()
