#!/usr/bin/env python3
"""Tiny random-weight Hugging Face checkpoints and their goldens, made by transformers itself.

Groundwork for issue 44 (model families verified against transformers). For each family
(llama, qwen2, mistral, gemma2, bloom, opt, bert, bart) this script:
  - trains a tiny deterministic tokenizer on the English text below (byte-level BPE for the
    generative families, BERT WordPiece for bert) and saves it with transformers'
    PreTrainedTokenizerFast.save_pretrained (tokenizer.json + tokenizer_config.json);
  - builds a tiny f32 model from a config shaped like the real family (eager attention,
    torch.manual_seed(SEED) right before from_config) and saves it with save_pretrained
    (one model.safetensors);
  - writes tests/hf-models/<family>/golden.json: library versions, seed, config summary,
    prompts (text and ids), and
      causal families: 32 greedy tokens per prompt with each step's top-2 logit margin, and
        the full logits of every position of the longest prompt with each row's std;
      bert: last hidden states of every token and pooler_output, per prompt;
      bart: 32 greedy tokens per encoder prompt (decoder start token first) with margins, and
        the decoder logits of every position for one teacher-forced (encoder, decoder) pair;
  - reloads the saved folder with AutoModel*/AutoTokenizer.from_pretrained (what a user has)
    and checks that it reproduces the goldens exactly.

The Rust tests (no torch in CI) compare against these files; tolerances are in
tests/hf-models/README.md.

Usage, from the repository root (CPU only, one thread, well under a minute):
    python3 -m venv .venv
    .venv/bin/pip install -r tools/golden-requirements.txt
    HF_HUB_OFFLINE=1 .venv/bin/python tools/hf-goldens.py [--out tests/hf-models] [--only llama,bert]
The output is deterministic: running it twice gives byte-identical files.
"""

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

# One thread and deterministic kernels so reruns are byte-identical (the summation order of a
# multi-threaded matmul can change the last bit of a logit).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerFast,
)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "hf-models"
NEW_TOKENS = 32
VOCAB = 512

# Training text for the tokenizers and source of the prompts. Fixed and in the script so the
# vocabularies never depend on anything outside it.
CORPUS = """\
The small village sat at the edge of a wide green valley, where the river turned slowly \
toward the sea. Every morning the baker opened his shop before the sun rose, and the smell \
of fresh bread drifted along the narrow streets. Children ran to school with their books \
under their arms, and the old men gathered in the square to talk about the weather.

In the spring the farmers planted wheat and barley in the fields beyond the bridge. They \
worked from dawn until dusk, and in the evening they sat together on wooden benches, \
sharing stories about the years when the rain did not come. The river was their friend and \
their fear: it gave water to the crops, but twice in living memory it had flooded the lower \
houses and carried away the mill.

A computer is a machine that follows instructions. A program tells it what to do, one \
step at a time: read a number, add another number, store the result, and repeat. Modern \
processors can perform billions of these simple steps every second, which is why they can \
draw pictures, translate languages, and answer questions in the blink of an eye.

Language models read text as a sequence of tokens. Each token is a small piece of a word, \
a whole word, or a mark of punctuation. The model looks at the tokens it has seen so far \
and predicts which token should come next. By repeating this prediction many times, it can \
write sentences, paragraphs, and even whole stories that sound natural to a human reader.

Attention lets every token look back at the tokens before it and decide which of them \
matter most. A sliding window limits how far back a token may look, which saves memory on \
long inputs. Rotary position embeddings rotate the queries and keys by an angle that grows \
with the position, so the model can tell near tokens from far ones.
"""

# Prompt sentences: 7, 27 and 38 ids with the byte-level BPE and its BOS (the two longer ones
# cross the sliding window of 16); chat families get a fourth, a ChatML turn (29 ids).
PROMPTS = [
    "The river turned.",
    "The children ran to school with their books, and the men talked.",
    "Every morning the baker opened his shop before the sun rose, and the children ran to school.",
]
CHAT_PROMPT = "<|im_start|>user\nWhat does a computer do?<|im_end|>\n<|im_start|>assistant\n"

