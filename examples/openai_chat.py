"""Ask `pagedattn serve` with OpenAI's own Python client: a chat completion, then the same one
streamed (greedy, so the two texts must match), as README.md shows it.

    pagedattn serve --model models/SmolLM2-135M-Instruct.Q4_1.gguf   # in another shell
    pip install openai && python3 examples/openai_chat.py [--base-url http://127.0.0.1:8000/v1]

CI runs it against the server on SmolLM2 (`.ci/serve-openai`); it exits 1 where an answer is
not what the API promises.
"""
import argparse
import sys

from openai import OpenAI

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
parser.add_argument("--question", default="What is the capital of France?")
args = parser.parse_args()

# The server checks no key; the client wants one.
client = OpenAI(base_url=args.base_url, api_key="none")
model = client.models.list().data[0].id
messages = [{"role": "user", "content": args.question}]

answer = client.chat.completions.create(
    model=model, messages=messages, max_tokens=24, temperature=0
)
text = answer.choices[0].message.content
print(f"{model}: {text!r} ({answer.choices[0].finish_reason}; {answer.usage.prompt_tokens} "
      f"prompt tokens, {answer.usage.completion_tokens} generated)")

stream = client.chat.completions.create(
    model=model, messages=messages, max_tokens=24, temperature=0, stream=True,
    stream_options={"include_usage": True},
)
pieces, reason, usage = [], None, None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for choice in chunk.choices:
        if choice.delta.content:
            pieces.append(choice.delta.content)
        reason = choice.finish_reason or reason
streamed = "".join(pieces)
print(f"streamed in {len(pieces)} pieces: {streamed!r} ({reason})")

problems = []
if not text:
    problems.append("the answer is empty")
if streamed != text:
    problems.append("the streamed text differs from the answer")
if reason not in ("stop", "length") or answer.choices[0].finish_reason != reason:
    problems.append(f"finish reasons {answer.choices[0].finish_reason!r} and {reason!r}")
if usage is None or usage.completion_tokens != answer.usage.completion_tokens:
    problems.append(f"the stream's usage {usage} differs from {answer.usage}")
if problems:
    sys.exit("openai_chat: " + "; ".join(problems))
