"""The Jinja chat template dsv4 writes as tokenizer.chat_template (src/text/chat_template.cpp)
against dsv4's own encoder (`dsv4 chat-render`, text/chat.cpp, the official DeepSeek-V4
encoding): byte-identical prompts on a corpus of random conversations (chat_corpus.py:
thinking on/off, efforts, tools, tool calls and results, multi-turn, tasks) plus edge
cases, and the same errors where the encoder rejects a conversation.

Engines: jinja2 as a plain Environment and as Hugging Face's chat-template sandbox
(ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols); and, when
LLAMACPP_BUILD names a build of tests/llamacpp (build.sh), llama.cpp's own Jinja engine
reading the template from the GGUF through libllama (llama_chat_render). llama.cpp prints
floats with six decimals, so it is compared on the conversations whose floats it prints as
Python does (the others are counted).

The template takes tool-call arguments decoded (llama.cpp decodes them for templates that
read them as an object); the encoder gets them as OpenAI's JSON text.
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from chat_corpus import corpus  # noqa: E402

CLI = os.environ.get("DSV4_CLI", "build/dsv4")
ASSISTANT = "<｜Assistant｜>"
# What a last message's transition (the generation prompt) can be.
TRANSITIONS = {ASSISTANT + "<think>", ASSISTANT + "</think>", "<｜query｜>", "<｜authority｜>", "<｜domain｜>",
               "<｜read_url｜>", "<｜title｜>", ASSISTANT + "<think><｜action｜>", ASSISTANT + "</think><｜action｜>"}


def edge_cases():
    user = {"role": "user", "content": "q"}
    return [
        {"messages": []},
        {"messages": [user], "tools": [], "response_format": None},
        {"messages": [{"role": "system", "content": None}, user, {"role": "assistant", "content": None}]},
        {"messages": [{"role": "tool", "content": "r"}, user]},
        {"messages": [{"role": "latest_reminder", "content": None}, user]},
        {"messages": [user, {"role": "user", "content": "b", "task": "query"}, {"role": "user", "content": "c"}]},
        {"messages": [user, {"role": "assistant", "content": "a", "task": "title"}]},
        {"messages": [user, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]},
        {"messages": [{"role": "developer", "content": "d"}, user, {"role": "assistant", "content": "a"}, user],
         "thinking": True},
        {"messages": [user], "response_format": {"type": "json_object"}},
        {"messages": [{"role": "developer", "content": "d"}, user], "tools": [{"type": "function", "function": {"name": "f"}}]},
        {"messages": [user, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "function": {"name": "f", "arguments": "{\"k\": \"v\"}"}},
            {"id": "b", "function": {"name": "g", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "b", "content": "B"}, {"role": "tool", "tool_call_id": "a", "content": "A"},
            {"role": "tool", "tool_call_id": "zz", "content": "Z"}, {"role": "user", "content": "more"}], "thinking": False},
        # Conversations the encoder rejects: the template must fail too.
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"messages": [{"role": "user", "content": None}]},
        {"messages": [{"role": "developer", "content": ""}, user]},  # dropped before the last user turn: no error
        {"messages": [user, {"role": "developer", "content": ""}]},
        {"messages": [{"role": "user", "content": "q", "task": "dance"}]},
        {"messages": [user], "reasoning_effort": "low"},
        {"messages": [user], "reasoning_effort": "medium", "effort_table": "0731"},
        {"messages": [user], "effort_table": "v5"},
        {"messages": [user, {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": "[1, 2]"}}]}]},
        {"messages": [{"role": "system", "content": "", "tools": [{"name": "no function key"}]}, user]},
    ]


def for_template(req):
    """The request as a template sees it: tool-call arguments that are JSON, decoded."""
    req = json.loads(json.dumps(req))
    for m in req.get("messages", []):
        for call in m.get("tool_calls") or []:
            args = call.get("function", {}).get("arguments")
            if isinstance(args, str):
                try:
                    call["function"]["arguments"] = json.loads(args)
                except ValueError:
                    pass
    return req


def openai_only(req):
    """Whether a request uses only what an OpenAI chat request carries, and llama-server
    keeps and accepts: system/user/assistant/tool messages with string contents, tool calls
    with ids and JSON-object arguments, request-level tools without extra keys, thinking."""
    if set(req) - {"messages", "tools", "thinking", "add_generation_prompt"}:
        return False
    if any(set(t.get("function", {})) - {"name", "description", "parameters"} for t in req.get("tools", [])):
        return False
    for m in req["messages"]:
        if m["role"] not in ("system", "user", "assistant", "tool") or not isinstance(m.get("content"), str):
            return False
        if set(m) - {"role", "content", "reasoning_content", "tool_calls", "tool_call_id"}:
            return False
        if m.get("reasoning_content", "") is None or "tool_calls" in m and not m["tool_calls"]:
            return False
        for call in m.get("tool_calls", []):  # llama.cpp rejects calls without these
            if "id" not in call or "type" not in call or not call["function"]["arguments"].startswith("{"):
                return False
    return True


def run_lines(cmd, requests):
    stdin = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in requests)
    p = subprocess.run([str(c) for c in cmd], input=stdin.encode(), capture_output=True, timeout=600)
    if p.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed ({p.returncode}): {p.stderr.decode(errors='replace')[-2000:]}")
    lines = p.stdout.decode("utf-8").split("\n")[:-1]  # not splitlines(): U+2028 is data
    if len(lines) != len(requests):
        sys.exit(f"{cmd[0]}: expected {len(requests)} output lines, got {len(lines)}")
    return [json.loads(line) for line in lines]


def jinja_renderers(source):
    import jinja2
    import jinja2.sandbox

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    plain = jinja2.Environment(undefined=jinja2.Undefined)
    hf = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                      extensions=["jinja2.ext.loopcontrols"])
    out = {}
    for name, env in (("jinja2", plain), ("jinja2 HF sandbox", hf)):
        env.globals["raise_exception"] = raise_exception
        template = env.from_string(source)

        def render(req, template=template):
            try:
                return {"text": template.render(**req)}
            except jinja2.exceptions.TemplateError as e:
                return {"error": str(e)}
        out[name] = render
    return out


def compare(name, requests, got, want, failures):
    same = 0
    for i, (req, g, w) in enumerate(zip(requests, got, want)):
        if "error" in w:
            if "error" not in g:
                failures.append(f"{name}: request {i}: the encoder fails ({w['error']}), the template renders "
                                f"{g['text'][:200]!r}\n  request {json.dumps(req, ensure_ascii=False)[:1500]}")
                continue
        elif g.get("text") != w["text"]:
            a, b = g.get("text", ""), w["text"]
            at = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
            failures.append(f"{name}: request {i} differs at byte {at}: template {a[max(0, at - 80):at + 80]!r} / "
                            f"encoder {b[max(0, at - 80):at + 80]!r}{' / ' + g['error'] if 'error' in g else ''}"
                            f"\n  request {json.dumps(req, ensure_ascii=False)[:1500]}")
            continue
        same += 1
    print(f"{name:18s} {same}/{len(requests)} identical to the encoder "
          f"({sum('error' in w for w in want)} of them rejected by both)")


def main():
    failures = []
    source = subprocess.run([CLI, "chat-render", "--template"], capture_output=True, check=True).stdout.decode()
    cases = corpus()
    edges = [dict({"add_generation_prompt": True}, **r) for r in edge_cases()]
    requests = [r for r, _ in cases] + edges
    python_floats = [f for _, f in cases] + [False] * len(edge_cases())
    want = run_lines([CLI, "chat-render"], requests)
    rejected = sum("error" in w for w in want)
    if rejected > len(edge_cases()) + len(requests) // 10:
        failures.append(f"the encoder rejects {rejected} of {len(requests)} requests: the corpus is broken")
    templated = [for_template(r) for r in requests]

    with tempfile.TemporaryDirectory(prefix="dsv4-chat-template-") as tmp:
        # The template as dsv4 writes it into a GGUF, read back with llama.cpp's gguf package.
        model = Path(tmp) / "tiny.gguf"
        subprocess.run([CLI, "synth", "--preset", "tiny", "--seed", "1", "--bundled", "-o", model], check=True, capture_output=True)
        import gguf
        field = gguf.GGUFReader(model).fields["tokenizer.chat_template"]
        in_file = bytes(field.parts[field.data[0]]).decode("utf-8")
        if in_file != source:
            failures.append("tokenizer.chat_template in the synth file differs from `dsv4 chat-render --template`")

        for name, render in jinja_renderers(in_file).items():
            compare(name, requests, [render(r) for r in templated], want, failures)

        # Without add_generation_prompt the last message's transition is left out.
        no_prompt = [dict(r, add_generation_prompt=False) for r in templated]
        render = jinja_renderers(in_file)["jinja2"]
        bad = 0
        for req, w in zip(no_prompt, want):
            if "error" in w:
                continue
            g = render(req).get("text", "")
            rest = w["text"][len(g):]
            if not w["text"].startswith(g) or (rest and rest not in TRANSITIONS):
                bad += 1
                if bad <= 3:
                    failures.append(f"add_generation_prompt=false: {g[-120:]!r} vs {w['text'][-120:]!r}")
        print(f"add_generation_prompt=false leaves out exactly the final transition: {bad} exceptions")

        build = os.environ.get("LLAMACPP_BUILD")
        if build:
            tool = Path(build) / "llama_chat_render"
            plain = [i for i, f in enumerate(python_floats) if not f]
            got = run_lines([tool, model], [templated[i] for i in plain])
            compare("llama.cpp jinja", [requests[i] for i in plain], got, [want[i] for i in plain], failures)
            print(f"{'':18s} ({len(requests) - len(plain)} requests with floats only Python prints exactly: "
                  f"jinja2 only)")
            # As llama-server renders an OpenAI request with this file's template.
            chosen = [i for i in plain if openai_only(requests[i]) and "error" not in want[i]]
            got = run_lines([tool, model, "--server"], [requests[i] for i in chosen])
            compare("llama-server path", [requests[i] for i in chosen], got, [want[i] for i in chosen], failures)
        else:
            print("llama.cpp's engine: not checked here (LLAMACPP_BUILD unset; tests/llamacpp/run.sh checks it)")

    for f in failures[:20]:
        print("FAIL", f)
    if failures:
        print(f"{len(failures)} failures")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
