"""A deterministic corpus of varied strings for checking a tokenizer against Hugging Face
`tokenizers`: prose, code, CJK, emoji, whitespace and digit runs, added tokens inside text,
and random code points / random bytes made valid UTF-8. Same seed, same corpus."""
import json
import random
from pathlib import Path

WORDS = ("the quick brown fox jumps over lazy dog tokenizer DeepSeek model weights can't "
         "won't it's I'm you're we'll they'd Hello WORLD naïve café résumé Straße Ελληνικά "
         "русский язык العربية עברית हिन्दी ไทย Tiếng Việt 한국어 日本語 中文 ①②③ ℕ ∑ √2 "
         "e.g. U.S.A. http://example.com/path?q=1&x=2 user@mail.org #hashtag @mention").split()
CODE = [
    "def f(x):\n    return x * 2\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    "if __name__ == \"__main__\":\n    main()\n",
    "const auto& [k, v] = *it; // C++17\n",
    "SELECT id, name FROM users WHERE age >= 18;\n",
    "<div class=\"x\">&nbsp;</div>\r\n",
    "fn main() { println!(\"{}\", 1_000_000u64); }",
    "x = {'a': [1, 2.5e-3, None], \"b\": True}",
    "    \n\n\t\t// TODO: fix\n",
    "$ echo $HOME && ls -la | grep '\\.py$'",
    "#include <vector>\nstd::vector<int> v{1,2,3};",
    "λx.λy.x  ->  (\\x -> x + 1) <$> Just 3",
]
CJK = ("你好世界推理答案深度求索人工智能模型语言中文测试"
       "ひらがなカタカナテストです日本語の文章ー・"
       "한국어텍스트입니다")
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🇯🇵", "🏳️‍🌈", "❤️", "🤖", "🔥", "✨", "🧑‍💻", "1️⃣", "🫠"]
SPACES = [" ", "  ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2028", "\u2009", "\u200b", "\x0b", "\x0c", "\u0085"]
DIGITS = "0123456789"
OTHER_DIGITS = ["٠١٢٣", "०१२३", "０１２３", "²³", "½", "Ⅻ", "𝟘𝟙𝟚"]


def special_tokens(tokenizer_json_path):
    data = json.loads(Path(tokenizer_json_path).read_text(encoding="utf-8"))
    return [a["content"] for a in data["added_tokens"]]


def _words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _cjk(rng, n):
    return "".join(rng.choice(CJK) for _ in range(n))


def _digits(rng):
    n = rng.choice([1, 2, 3, 4, 5, 7, 12, 40])
    s = "".join(rng.choice(DIGITS) for _ in range(n))
    return rng.choice([s, s + "." + s[:3], "-" + s, s[:2] + "," + s, "v" + s, s + "th",
                       rng.choice(OTHER_DIGITS) + s])


def _whitespace(rng):
    return "".join(rng.choice(SPACES) * rng.choice([1, 1, 2, 3, 8, 33]) for _ in range(rng.randint(1, 5)))


def _random_codepoints(rng, n):
    out = []
    for _ in range(n):
        plane = rng.random()
        if plane < 0.3:
            cp = rng.randint(0x20, 0x7E)
        elif plane < 0.6:
            cp = rng.randint(0x80, 0xFFFF)
        elif plane < 0.8:
            cp = rng.randint(0x10000, 0x10FFFF)
        else:
            cp = rng.randint(0, 0x7FF)
        if 0xD800 <= cp <= 0xDFFF:
            cp = 0xFFFD
        out.append(chr(cp))
    return "".join(out)


def _random_bytes(rng, n):
    return bytes(rng.randrange(256) for _ in range(n)).decode("utf-8", errors="replace")


def _with_specials(rng, specials):
    parts = []
    for _ in range(rng.randint(1, 6)):
        r = rng.random()
        if r < 0.35:
            parts.append(rng.choice(specials))
        elif r < 0.5:  # a broken special token: must not match
            t = rng.choice(specials)
            parts.append(t[: rng.randint(1, max(1, len(t) - 1))])
        else:
            parts.append(rng.choice([_words(rng, 3), _cjk(rng, 4), " ", "\n\n", "<", "｜", "</"]))
    return "".join(parts)


def _mixed(rng, specials):
    gens = [lambda: _words(rng, rng.randint(1, 12)), lambda: rng.choice(CODE), lambda: _cjk(rng, rng.randint(1, 20)),
            lambda: "".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 4))), lambda: _whitespace(rng),
            lambda: _digits(rng), lambda: _with_specials(rng, specials), lambda: _random_codepoints(rng, rng.randint(1, 8))]
    return "".join(rng.choice(gens)() for _ in range(rng.randint(2, 6)))


def corpus(tokenizer_json_path, n=10000, seed=20250731):
    """n strings; the same for the same (n, seed)."""
    rng = random.Random(seed)
    specials = special_tokens(tokenizer_json_path)
    kinds = [
        lambda: _words(rng, rng.randint(1, 40)),
        lambda: "".join(rng.choice(CODE) for _ in range(rng.randint(1, 4))),
        lambda: _cjk(rng, rng.randint(1, 60)),
        lambda: " ".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 8))),
        lambda: _whitespace(rng) + _words(rng, 2) + _whitespace(rng),
        lambda: " ".join(_digits(rng) for _ in range(rng.randint(1, 6))),
        lambda: _with_specials(rng, specials),
        lambda: _random_codepoints(rng, rng.randint(1, 50)),
        lambda: _random_bytes(rng, rng.randint(1, 80)),
        lambda: _mixed(rng, specials),
    ]
    out = ["", " ", "\n", "a", " " * 300, "\n" * 50, "9" * 100, "<｜User｜>", "<｜User", "｜DSML｜tool_calls"]
    while len(out) < n:
        out.append(rng.choice(kinds)())
    return out[:n]