# The decoder side of BART's teacher-forced pair (the encoder side is PROMPTS[1]).
BART_DECODER_TEXT = "The children ran to the river and the old men talked."

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

BPE_SPECIALS = ["<s>", "</s>", "<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
BOS, EOS, PAD, UNK = 0, 1, 2, 3
WP_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

# Seeds fixed per family so a change to one family never moves another's weights.
SEEDS = {"llama": 4401, "qwen2": 4402, "mistral": 4403, "gemma2": 4404, "bloom": 4405, "bert": 4406, "bart": 4407,
         "opt": 4408}

# Random init with transformers' default initializer_range (0.02) gives logits so flat that
# nearly every greedy step is a near tie and Gemma-2's soft caps never bite. A wider init keeps
# the shapes real while making the numbers discriminating.
INIT_RANGE = 0.15
# Standard deviation of the noise added to norm weights and biases (see build_model).
PERTURB_1D = 0.2


# ---------------------------------------------------------------------------------------------
# Tokenizers


def train_bpe(post: str) -> Tokenizer:
    """Byte-level BPE like GPT-2/Llama-3, specials at ids 0-5; `post` is the BOS/EOS template."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # tokenizers' BPE trainer breaks count ties by pair ids, which come from the fixed byte
    # alphabet below: its output was checked identical across runs (unlike its WordPiece one).
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=BPE_SPECIALS,
        # All 256 byte symbols up front so any text is encodable (no <unk> ever needed).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.split("\n\n"), trainer=trainer)
    specials = [(t, tok.token_to_id(t)) for t in ("<s>", "</s>")]
    if post == "bos":
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=specials
        )
    else:  # BART's encoder input is <s> ... </s>
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=specials
        )
    assert [tok.token_to_id(t) for t in BPE_SPECIALS] == list(range(len(BPE_SPECIALS)))
    return tok


def wordpiece_vocab(words: dict) -> dict:
    """WordPiece vocabulary by pair-count merges, as tokenizers' WordPieceTrainer builds it.

    Written out here because that trainer breaks ties between equal counts in hash order, so
    its vocabulary changes from run to run; here ties go to the lexicographically first pair.
    """
    splits = {w: [w[0]] + ["##" + c for c in w[1:]] for w in words}
    vocab = list(WP_SPECIALS) + sorted({sym for parts in splits.values() for sym in parts})
    while len(vocab) < VOCAB:
        pairs = {}
        for w, parts in splits.items():
            for a, b in zip(parts, parts[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + words[w]
        if not pairs:
            break
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        merged = a + b[2:]  # b always continues a word, so it carries the "##" prefix
        for w, parts in splits.items():
            out, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            splits[w] = out
        if merged not in vocab:
            vocab.append(merged)
    return {t: i for i, t in enumerate(vocab)}


def train_wordpiece() -> Tokenizer:
    """BERT's uncased WordPiece: lowercase normalizer, BertPreTokenizer, [CLS] $A [SEP]."""
    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre = pre_tokenizers.BertPreTokenizer()
    words = {}
    for w, _ in pre.pre_tokenize_str(normalizer.normalize_str(CORPUS)):
        words[w] = words.get(w, 0) + 1
    tok = Tokenizer(models.WordPiece(wordpiece_vocab(words), unk_token="[UNK]"))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.WordPiece()
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    assert [tok.token_to_id(t) for t in WP_SPECIALS] == list(range(len(WP_SPECIALS)))
    return tok


def wrap_bpe(tok: Tokenizer, chat: bool) -> PreTrainedTokenizerFast:
    extra = {"chat_template": CHATML_TEMPLATE} if chat else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        **extra,
    )


def wrap_wordpiece(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        do_lower_case=True,
    )


# ---------------------------------------------------------------------------------------------
# Configs


def causal_common() -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        # Heads of 32, the smallest the CUDA backend serves (vLLM's sizes), so that the same
        # goldens check the GPU; 4 query heads over 2 key/value heads (GQA), wider than the
        # hidden size as Gemma's are.
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        initializer_range=INIT_RANGE,
    )


