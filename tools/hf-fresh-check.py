#!/usr/bin/env python3
"""`pagedattn run --model DIR` on Hugging Face checkpoints the tests never saw, against
transformers on the same folders.

For each family (llama, qwen2, mistral, gemma2, bloom, opt, bert, bart) this builds, with
transformers itself, a random-weight checkpoint shaped unlike tests/hf-models' (other widths,
head counts, layer counts, windows and caps; a seed of its own), saved as transformers saves
big models — in bf16 for the decoders and sharded into several `*.safetensors` files with an
index (`max_shard_size`) — with the family's tokenizer from tests/hf-models. It then runs the
pagedattn binary on each folder (`run --model DIR --prompt TEXT --json`) and compares:

  - decoders and BART: the greedy tokens of transformers' `generate` on the same folder loaded
    in float32 (what pagedattn computes in), up to the first step whose top-2 margin is under
    1e-3 (at least 8 tokens must be compared);
  - BERT: the pooled output (`pooler_output`), within 1e-5 of the largest magnitude.

With --smollm2 PATH (the GGUF of tools/fetch-smollm2.sh), also SmolLM2 as a Hugging Face folder:
transformers loads the GGUF and `save_pretrained`s it, and `pagedattn run` on that folder must
give the same greedy tokens as on the GGUF (both dequantized to f32) for a few prompts.

Usage, from the repository root after `cargo build --release -p pagedattn-cli` (the venv of
tools/golden-requirements.txt, as for tools/hf-goldens.py):

    .venv/bin/python tools/hf-fresh-check.py [--bin target/release/pagedattn] [--keep DIR]
        [--smollm2 models/SmolLM2-135M-Instruct.Q4_1.gguf] [--backend cuda] [--only llama,bert]

`--backend cuda` puts pagedattn's attention on the GPU (a GPU machine with torch and
transformers; the models compute on the host in f32 there too, or on the GPU model in bf16 for
Llama's blocks unless `--model-on host`: the script passes `--model-on host` with cuda).

Exits 1 on any disagreement; prints one line per check.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests" / "hf-models"
SEED = 4242
NEW_TOKENS = 24
PROMPTS = [
    "The river turned slowly toward the sea, and the baker",
    "A program tells the computer what to do, one step at a time:",
]


def config(family: str):
    """A config shaped unlike the tests' (and like the real family)."""
    # (Heads of 32 or more: the CUDA backend's sizes, so that --backend cuda checks too.)
    causal = dict(vocab_size=512, hidden_size=96, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=32, intermediate_size=160,
                  max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=50000.0,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2, initializer_range=0.12)
    if family == "llama":
        return transformers.LlamaConfig(**causal, tie_word_embeddings=True)
    if family == "qwen2":
        return transformers.Qwen2Config(**causal, use_sliding_window=False)
    if family == "mistral":
        return transformers.MistralConfig(**causal, sliding_window=12)
    if family == "gemma2":
        return transformers.Gemma2Config(**{**causal, "num_hidden_layers": 4}, sliding_window=10,
                                         query_pre_attn_scalar=24, attn_logit_softcapping=8.0,
                                         final_logit_softcapping=3.0,
                                         hidden_activation="gelu_pytorch_tanh")
    if family == "bloom":
        return transformers.BloomConfig(vocab_size=512, hidden_size=160, n_layer=3, n_head=5,
                                        bos_token_id=0, eos_token_id=1, pad_token_id=2,
                                        initializer_range=0.12)
    if family == "opt":
        return transformers.OPTConfig(vocab_size=512, hidden_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, ffn_dim=224,
                                      max_position_embeddings=96, activation_function="relu",
                                      bos_token_id=0, eos_token_id=1, pad_token_id=2,
                                      init_std=0.12)
    if family == "bert":
        return transformers.BertConfig(vocab_size=512, hidden_size=96, num_hidden_layers=3,
                                       num_attention_heads=3, intermediate_size=160,
                                       max_position_embeddings=96, initializer_range=0.12)
    if family == "bart":
        return transformers.BartConfig(vocab_size=512, d_model=96, encoder_layers=3, decoder_layers=2,
                                       encoder_attention_heads=3, decoder_attention_heads=3,
                                       encoder_ffn_dim=160, decoder_ffn_dim=192,
                                       max_position_embeddings=96, bos_token_id=0, eos_token_id=1,
                                       pad_token_id=2, decoder_start_token_id=1,
                                       forced_bos_token_id=None, forced_eos_token_id=None,
                                       scale_embedding=True, init_std=0.12)
    raise ValueError(family)


