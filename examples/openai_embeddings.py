"""Embeddings from `pagedattn serve` on an encoder-only model with OpenAI's own Python client:
the same inputs as the client's default (base64, which it decodes) and as floats must give
the same vectors; with --golden, transformers' `pooler_output` of those inputs too.

    pagedattn serve --model tests/hf-models/bert   # in another shell
    pip install openai && python3 examples/openai_embeddings.py \
        [--base-url http://127.0.0.1:8000/v1] [--golden tests/hf-models/bert/golden.json]

CI runs it against the tiny BERT folder (`.ci/serve-openai`); it exits 1 where an answer is
not what the API promises.
"""
import argparse
import json
import sys

from openai import OpenAI

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
parser.add_argument("--golden", help="a golden.json of tests/hf-models: its prompts and pooled outputs")
args = parser.parse_args()

client = OpenAI(base_url=args.base_url, api_key="none")
model = client.models.list().data[0].id
golden = json.load(open(args.golden)) if args.golden else None
inputs = [p["text"] for p in golden["prompts"]] if golden else ["Hello, world.", "Paged attention."]

default = client.embeddings.create(model=model, input=inputs)
floats = client.embeddings.create(model=model, input=inputs, encoding_format="float")
print(f"{model}: {len(default.data)} embeddings of {len(default.data[0].embedding)} "
      f"({default.usage.prompt_tokens} prompt tokens)")

problems = []
if [d.embedding for d in default.data] != [d.embedding for d in floats.data]:
    problems.append("base64 and float embeddings differ")
if golden:
    for i, (d, want) in enumerate(zip(floats.data, golden["pooled"])):
        worst = max(abs(a - b) for a, b in zip(d.embedding, want))
        if len(d.embedding) != len(want) or worst > 1e-5:
            problems.append(f"input {i}: off transformers' pooled output by {worst:.2e}")
for p in problems:
    print("problem:", p, file=sys.stderr)
sys.exit(1 if problems else 0)
