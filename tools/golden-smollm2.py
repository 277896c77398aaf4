#!/usr/bin/env python3
"""Golden tokens for pagedattn-engine: Hugging Face transformers run on the SmolLM2 GGUF file.

transformers reads the GGUF itself (tokenizer from its metadata, weights dequantized to f32), so
the ids here are what a correct f32 implementation of the same file produces. Writes
crates/pagedattn-engine/tests/engine_tests/golden/smollm2.json with:
  - the model file's name and sha256, the library versions, the settings;
  - tokenizer cases: varied strings with transformers' ids and decoded text;
  - chat cases: one-turn chats (with and without a system message) rendered by
    apply_chat_template, with their ids;
  - generation cases: prompts (short, long, code, question, a chat turn), their ids, the first
    32 greedy ids in f32 (argmax of each step's logits, continuing past EOS so every case has
    32), their decoded text, and per step the margin between the best and second-best logit
    (a near tie there may flip under another summation order; ids, not logits, are the test).

Run from the repository root, on a clean machine (CPU only, one thread; about 25 s after the
installs, which take a minute or two):
    bash tools/fetch-smollm2.sh
    python3 -m venv .venv
    .venv/bin/pip install -r tools/golden-requirements.txt
    HF_HUB_OFFLINE=1 .venv/bin/python tools/golden-smollm2.py
Options: --model PATH (default models/SmolLM2-135M-Instruct.Q4_1.gguf), --out PATH.
"""

import argparse
import hashlib
import json
import os
import platform
import re
import sys
import time
from importlib import metadata as importlib_metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = ROOT / "crates" / "pagedattn-engine" / "tests" / "engine_tests" / "golden" / "smollm2.json"
NEW_TOKENS = 32

# Strings for the tokenizer test: spaces, newlines, digits, unicode, emoji, code, chat markers.
TOKENIZER_STRINGS = [
    "",
    "Hello world",
    "Hello, world! How are you today?",
    " leading space",
    "trailing space ",
    "  two  spaces   three",
    "line1\nline2\n\n\nline3\n",
    "\ttab\tand\r\nCRLF\r\n",
    "   \n  \n \t ",
    "digits 0 12 345 6789 3.14159 1,000,000 2024-06-01",
    "don't won't I'm we'll they've she'd IT'S",
    "Unicode: café naïve Zürich — “quotes” «guillemets» 日本語 中文 한국어 Ελληνικά русский",
    "αβγ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√ ½ ™ \u00a0nbsp \u200bzwsp",
    "emoji: 😀👍🏽 🇫🇷 👨\u200d👩\u200d👧 ❤️",
    "def square(x):\n    return x ** 2  # square\n\nprint([square(i) for i in range(10)])\n",
    "fn main() {\n\tlet v: Vec<u32> = (0..10).collect();\n\tprintln!(\"{v:?}\");\n}",
    "https://example.com/path?q=1&r=2#frag user@example.org",
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_end|><|endoftext|>",
    "  <|im_end|>  text<|im_start|>",
    "<|im_start not a marker <|im_end|",
    "<repo_name>pagedattn<file_sep>src/lib.rs<filename>",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX.",
]

SYSTEM = "You are a concise assistant."
USER = "What is the capital of France?"

LONG_PROMPT = (
    "The history of computing is a story of abstraction. Early machines were programmed by "
    "rewiring panels and setting switches, and every program was tied to the hardware it ran on. "
    "Assembly languages gave names to instructions, and compilers later translated structured "
    "programs into those instructions, so that a programmer could think about loops, functions "
    "and data structures instead of registers. Operating systems hid the details of disks, "
    "memory and devices behind files and processes. Networks connected machines, and protocols "
    "let programs on different computers talk to one another without knowing how the bits "
    "travelled. Each layer made the one below it easier to use, and each one also introduced "
    "new costs: memory, latency, and the difficulty of understanding what really happens when a "
    "program runs. Today, large language models are served by systems that batch many requests "
    "together, cache the keys and values of attention in fixed-size blocks, and schedule work so "
    "that expensive accelerators stay busy. In short, the next layer of abstraction is"
)

