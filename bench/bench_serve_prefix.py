"""Prefix reuse in `dsv4 serve`, measured: an agent transcript (system prompt with
tools, then turns of tool call -> tool result) replayed against a server with the prefix
cache and against one without (--cache-entries 0), reporting per turn the prompt tokens,
the cached ones and the time to first token (streaming). Not a test: numbers depend on
the machine. Usage: python3 bench/bench_serve_prefix.py [--cli build/dsv4] [--turns 6]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
import openai  # noqa: E402

TOOL = {"type": "function", "function": {"name": "run", "description": "Run a shell command in the repository",
                                          "parameters": {"type": "object", "properties": {
                                              "command": {"enum": ["ls", "make", "make test", "git diff"]}},
                                              "required": ["command"]}}}
SYSTEM = "You are a coding agent working in a C++ repository. " * 8


def ttft_sum(server):
    m = server.metrics()
    return m["dsv4_time_to_first_token_seconds_sum"], m["dsv4_time_to_first_token_seconds_count"]


def transcript(server, turns):
    """(turn, prompt tokens, cached tokens, seconds to the first sampled token) per turn;
    the time is the server's own (dsv4_time_to_first_token_seconds)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Build and test the project."}]
    rows = []
    for turn in range(turns):
        before = ttft_sum(server)
        call = None
        usage = None
        for chunk in client.chat.completions.create(model=os.environ.get("MODEL", "dsv4-builtin-tiny-v2"),
                                                    messages=messages, tools=[TOOL], tool_choice="required",
                                                    max_tokens=60, seed=turn, stream=True,
                                                    stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.tool_calls:
                call = chunk.choices[0].delta.tool_calls[0]
            if chunk.usage:
                usage = chunk.usage
        after = ttft_sum(server)
        assert after[1] == before[1] + 1
        rows.append((turn, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, after[0] - before[0]))
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]})
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "ok\n" * 8})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", default="build/dsv4")
    ap.add_argument("--turns", type=int, default=5)
    args = ap.parse_args()
    os.environ["DSV4_CLI"] = args.cli
    os.environ.setdefault("DSV4_BINARY_DIR", os.path.dirname(args.cli) or ".")
    from serve_fixture import Server
    for label, flags in (("with prefix cache", ()), ("without (--cache-entries 0)", ("--cache-entries", "0"))):
        server = Server("--nothink", *flags)
        try:
            transcript(server, 1)  # warm-up: page in the weights
            rows = transcript(server, args.turns)
        finally:
            server.stop()
        print(f"{label}:")
        print("  turn  prompt  cached  TTFT ms")
        for turn, prompt, cached, ttft in rows:
            print(f"  {turn:4d}  {prompt:6d}  {cached:6d}  {ttft * 1000:7.1f}")


if __name__ == "__main__":
    main()