def build(family: str, folder: Path):
    """Saves the family's fresh checkpoint (bf16 decoders, f32 encoders; sharded) and tokenizer."""
    torch.manual_seed(SEED)
    cfg = config(family)
    cfg._attn_implementation = "eager"
    cls = {"bert": AutoModel, "bart": AutoModelForSeq2SeqLM}.get(family, AutoModelForCausalLM)
    model = cls.from_config(cfg)
    # Norm weights and biases away from 1 and 0, as trained ones are.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    if family not in ("bert", "bart"):
        model = model.to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TESTS / family / f, folder / f)
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").exists(), shards
    return cls, len(shards)


BACKEND = "cpu"


def pagedattn(binary: str, folder: Path, prompt: str) -> dict:
    out = subprocess.run(
        [binary, "run", "--backend", BACKEND, "--model", str(folder), "--prompt", prompt,
         "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--json"]
        + (["--model-on", "host"] if BACKEND != "cpu" else []),
        capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"pagedattn run --model {folder}: {out.stderr.strip()}")
    return json.loads(out.stdout)["requests"][0]


@torch.no_grad()
def transformers_greedy(model, tok, prompt: str, encoder_decoder: bool):
    ids = tok(prompt, return_tensors="pt").input_ids
    kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                  num_beams=1, eos_token_id=None, return_dict_in_generate=True, output_logits=True,
                  attention_mask=torch.ones_like(ids))
    if encoder_decoder:
        kwargs["decoder_start_token_id"] = model.config.decoder_start_token_id
    out = model.generate(ids, **kwargs)
    seq = out.sequences[0].tolist()
    new = seq[1:] if encoder_decoder else seq[ids.shape[1]:]
    margins = [float(torch.topk(s[0].float(), 2).values.diff().abs()) for s in out.logits]
    return new[-NEW_TOKENS:], margins


def check_family(family: str, binary: str, root: Path) -> list:
    folder = root / family
    cls, shards = build(family, folder)
    model = cls.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(folder)
    problems = []
    if family == "bert":
        for prompt in PROMPTS:
            want = model(**tok(prompt, return_tensors="pt")).pooler_output[0].tolist()
            got = pagedattn(binary, folder, prompt)["pooled"]
            scale = max(abs(w) for w in want)
            worst = max(abs(g - w) for g, w in zip(got, want))
            ok = len(got) == len(want) and worst <= 1e-5 * scale
            print(f"{family} ({shards} shards): pooled output off by {worst:.1e} of {scale:.1e}"
                  f" {'ok' if ok else 'FAIL'}")
            if not ok:
                problems.append(f"{family}: {prompt!r}")
        return problems
    for prompt in PROMPTS:
        want, margins = transformers_greedy(model, tok, prompt, family == "bart")
        got = pagedattn(binary, folder, prompt)["generated"][0]
        sure = next((i for i, m in enumerate(margins) if m < 1e-3), len(want))
        ok = sure >= 8 and got[:sure] == want[:sure]
        print(f"{family} ({shards} shards, {'bf16' if family != 'bart' else 'f32'}): "
              f"{sure} of {len(want)} greedy tokens compared {'ok' if ok else 'FAIL'}")
        if not ok:
            problems.append(f"{family}: {prompt!r}: {got[:sure]} against {want[:sure]}")
    return problems


def check_smollm2(binary: str, gguf: Path, root: Path) -> list:
    folder = root / "smollm2"
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers marks a model loaded from a GGUF as quantized and will not save it: the
    # same (dequantized) weights in a plain model of its config save as any checkpoint.
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    problems = []
    for prompt in ["The capital of France is", "def fibonacci(n):", "Once upon a time"]:
        from_folder = pagedattn(binary, folder, prompt)["generated"][0]
        from_gguf = pagedattn(binary, gguf, prompt)["generated"][0]
        ok = from_folder == from_gguf
        print(f"smollm2: folder and GGUF greedy tokens {'equal' if ok else 'DIFFER'} for {prompt!r}")
        if not ok:
            problems.append(f"smollm2: {prompt!r}: {from_folder} against {from_gguf}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", default=str(ROOT / "target" / "release" / "pagedattn"))
    parser.add_argument("--keep", help="build the folders here and keep them")
    parser.add_argument("--smollm2", help="SmolLM2's GGUF: check it as a Hugging Face folder too")
    parser.add_argument("--only", help="comma-separated families")
    parser.add_argument("--backend", default="cpu", help="pagedattn's attention backend (cpu, cuda)")
    args = parser.parse_args()
    global BACKEND
    BACKEND = args.backend
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="pagedattn-hf-"))
    root.mkdir(parents=True, exist_ok=True)
    families = args.only.split(",") if args.only else ["llama", "qwen2", "mistral", "gemma2", "bloom", "opt", "bert", "bart"]
    problems = []
    try:
        for family in families:
            problems += check_family(family, args.bin, root)
        if args.smollm2:
            problems += check_smollm2(args.bin, Path(args.smollm2).resolve(), root)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    for p in problems:
        print("problem:", p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
