#!/usr/bin/env python3
"""Writes the seed corpora of the text fuzzers: fuzz/corpus/tokenizer/, fuzz/corpus/chat/ and
fuzz/corpus/output_parser/. A few inputs of each kind the parsers see (special tokens, DSML
tool calls, every chat role), so the fixed-length fuzzing in scripts/test.sh starts from
the interesting paths instead of from nothing. The input layouts follow the targets:
fuzz_chat takes an options byte then JSON, fuzz_output_parser a mode byte and a piece-size
byte then text. Deterministic: rerunning rewrites the same bytes.
Usage: python3 fuzz/corpus/make_text_seeds.py
"""
import json
import pathlib
import shutil

ROOT = pathlib.Path(__file__).resolve().parent

EOS = "<｜end▁of▁sentence｜>"
CALL = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
        '<｜DSML｜parameter name="a" string="false">3</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="b" string="false">["x", "y"]</｜DSML｜parameter>\n'
        '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')

TOKENIZER = {
    "ascii.txt": "Hello, world! The quick brown fox jumps over 1234567 lazy dogs.\n",
    "code.txt": "def f(x):\n\treturn x  *  2   # tabs, runs of spaces\r\n\n\n",
    "cjk_emoji.txt": "你好，世界！こんにちは 안녕하세요 🙂👍🏽 naïve café",
    "special_tokens.txt": "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>hm</think>ok" + EOS,
    "dsml.txt": CALL,
    "invalid_utf8.bin": b"ok \xff\xfe then \xc3",
    "overlong_utf8.bin": b"\xc0\xaf\xe0\x80\xaf",
}

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CHAT = {
    # options byte: bit 0 thinking, 1 drop_thinking, 2 effort table V4-0731, 3 effort "max",
    # bits 4-5 how much of the conversation is context.
    "system_user.json": (0x00, [{"role": "system", "content": "You are helpful."},
                                {"role": "user", "content": "Hi"}]),
    "thinking_history.json": (0x13, [{"role": "user", "content": "2+2?"},
                                     {"role": "assistant", "reasoning_content": "add", "content": "4"},
                                     {"role": "user", "content": "and 3+3?"}]),
    "tool_round_trip.json": (0x21, [{"role": "system", "content": "", "tools": TOOLS},
                                    {"role": "user", "content": "Weather in Paris?"},
                                    {"role": "assistant", "content": "",
                                     "tool_calls": [{"id": "c1", "function": {"name": "get_weather",
                                                                              "arguments": {"city": "Paris"}}}]},
                                    {"role": "tool", "tool_call_id": "c1",
                                     "content": [{"type": "text", "text": "18C"}, {"type": "image"}]},
                                    {"role": "user", "content": "Thanks", "wo_eos": True}]),
    "roles_and_tasks.json": (0x0d, [{"role": "developer", "content": "Be brief.",
                                     "response_format": {"type": "json_object"}},
                                    {"role": "latest_reminder", "content": "today is Monday"},
                                    {"role": "user", "content": "Title?", "task": "title"}]),
    "bad_shapes.json": (0x00, [{"role": "user", "content": 5}, {"content": "no role"}]),
}

OUTPUT_PARSER = {
    # mode byte: bit 0 thinking; then the piece size byte (1 + b % 17).
    "chat_plain.txt": (0, 3, "Plain answer." + EOS),
    "thinking.txt": (1, 0, "let me think</think>The answer is 4." + EOS),
    "tool_call.txt": (0, 16, "Calling." + CALL + EOS),
    "tool_call_thinking.txt": (1, 5, "need a tool</think>" + CALL + EOS + "trailing"),
    "tool_call_bad.txt": (0, 1, '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="g">\n'
                                '<｜DSML｜parameter name="a" string="maybe">x</｜DSML｜parameter>\n'),
}


def write_dir(directory, files):
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    for name, data in sorted(files.items()):
        (directory / name).write_bytes(data)


def main():
    write_dir(ROOT / "tokenizer", {k: v if isinstance(v, bytes) else v.encode() for k, v in TOKENIZER.items()})
    write_dir(ROOT / "chat", {k: bytes([opts]) + json.dumps(msgs, ensure_ascii=False).encode()
                              for k, (opts, msgs) in CHAT.items()})
    write_dir(ROOT / "output_parser", {k: bytes([mode, step]) + text.encode()
                                       for k, (mode, step, text) in OUTPUT_PARSER.items()})
    print(f"wrote {len(TOKENIZER)} tokenizer, {len(CHAT)} chat and {len(OUTPUT_PARSER)} output parser seeds")


if __name__ == "__main__":
    main()
