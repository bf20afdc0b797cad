"""Random conversations for checking the chat template against dsv4's encoder
(test_chat_template.py): system/developer messages with tools and response formats,
request-level tools, multi-turn thinking and chat, reasoning efforts of both tables,
tool calls with arguments of every JSON type, tool results in any order (text, null and
part lists), user texts merged with results, latest_reminder, tasks, prefilled replies
(wo_eos), and text with quotes, backslashes, control characters and non-ASCII.

corpus(seed, n) -> list of requests, each {"messages": [...], options...} as OpenAI
clients send them (tool-call arguments as JSON text), deterministic in the seed."""
import json
import random

WORDS = ["the", "weather", "Beijing", "北京", "温泉", "naïve", "café", "😀", "Grüße", "x", "λ",
         "quote\"d", "back\\slash", "tab\there", "line\nbreak", "cr\rhere", "ctl\x01\x1f\x0b\x7f",
         "<tag>", "&amp;", "'single'", "{braces}", "[brackets]", "1.5", "—", "\u2028", "é",
         "DSML", "</think>", "zero-width\u200b", "back\bspace", "form\ffeed", "null", "true"]
# Floats every engine prints as Python does, and floats only Python's repr gets right
# (exponents, more than six decimals); the second kind marks a request "python_floats".
PLAIN_FLOATS = [0.5, 2.5, -3.25, 100.0, 2.0, 0.0, 1.125, 12345.75, -0.5, 0.001]
REPR_FLOATS = [1e-05, 1e16, 0.30000000000000004, 3.141592653589793, 1e+300, -2.5e-10, 123456789.123]


def text(rng, lo=1, hi=8):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def json_value(rng, depth, state):
    kinds = ["str", "int", "float", "bool", "null"] + (["list", "obj"] if depth < 3 else [])
    k = rng.choice(kinds)
    if k == "str":
        return text(rng, 0, 4)
    if k == "int":
        return rng.choice([0, 1, -7, 42, 2**40, -(2**53)])
    if k == "float":
        if rng.random() < 0.25:
            state["python_floats"] = True
            return rng.choice(REPR_FLOATS)
        return rng.choice(PLAIN_FLOATS)
    if k == "bool":
        return rng.random() < 0.5
    if k == "null":
        return None
    if k == "list":
        return [json_value(rng, depth + 1, state) for _ in range(rng.randint(0, 3))]
    return {text(rng, 1, 2): json_value(rng, depth + 1, state) for _ in range(rng.randint(0, 3))}


def tool_def(rng, name, state):
    props = {}
    for _ in range(rng.randint(0, 3)):
        props[rng.choice(["query", "city", "n", "unit", "flag", "q\"uote", "名字"])] = {
            "type": rng.choice(["string", "integer", "number", "boolean", "array", "object"]),
            "description": text(rng, 0, 5)}
    fn = {"name": name, "description": text(rng, 0, 8),
          "parameters": {"type": "object", "properties": props, "required": list(props)[:1]}}
    if rng.random() < 0.3:
        fn["strict"] = rng.random() < 0.5
    if rng.random() < 0.2:
        fn["extra"] = json_value(rng, 1, state)
    return {"type": "function", "function": fn}


def tool_calls(rng, names, state):
    calls = []
    for i in range(rng.randint(1, 3)):
        r = rng.random()
        if r < 0.08:
            args = "not json {"  # rendered as one string parameter, as the reference does
        elif r < 0.12:
            args = ""
        elif r < 0.2:
            args = "{}"
        else:
            args = json.dumps({rng.choice(["query", "city", "n", "unit", "flag", "a\"b", "键", "x y"]) + str(j):
                               json_value(rng, 1, state) for j in range(rng.randint(1, 4))},
                              ensure_ascii=rng.random() < 0.5)
        call = {"type": "function", "function": {"name": rng.choice(names), "arguments": args}}
        if rng.random() < 0.9:
            call["id"] = f"call_{rng.randint(0, 3 if rng.random() < 0.2 else 10**6):06d}"
        calls.append(call)
    return calls


