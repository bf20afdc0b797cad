"""`dsv4 serve` through the official `openai` Python client (pinned in
scripts/requirements.txt): chat completions streaming and not, reasoning, logprobs,
JSON-schema output, a tool-call round trip whose second turn reuses the cache (exact
replay: the cached prompt tokens are counted exactly), the legacy completions endpoint,
the Responses API (output items, streaming event order, function calls) and errors.
The built-in tiny model has random weights: the tests check structure, never content;
tool calls and JSON come from grammar-constrained decoding.
Run by ctest with DSV4_CLI set to the built dsv4 program.
"""
import json
import unittest

import openai

from serve_fixture import MODEL_NAME, Server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                           "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


class OpenAIClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server("--nothink")
        cls.client = openai.OpenAI(base_url=cls.server.url + "/v1", api_key="unused", max_retries=0)

    @classmethod
    def tearDownClass(cls):
        cls.server.close(cls())

    def chat(self, **kw):
        kw.setdefault("model", MODEL_NAME)
        kw.setdefault("messages", [{"role": "user", "content": "Hello"}])
        return self.client.chat.completions.create(**kw)

    def test_models(self):
        ids = [m.id for m in self.client.models.list()]
        self.assertEqual(ids, [MODEL_NAME])

    def test_chat_not_streaming(self):
        r = self.chat(max_tokens=5, temperature=0)
        self.assertEqual(r.object, "chat.completion")
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(r.choices[0].message.role, "assistant")
        self.assertIsInstance(r.choices[0].message.content, str)
        self.assertEqual(r.usage.completion_tokens, 5)
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + 5)
        # Greedy is deterministic: the same request gives the same text.
        self.assertEqual(self.chat(max_tokens=5, temperature=0).choices[0].message.content, r.choices[0].message.content)

    def test_chat_streaming_order(self):
        chunks = list(self.chat(max_tokens=6, stream=True, seed=3, stream_options={"include_usage": True}))
        self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
        finishes = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        self.assertEqual(len(finishes), 1)
        self.assertEqual(finishes[0].choices[0].finish_reason, "length")
        self.assertIs(chunks[-1].choices, chunks[-1].choices)  # the usage chunk comes last, without choices
        self.assertEqual(chunks[-1].choices, [])
        self.assertEqual(chunks[-1].usage.completion_tokens, 6)
        self.assertLess(chunks.index(finishes[0]), len(chunks) - 1)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        same = self.chat(max_tokens=6, seed=3)
        self.assertEqual(text, same.choices[0].message.content)

    def test_reasoning(self):
        r = self.chat(max_tokens=4, reasoning_effort="high", seed=1)
        self.assertTrue(r.choices[0].message.reasoning_content)
        self.assertEqual(r.usage.completion_tokens_details.reasoning_tokens, 4)
        deltas = [c.choices[0].delta for c in self.chat(max_tokens=4, reasoning_effort="high", seed=1, stream=True)
                  if c.choices]
        streamed = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        self.assertEqual(streamed, r.choices[0].message.reasoning_content)

    def test_logprobs(self):
        r = self.chat(max_tokens=3, logprobs=True, top_logprobs=2, temperature=0)
        content = r.choices[0].logprobs.content
        self.assertEqual(len(content), 3)
        for t in content:
            self.assertLessEqual(t.logprob, 0)
            self.assertEqual(len(t.top_logprobs), 2)
            self.assertEqual(t.top_logprobs[0].logprob, t.logprob)  # greedy picks the most likely

    def test_json_schema(self):
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                    "n": {"type": "integer"}, "ok": {"type": "boolean"}},
                  "required": ["name", "n", "ok"], "additionalProperties": False}
        for seed in (1, 2):
            r = self.chat(max_tokens=60, seed=seed,
                          response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}})
            value = json.loads(r.choices[0].message.content)
            self.assertEqual(sorted(value), ["n", "name", "ok"])
            self.assertIsInstance(value["n"], int)
            self.assertLessEqual(len(value["name"]), 8)

    def test_tool_call_round_trip_reuses_the_cache(self):
        messages = [{"role": "system", "content": "You check the weather."},
                    {"role": "user", "content": "What is the weather in Paris?"}]
        first = self.chat(messages=messages, tools=[WEATHER], max_tokens=80, seed=5,
                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
        msg = first.choices[0].message
        self.assertEqual(first.choices[0].finish_reason, "tool_calls")
        self.assertEqual(len(msg.tool_calls), 1)
        call = msg.tool_calls[0]
        self.assertEqual(call.function.name, "get_weather")
        self.assertIn(json.loads(call.function.arguments)["city"], ["Paris", "Oslo"])
        self.assertTrue(call.id.startswith("call_"))
        # The agent sends the call and its result back: the history renders as the model
        # wrote it, so everything up to the model's EOS comes from the cache.
        history = messages + [
            {"role": "assistant", "content": msg.content, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
        ]
        second = self.chat(messages=history, tools=[WEATHER], max_tokens=3, seed=6)
        cached = second.usage.prompt_tokens_details.cached_tokens
        self.assertEqual(cached, first.usage.prompt_tokens + first.usage.completion_tokens - 1)
        self.assertGreater(second.usage.prompt_tokens, cached)
        # Streaming: the call arrives as one tool_calls delta with id and name.
        chunks = list(self.chat(messages=messages, tools=[WEATHER], max_tokens=80, seed=7, stream=True,
                                tool_choice="required"))
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        self.assertGreaterEqual(len(calls), 1)
        self.assertEqual(calls[0].index, 0)
        self.assertEqual(calls[0].function.name, "get_weather")
        json.loads(calls[0].function.arguments)
        self.assertEqual([c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason],
                         ["tool_calls"])

    def test_completions(self):
        r = self.client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=4, temperature=0,
                                           logprobs=1)
        self.assertEqual(r.object, "text_completion")
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(len(r.choices[0].logprobs.tokens), 4)
        streamed = "".join(c.choices[0].text for c in self.client.completions.create(
            model=MODEL_NAME, prompt="Once upon a time", max_tokens=4, temperature=0, stream=True))
        self.assertEqual(streamed, r.choices[0].text)

    def test_responses(self):
        r = self.client.responses.create(model=MODEL_NAME, input="Hello", max_output_tokens=5, temperature=0,
                                         instructions="Be brief.")
        self.assertEqual(r.object, "response")
        self.assertEqual(r.status, "incomplete")
        self.assertEqual(r.incomplete_details.reason, "max_output_tokens")
        self.assertEqual([o.type for o in r.output], ["message"])
        self.assertEqual(r.usage.output_tokens, 5)
        self.assertEqual(r.output_text, r.output[0].content[0].text)
        events = [e.type for e in self.client.responses.create(model=MODEL_NAME, input="Hello", max_output_tokens=5,
                                                                temperature=0, instructions="Be brief.", stream=True)]
        self.assertEqual(events[:4], ["response.created", "response.in_progress", "response.output_item.added",
                                      "response.content_part.added"])
        self.assertEqual(events[-4:], ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", "response.incomplete"])
        self.assertTrue(all(e == "response.output_text.delta" for e in events[4:-4]))

    def test_responses_reasoning_and_function_call(self):
        tool = {"type": "function", "name": "get_weather", "description": "weather",
                "parameters": WEATHER["function"]["parameters"], "strict": True}
        with self.client.responses.stream(model=MODEL_NAME, input="Weather in Oslo?", tools=[tool],
                                          tool_choice="required", reasoning={"effort": "high"},
                                          max_output_tokens=120, extra_body={"seed": 9}) as stream:
            types = [e.type for e in stream]
            final = stream.get_final_response()
        self.assertEqual(final.status, "completed")
        self.assertEqual([o.type for o in final.output], ["reasoning", "function_call"])
        fc = final.output[1]
        self.assertEqual(fc.name, "get_weather")
        json.loads(fc.arguments)
        self.assertIn("response.reasoning_text.delta", types)
        self.assertLess(types.index("response.reasoning_text.delta"), types.index("response.function_call_arguments.delta"))
        self.assertEqual(types[-1], "response.completed")
        # The call's output goes back as input items; the turn is reused from the cache.
        follow = self.client.responses.create(
            model=MODEL_NAME, tools=[tool], reasoning={"effort": "high"}, max_output_tokens=2,
            extra_body={"seed": 10},
            input=[{"role": "user", "content": "Weather in Oslo?"},
                   {"type": "reasoning", "id": final.output[0].id, "summary": [],
                    "content": [{"type": "reasoning_text", "text": final.output[0].content[0].text}]},
                   {"type": "function_call", "call_id": fc.call_id, "name": fc.name, "arguments": fc.arguments},
                   {"type": "function_call_output", "call_id": fc.call_id, "output": "21 C"}])
        self.assertEqual(follow.usage.input_tokens_details.cached_tokens,
                         final.usage.input_tokens + final.usage.output_tokens - 1)

    def test_errors(self):
        with self.assertRaises(openai.NotFoundError) as e:
            self.chat(model="no-such-model", max_tokens=1)
        self.assertEqual(e.exception.body["code"], "model_not_found")
        with self.assertRaises(openai.BadRequestError) as e:
            self.chat(max_tokens=1, temperature=5)
        self.assertEqual(e.exception.body["param"], "temperature")
        with self.assertRaises(openai.BadRequestError) as e:
            self.chat(messages=[{"role": "user", "content": "x " * 3000}], max_tokens=1)
        self.assertEqual(e.exception.body["code"], "context_length_exceeded")
        self.assertIn("1024", e.exception.body["message"])
        with self.assertRaises(openai.BadRequestError):
            self.chat(max_tokens=1, extra_body={"no_such_field": 1})


if __name__ == "__main__":
    unittest.main()