def make_config(family: str):
    if family == "llama":
        return transformers.LlamaConfig(**causal_common())
    if family == "qwen2":
        # Qwen2's q/k/v biases are unconditional in its attention; use_sliding_window stays
        # False as in the released Qwen2 checkpoints, so every layer is full attention.
        return transformers.Qwen2Config(**causal_common(), use_sliding_window=False)
    if family == "mistral":
        return transformers.MistralConfig(**causal_common(), sliding_window=16)
    if family == "gemma2":
        cfg = causal_common()
        cfg.update(
            num_hidden_layers=4,
            tie_word_embeddings=True,  # as every released Gemma-2
            sliding_window=16,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=2.0,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
        )
        return transformers.Gemma2Config(**cfg)
    if family == "bloom":
        # 3 heads (not a power of two, so the extra ALiBi slopes are exercised) of 32 (the
        # smallest head the CUDA backend serves): hidden 96.
        return transformers.BloomConfig(
            vocab_size=VOCAB,
            hidden_size=96,
            n_layer=2,
            n_head=3,
            layer_norm_epsilon=1e-5,
            bos_token_id=BOS,
            eos_token_id=EOS,
            pad_token_id=PAD,
            initializer_range=INIT_RANGE,
        )
    if family == "opt":
        # As every OPT but opt-350m: LayerNorms before the sublayers, the token table as wide
        # as the hidden state (no project_in/out), ReLU, the head tied. 2 heads of 32.
        return transformers.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            ffn_dim=128,
            # (Learned positions, 2 rows more for OPT's offset: kept to what the prompts use.)
            max_position_embeddings=128,
            activation_function="relu",
            do_layer_norm_before=True,
            word_embed_proj_dim=64,
            tie_word_embeddings=True,
            bos_token_id=BOS,
            eos_token_id=EOS,
            pad_token_id=PAD,
            init_std=INIT_RANGE,
        )
    if family == "bert":
        return transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            # (Learned positions: every row is stored, so the table is kept to what the
            # prompts use.)
            max_position_embeddings=128,
            type_vocab_size=2,
            pad_token_id=0,
            initializer_range=INIT_RANGE,
        )
    if family == "bart":
        return transformers.BartConfig(
            vocab_size=VOCAB,
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            max_position_embeddings=128,
            bos_token_id=BOS,
            eos_token_id=EOS,
            pad_token_id=PAD,
            # BART starts the decoder with EOS (released BART: decoder_start_token_id = eos = 2).
            decoder_start_token_id=EOS,
            forced_bos_token_id=None,
            forced_eos_token_id=None,
            no_repeat_ngram_size=0,
            init_std=INIT_RANGE,
        )
    raise ValueError(family)


def config_summary(cfg) -> dict:
    keys = [
        "model_type", "architectures", "vocab_size", "hidden_size", "d_model", "num_hidden_layers",
        "n_layer", "encoder_layers", "decoder_layers", "num_attention_heads", "n_head",
        "encoder_attention_heads", "decoder_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "max_position_embeddings",
        "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "rope_parameters", "rope_theta",
        "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
        "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
        "hidden_act", "hidden_activation", "activation_function", "tie_word_embeddings",
        "do_layer_norm_before", "word_embed_proj_dim", "enable_bias",
        "scale_embedding", "type_vocab_size", "bos_token_id", "eos_token_id", "pad_token_id",
        "decoder_start_token_id", "initializer_range", "init_std",
    ]
    d = cfg.to_dict()
    return {k: d[k] for k in keys if k in d}


# ---------------------------------------------------------------------------------------------
# Numbers


def f32(x) -> float:
    """Shortest decimal that reads back to the same float32 (exact, and small in JSON)."""
    return float(str(np.float32(x)))


def rows(t: torch.Tensor) -> list:
    return [[f32(v) for v in r] for r in t.detach().float().numpy()]


