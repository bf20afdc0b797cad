"""Prefix caches on disk (--kv-persist): a tool-calling turn served by one `dsv4 serve`
process is continued by the next one, started on the same folder, from the saved cache
(cached prompt tokens counted exactly); a process whose model options differ (--fast:
another identity) ignores the files; --kv-persist-budget bounds the folder.
Run by ctest with DSV4_CLI set to the built dsv4 program.
"""
import json
import os
import tempfile
import unittest

import openai

from serve_fixture import MODEL_NAME, Server
from test_server_openai import WEATHER


class PersistTest(unittest.TestCase):
    def test_cache_survives_a_restart(self):
        with tempfile.TemporaryDirectory() as folder:
            flags = ("--nothink", "--kv-persist", folder, "--kv-persist-budget", "64M")
            messages = [{"role": "system", "content": "You check the weather."},
                        {"role": "user", "content": "Weather in Paris?"}]
            first_server = Server(*flags)
            try:
                client = openai.OpenAI(base_url=first_server.url + "/v1", api_key="x", max_retries=0)
                first = client.chat.completions.create(
                    model=MODEL_NAME, messages=messages, tools=[WEATHER], max_tokens=80, seed=3,
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
            finally:
                first_server.close(self)
            files = [f for f in os.listdir(folder) if f.endswith(".dsv4kv")]
            self.assertEqual(len(files), 1)
            self.assertTrue(os.path.exists(os.path.join(folder, "replay.json")))
            self.assertLessEqual(sum(os.path.getsize(os.path.join(folder, f)) for f in files), 64 << 20)

            call = first.choices[0].message.tool_calls[0]
            history = messages + [
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 20})}]
            for extra, expect_hit in (((), True), (("--fast",), False)):
                server = Server(*flags, *extra)
                try:
                    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
                    second = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=[WEATHER],
                                                            max_tokens=2, seed=4)
                    cached = second.usage.prompt_tokens_details.cached_tokens
                    if expect_hit:
                        self.assertEqual(cached, first.usage.prompt_tokens + first.usage.completion_tokens - 1)
                        self.assertEqual(server.metrics()["dsv4_prefix_cache_disk_loads_total"], 1)
                    else:
                        self.assertEqual(cached, 0)
                        self.assertEqual(server.metrics()["dsv4_prefix_cache_disk_entries"], 0)
                finally:
                    server.close(self)


if __name__ == "__main__":
    unittest.main()