GENERATION_PROMPTS = [
    ("short", "The capital of France is"),
    ("long", LONG_PROMPT),
    ("code", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    ("question", "Question: Why is the sky blue?\nAnswer:"),
    ("list", "Here are three tips for staying healthy:\n1."),
]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def versions():
    names = ["torch", "transformers", "tokenizers", "gguf", "accelerate", "numpy", "jinja2"]
    out = {"python": platform.python_version()}
    for n in names:
        out[n] = importlib_metadata.version(n)
    return out


def dumps(obj):
    """Indented JSON with every list of numbers on one line, so id lists stay compact."""
    text = json.dumps(obj, indent=1, ensure_ascii=False)
    return re.sub(
        r"\[\s*(-?[\d.e+-]+(?:,\s*-?[\d.e+-]+)*)\s*\]",
        lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]",
        text,
    ) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if not args.model.is_file():
        sys.exit(f"{args.model} is missing: run bash tools/fetch-smollm2.sh first")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    # One thread: a fixed summation order, so the margins below do not change with the
    # machine's core count (the ids did not change in trials), and no oversubscription.
    torch.set_num_threads(1)
    directory, name = str(args.model.parent), args.model.name

    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tokenizer_cases = []
    for text in TOKENIZER_STRINGS:
        ids = tok(text)["input_ids"]
        tokenizer_cases.append({"text": text, "ids": ids, "decoded": tok.decode(ids)})

    chat_cases = []
    for label, messages, add_generation_prompt in [
        ("user", [{"role": "user", "content": USER}], True),
        ("system_user", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}], True),
        ("user_no_generation_prompt", [{"role": "user", "content": USER}], False),
    ]:
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        ids = tok(rendered)["input_ids"]
        # The path a serving engine takes (render, then encode) must equal transformers' own.
        direct = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
        direct = direct["input_ids"] if hasattr(direct, "keys") else direct
        assert list(direct) == ids, (label, direct, ids)
        chat_cases.append(
            {
                "name": label,
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "rendered": rendered,
                "ids": ids,
            }
        )

    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    loaded = time.monotonic()

    prompts = [(label, text) for label, text in GENERATION_PROMPTS]
    prompts.append(("chat", chat_cases[0]["rendered"]))
    generation_cases = []
    with torch.no_grad():
        for label, text in prompts:
            prompt_ids = tok(text)["input_ids"]
            out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
            generated, margins = [], []
            for _ in range(NEW_TOKENS):
                logits = out.logits[0, -1].float()
                top = torch.topk(logits, 2)
                next_id = int(torch.argmax(logits))
                generated.append(next_id)
                margins.append(round(float(top.values[0] - top.values[1]), 3))
                out = model(
                    input_ids=torch.tensor([[next_id]]), past_key_values=out.past_key_values, use_cache=True
                )
            generation_cases.append(
                {
                    "name": label,
                    "text": text,
                    "prompt_ids": prompt_ids,
                    "generated_ids": generated,
                    "generated_text": tok.decode(generated),
                    "top2_margins": margins,
                }
            )
            print(f"{label}: {len(prompt_ids)} prompt ids -> {tok.decode(generated)!r}", file=sys.stderr)

    golden = {
        "model": {"file": name, "sha256": sha256(args.model)},
        "versions": versions(),
        "settings": {
            "dtype": "float32",
            "attn_implementation": "eager",
            "decoding": f"greedy argmax, {NEW_TOKENS} new tokens, no repetition penalty, continues past EOS",
            "tokenizer": "AutoTokenizer.from_pretrained(dir, gguf_file=...); ids of tok(text)['input_ids']",
        },
        "tokenizer_cases": tokenizer_cases,
        "chat_cases": chat_cases,
        "generation_cases": generation_cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dumps(golden), encoding="utf-8")
    done = time.monotonic()
    print(
        f"wrote {args.out} in {done - started:.1f} s (model load {loaded - started:.1f} s, "
        f"generation {done - loaded:.1f} s)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