def row_std(t: torch.Tensor) -> list:
    # Population std in float64 of each float32 row: the scale for the Rust tolerance.
    return [f32(np.asarray(r, dtype=np.float64).std()) for r in t.detach().float().numpy()]


def margins(step_logits) -> list:
    out = []
    for s in step_logits:
        top = torch.topk(s[0].float(), 2).values
        out.append(f32(top[0] - top[1]))
    return out


# ---------------------------------------------------------------------------------------------
# Generation and forwards


def greedy_config(model) -> GenerationConfig:
    # Explicit and complete, so nothing from the model's defaults (EOS stop, forced tokens,
    # n-gram bans) changes the greedy ids: exactly NEW_TOKENS argmax steps, EOS not special.
    gc = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        eos_token_id=None,
        pad_token_id=model.config.pad_token_id,
        bos_token_id=model.config.bos_token_id,
        forced_bos_token_id=None,
        forced_eos_token_id=None,
        no_repeat_ngram_size=0,
        min_length=0,
        length_penalty=1.0,
        repetition_penalty=1.0,
    )
    if model.config.is_encoder_decoder:
        gc.decoder_start_token_id = model.config.decoder_start_token_id
    return gc


@torch.no_grad()
def run_greedy(model, ids: list) -> dict:
    inp = torch.tensor([ids])
    out = model.generate(
        inp,
        attention_mask=torch.ones_like(inp),
        generation_config=greedy_config(model),
        return_dict_in_generate=True,
        output_logits=True,
    )
    seq = out.sequences[0].tolist()
    new = seq[1:] if model.config.is_encoder_decoder else seq[len(ids):]
    new = new[-NEW_TOKENS:]
    assert len(new) == NEW_TOKENS and len(out.logits) == NEW_TOKENS
    # No logits processor is active, so each step's raw logits decide the token.
    assert [int(s[0].argmax()) for s in out.logits] == new
    return {"tokens": new, "margins": margins(out.logits)}


@torch.no_grad()
def causal_logits(model, ids: list) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]


def check_cached_vs_full(model, ids: list, g: dict, tag: str):
    """Greedy with the KV cache must agree with a teacher-forced full forward (except near ties)."""
    full = causal_logits(model, ids + g["tokens"])[len(ids) - 1 : -1]
    for i, (t, m) in enumerate(zip(g["tokens"], g["margins"])):
        if int(full[i].argmax()) != t and m > 1e-3:
            raise SystemExit(f"{tag}: cached greedy disagrees with full forward at step {i}")


# ---------------------------------------------------------------------------------------------
# Gemma-2 soft-cap probe


def gemma2_cap_stats(model, ids: list) -> dict:
    """Fraction of pre-cap attention scores above cap/2 (|s| > cap/2: tanh visibly bends)."""
    from transformers.models.gemma2 import modeling_gemma2 as mg

    cap = model.config.attn_logit_softcapping
    seen = []
    orig = mg.eager_attention_forward

    def probe(module, query, key, value, attention_mask, **kw):
        k = mg.repeat_kv(key, module.num_key_value_groups)
        s = torch.matmul(query, k.transpose(2, 3)) * kw.get("scaling", module.scaling)
        n = s.shape[-1]
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
        seen.append(s[..., causal].abs().flatten())
        return orig(module, query, key, value, attention_mask, **kw)

    mg.eager_attention_forward = probe
    try:
        with torch.no_grad():
            logits = causal_logits(model, ids)
    finally:
        mg.eager_attention_forward = orig
    if not seen:
        raise SystemExit("gemma2: the attention probe saw no scores (transformers moved the function)")
    s = torch.cat(seen)
    fcap = model.config.final_logit_softcapping
    return {
        "attn_scores_frac_above_half_cap": f32((s > cap / 2).float().mean()),
        "attn_scores_max_abs": f32(s.max()),
        "final_logits_frac_above_half_cap": f32((logits.abs() > fcap / 2).float().mean()),
        "final_logits_max_abs": f32(logits.abs().max()),
    }


# ---------------------------------------------------------------------------------------------
# Families