def tool_results(rng, calls):
    results = []
    for call in rng.sample(calls, len(calls)):  # any order: the encoder sorts them back
        m = {"role": "tool"}
        if "id" in call and rng.random() < 0.9:
            m["tool_call_id"] = call["id"]
        r = rng.random()
        if r < 0.7:
            m["content"] = text(rng, 0, 6)
        elif r < 0.8:
            m["content"] = None
        elif r < 0.9:
            m["content"] = [{"type": "text", "text": text(rng)}, {"type": "image_url", "image_url": {"url": "x"}},
                            {"type": "text", "text": text(rng)}][: rng.randint(1, 3)]
        results.append(m)
    return results


def conversation(rng):
    state = {"python_floats": False}
    names = ["get_weather", "search", "open_url", "calc"]
    req = {"messages": []}
    msgs = req["messages"]
    tools = [tool_def(rng, n, state) for n in rng.sample(names, rng.randint(1, 3))] if rng.random() < 0.45 else []
    where = rng.random()
    fmt = None
    if rng.random() < 0.12:
        fmt = rng.choice([{"type": "json_object"}, {"type": "object", "properties": {"a": {"type": "number"}}},
                          "text", [1, 2.5], {}, False])
    if rng.random() < 0.6:
        sys_msg = {"role": "system", "content": text(rng, 0, 10)}
        if tools and where < 0.5:
            sys_msg["tools"] = tools
        if fmt is not None and where < 0.5:
            sys_msg["response_format"] = fmt
        msgs.append(sys_msg)
    elif rng.random() < 0.1:
        msgs.append({"role": "developer", "content": text(rng, 1, 6), **({"tools": tools} if tools and where < 0.5 else {})})
    if tools and where >= 0.5:
        req["tools"] = tools
    if fmt is not None and where >= 0.5:
        req["response_format"] = fmt
    if rng.random() < 0.15:
        msgs.append({"role": "latest_reminder", "content": text(rng, 1, 4)})
    if rng.random() < 0.05:
        msgs.append({"role": "latest_reminder"})

    for _ in range(rng.randint(1, 4)):
        user = {"role": "user", "content": text(rng, 1, 10)}
        if rng.random() < 0.08:
            user["task"] = rng.choice(["query", "authority", "domain", "read_url", "action"])
        msgs.append(user)
        if rng.random() < 0.15:
            msgs.append({"role": "user", "content": text(rng)})  # merged into the same turn
        if rng.random() < 0.06:
            msgs.append({"role": "latest_reminder", "content": text(rng, 1, 3)})
        if rng.random() < 0.05:
            msgs.append({"role": "developer", "content": text(rng, 1, 5)})
        for _ in range(rng.randint(0, 2) if tools else 0):
            a = {"role": "assistant", "content": text(rng, 0, 6) if rng.random() < 0.5 else "",
                 "tool_calls": tool_calls(rng, names, state)}
            if rng.random() < 0.8:
                a["reasoning_content"] = text(rng, 0, 8)
            msgs.append(a)
            msgs.extend(tool_results(rng, a["tool_calls"]))
            if rng.random() < 0.2:
                msgs.append({"role": "user", "content": text(rng)})  # joins the results' turn
        if rng.random() < 0.75:
            a = {"role": "assistant", "content": text(rng, 0, 10)}
            r = rng.random()
            if r < 0.6:
                a["reasoning_content"] = text(rng, 0, 10)
            elif r < 0.7:
                a["reasoning_content"] = None
            if rng.random() < 0.05:
                a["content"] = None
            if rng.random() < 0.05:
                a["tool_calls"] = []
            if rng.random() < 0.04:
                a["task"] = "title"
            msgs.append(a)
    if msgs[-1]["role"] == "assistant" and rng.random() < 0.1:
        msgs[-1]["wo_eos"] = True

    req["thinking"] = rng.random() < 0.6
    if rng.random() < 0.2:
        req["drop_thinking"] = rng.random() < 0.5
    if rng.random() < 0.3:
        req["effort_table"] = rng.choice(["v4", "0731"])
        req["reasoning_effort"] = rng.choice(["high", "max"] if req["effort_table"] == "v4" else ["low", "high", "max"])
    elif rng.random() < 0.1:
        req["reasoning_effort"] = rng.choice(["high", "max"])
    req["add_generation_prompt"] = True
    return req, state["python_floats"]


def corpus(seed=20261001, n=400):
    """[(request, needs_python_floats)]."""
    rng = random.Random(seed)
    return [conversation(rng) for _ in range(n)]