def build_model(family: str, loader):
    cfg = make_config(family)
    torch.manual_seed(SEEDS[family])
    model = loader.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    # from_config leaves every 1-D parameter constant (norm weights 1, or 0 for Gemma's 1+w
    # norms; biases 0): an implementation that skipped a norm's scale or Qwen2's q/k/v biases
    # would still match. Jitter them (same global generator, so still fixed by the seed).
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape) * PERTURB_1D)
    return model.eval()


def save_folder(folder: Path, model, tokenizer):
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    model.save_pretrained(folder, safe_serialization=True)
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json.
    tokenizer.save_pretrained(folder, save_jinja_files=False)


def header(family: str, model) -> dict:
    return {
        "family": family,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "seed": SEEDS[family],
        "config": config_summary(model.config),
    }


def prompt_entries(tok, texts: list) -> list:
    return [{"text": t, "ids": tok(t)["input_ids"]} for t in texts]


def causal_goldens(family: str, model, tok) -> dict:
    g = header(family, model)
    texts = PROMPTS + ([CHAT_PROMPT] if tok.chat_template else [])
    g["prompts"] = prompt_entries(tok, texts)
    g["greedy"] = []
    for p in g["prompts"]:
        r = run_greedy(model, p["ids"])
        check_cached_vs_full(model, p["ids"], r, family)
        g["greedy"].append({"prompt": p["text"], "tokens": r["tokens"], "text": tok.decode(r["tokens"]), "margins": r["margins"]})
    longest = max(g["prompts"], key=lambda p: len(p["ids"]))
    lg = causal_logits(model, longest["ids"])
    g["logits"] = {"prompt": longest["text"], "ids": longest["ids"], "row_std": row_std(lg), "rows": rows(lg)}
    if family == "gemma2":
        g["softcap_check"] = gemma2_cap_stats(model, longest["ids"])
    if family == "bloom":
        from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

        g["alibi_slopes"] = [f32(x) for x in _get_alibi_slopes(model.config.n_head, torch.device("cpu"))]
    return g


@torch.no_grad()
def bert_goldens(model, tok) -> dict:
    g = header("bert", model)
    g["prompts"] = prompt_entries(tok, PROMPTS)
    g["hidden_states"], g["pooled"] = [], []
    for p in g["prompts"]:
        ids = torch.tensor([p["ids"]])
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=torch.zeros_like(ids))
        g["hidden_states"].append(rows(out.last_hidden_state[0]))
        g["pooled"].append([f32(v) for v in out.pooler_output[0]])
    return g


@torch.no_grad()
def bart_goldens(model, tok) -> dict:
    g = header("bart", model)
    g["prompts"] = prompt_entries(tok, PROMPTS)
    g["greedy"] = []
    for p in g["prompts"]:
        r = run_greedy(model, p["ids"])
        g["greedy"].append({
            "prompt": p["text"],
            "decoder_start_token_id": model.config.decoder_start_token_id,
            "tokens": r["tokens"],
            "text": tok.decode(r["tokens"]),
            "margins": r["margins"],
        })
    enc = g["prompts"][1]["ids"]
    # Teacher-forced decoder input: the start token, then the sentence without <s>/</s>.
    dec = [model.config.decoder_start_token_id] + tok(BART_DECODER_TEXT, add_special_tokens=False)["input_ids"]
    lg = model(
        input_ids=torch.tensor([enc]),
        attention_mask=torch.ones(1, len(enc), dtype=torch.long),
        decoder_input_ids=torch.tensor([dec]),
    ).logits[0]
    g["teacher_forced"] = {
        "encoder_ids": enc,
        "decoder_text": BART_DECODER_TEXT,
        "decoder_ids": dec,
        "row_std": row_std(lg),
        "rows": rows(lg),
    }
    return g


LOADERS = {
    "llama": AutoModelForCausalLM,
    "qwen2": AutoModelForCausalLM,
    "mistral": AutoModelForCausalLM,
    "gemma2": AutoModelForCausalLM,
    "bloom": AutoModelForCausalLM,
    "opt": AutoModelForCausalLM,
    "bert": AutoModel,
    "bart": AutoModelForSeq2SeqLM,
}
CHAT_FAMILIES = {"llama", "qwen2", "mistral", "gemma2"}


def make_tokenizer(family: str):
    if family == "bert":
        return wrap_wordpiece(train_wordpiece())
    return wrap_bpe(train_bpe("bos_eos" if family == "bart" else "bos"), chat=family in CHAT_FAMILIES)


def goldens_for(family: str, model, tok) -> dict:
    if family == "bert":
        return bert_goldens(model, tok)
    if family == "bart":
        return bart_goldens(model, tok)
    return causal_goldens(family, model, tok)


# ---------------------------------------------------------------------------------------------
# Output


def dump(obj) -> str:
    """Indented JSON with every list of numbers on one line (readable, and a quarter the size)."""
    s = json.dumps(obj, indent=1, ensure_ascii=False)
    num_list = re.compile(r"\[\s*(-?[0-9][0-9.eE+-]*(?:,\s*-?[0-9][0-9.eE+-]*)*)\s*\]")
    return num_list.sub(lambda m: "[" + ",".join(x.strip() for x in m.group(1).split(",")) + "]", s) + "\n"


def verify_reload(family: str, folder: Path, golden: dict, built):
    """The saved folder alone (what a user downloads) must reproduce the goldens exactly."""
    tok = AutoTokenizer.from_pretrained(folder)
    model = LOADERS[family].from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    mine, theirs = built.state_dict(), model.state_dict()
    if mine.keys() != theirs.keys() or not all(torch.equal(mine[k], theirs[k]) for k in mine):
        raise SystemExit(f"{family}: the saved weights differ from the built ones")
    # Tensors mmapped from safetensors sit at 8-byte offsets; MKL's single-row (decode-step)
    # kernels round differently on unaligned memory (last-bit changes, ~1e-6 of a logit). Copy
    # the weights into fresh, aligned storage so the check below can demand bit-equality.
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    again = goldens_for(family, model, tok)
    if family == "gemma2":  # the probe is a diagnostic, not a golden of the folder
        again["softcap_check"] = golden["softcap_check"]
    again["config"] = golden["config"]  # from_pretrained adds bookkeeping keys; weights matter
    if dump(again) != dump(golden):
        diff = [k for k in golden if golden[k] != again.get(k)]
        raise SystemExit(f"{family}: reloaded folder does not reproduce the goldens (keys {diff})")


def build_family(family: str, out: Path) -> dict:
    tok = make_tokenizer(family)
    model = build_model(family, LOADERS[family])
    folder = out / family
    save_folder(folder, model, tok)
    golden = goldens_for(family, model, tok)
    (folder / "golden.json").write_text(dump(golden), encoding="utf-8")
    verify_reload(family, folder, golden, model)
    return golden


def report(family: str, golden: dict, folder: Path):
    size = sum(f.stat().st_size for f in folder.iterdir())
    lens = [len(p["ids"]) for p in golden["prompts"]]
    line = f"{family:8s} {size / 1e6:6.3f} MB  prompt lengths {lens}"
    if "greedy" in golden:
        mins = [min(g["margins"]) for g in golden["greedy"]]
        line += f"  min top-2 margin per prompt {[round(m, 4) for m in mins]}"
    if "softcap_check" in golden:
        line += f"\n         softcap check {golden['softcap_check']}"
    if "alibi_slopes" in golden:
        line += f"\n         alibi slopes {golden['alibi_slopes']}"
    print(line)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--only", default="", help="comma-separated families (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    families = [f for f in SEEDS if not args.only or f in args.only.split(",")]
    print(f"transformers {transformers.__version__}, torch {torch.__version__}", file=sys.stderr)
    for family in families:
        golden = build_family(family, args.out)
        report(family, golden, args.out / family)
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"total {args.out}: {total / 1e6:.3f} MB")


if __name__ == "__main__":
    main()
