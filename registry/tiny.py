"""Deterministic tiny checkpoints: real Hugging Face folders made locally, no network.

`make_tiny_checkpoint("llama", out_dir)` writes config.json, model.safetensors and a
tokenizer (byte-level BPE trained on a built-in corpus, with a ChatML chat template)
for a small random model of that architecture. The same seed gives the same bytes, so
tests and the default app can rely on it. Model IDs of the form `servax-tiny/<name>`
are materialised on first use under the servax cache (see `tiny_checkpoint_path`).

    python -m registry.tiny llama ./tiny-llama      # or: --list
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

TINY_PREFIX = "servax-tiny/"
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Enough text for a byte-level BPE with a few hundred merges; English words, code and
# punctuation so that tokenization of everyday prompts is not byte-by-byte.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Serving large language models means batching many requests, caching keys and values in pages of memory,
and sampling the next token quickly. The engine schedules prefills and decodes in every step.
Hello world! How are you today? I am fine, thank you. What is the capital of France? Paris is.
def generate(prompt, max_tokens=16):
    return model.generate(prompt, max_tokens=max_tokens)
for i in range(10): print(i, i * i)
Once upon a time there was a little model that wanted to talk. It learned words, numbers 0 1 2 3 4 5 6 7 8 9,
and the names of the days: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday.
The weather is nice and the sun is shining. Please write a short poem about the sea and the stars.
User: tell me a story. Assistant: Once there was a river that ran to the ocean, singing all the way.
"""

# Small configs per architecture: 2 layers, hidden 64, GQA where the family supports it.
# initializer_range is large on purpose: random logits must have clear winners so greedy
# decoding is not decided by float rounding when two implementations are compared.
_COMMON = dict(vocab_size=VOCAB_SIZE, initializer_range=0.2, tie_word_embeddings=False)
_LLAMA_LIKE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, **_COMMON,
)
_DEEPSEEK = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=1024,
    rms_norm_eps=1e-6, **_COMMON,
)
_DEEPSEEK_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256,
                      beta_fast=32.0, beta_slow=1.0)
_GEMMA4 = dict(
    _LLAMA_LIKE, num_hidden_layers=6, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
    attention_k_eq_v=True, tie_word_embeddings=True, sliding_window=8,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                 "sliding_attention", "full_attention"],
    vocab_size_per_layer_input=VOCAB_SIZE, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
    use_double_wide_mlp=True, final_logit_softcapping=10.0, architectures=["Gemma4ForCausalLM"],
    rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                     "full_attention": dict(rope_type="proportional", partial_rotary_factor=0.25,
                                            rope_theta=1000000.0)},
)
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (transformers config class, kwargs)
    "llama": ("LlamaConfig", dict(_LLAMA_LIKE, rope_theta=10000.0)),
    "llama3": ("LlamaConfig", dict(
        _LLAMA_LIKE, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=256),
    )),
    # 8 query and 8 KV heads: splits over 8 devices (configs/multiprocess-cpu.yaml)
    "llama-8-heads": ("LlamaConfig", dict(_LLAMA_LIKE, num_attention_heads=8, num_key_value_heads=8,
                                           rope_theta=10000.0)),
    "mistral": ("MistralConfig", dict(_LLAMA_LIKE, sliding_window=24, head_dim=16)),
    "qwen2": ("Qwen2Config", dict(_LLAMA_LIKE, use_sliding_window=False)),
    "qwen3": ("Qwen3Config", dict(_LLAMA_LIKE, head_dim=32)),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=1024, **_COMMON)),
    "gpt_neox": ("GPTNeoXConfig", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=1024, rotary_pct=0.5, **_COMMON,
    )),
    "opt": ("OPTConfig", dict(
        hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=1024, word_embed_proj_dim=64, **_COMMON,
    )),
    "phi": ("PhiConfig", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=1024, partial_rotary_factor=0.5, **_COMMON,
    )),
    "phi3": ("Phi3Config", dict(_LLAMA_LIKE, pad_token_id=3)),
    "gemma": ("GemmaConfig", dict(_LLAMA_LIKE, head_dim=16)),
    "stablelm": ("StableLmConfig", dict(_LLAMA_LIKE, partial_rotary_factor=0.5)),
    "mixtral": ("MixtralConfig", dict(_LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        _LLAMA_LIKE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=128, decoder_sparse_step=1, use_sliding_window=False,
    )),
    "gpt_oss": ("GptOssConfig", dict(
        _LLAMA_LIKE, head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, original_max_position_embeddings=256,
                             beta_fast=32.0, beta_slow=1.0, truncate=False),
    )),
    # Gemma 2: soft-capped attention and final logits, 8-token windows on layers 0 and 2, a
    # query_pre_attn_scalar other than head_dim, the LM head tied to the embedding.
    "gemma2": ("Gemma2Config", dict(
        _LLAMA_LIKE, num_hidden_layers=3, head_dim=16, tie_word_embeddings=True, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=5.0,
    )),
    # Gemma 3: QK-norm, sliding layers with their own rope base, global ones with linear scaling.
    "gemma3": ("Gemma3TextConfig", dict(
        _LLAMA_LIKE, num_hidden_layers=4, head_dim=16, tie_word_embeddings=True, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=24,
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1000000.0)},
    )),
    # Gemma 4 (text), shaped as the released checkpoints are (models_jax/gemma4.py): global layers
    # with a larger head (32, sliding 16) and one KV head whose values are its keys (attention_k_eq_v,
    # the sliding layers 2), proportional rope on a quarter of the global head, per-layer input
    # embeddings, the last two layers (one of each type) reading earlier layers' K/V with a
    # double-wide MLP, final logits soft-capped. Norm scales and layer scalars are drawn away from 1
    # (_spread_scales) so that a norm read as 1 + weight, or a scalar left out, shows.
    "gemma4": ("Gemma4TextConfig", dict(_GEMMA4)),
    # ... and with the MoE block beside every layer's MLP (the 26B-A4B's shape, which has no
    # per-layer inputs and no KV sharing).
    "gemma4_moe": ("Gemma4TextConfig", dict(
        _GEMMA4, num_hidden_layers=4, layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                   "full_attention"],
        hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
    )),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        _LLAMA_LIKE, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, decoder_sparse_step=1,
    )),
    # DeepSeek-V2 (V2-Lite's plain q projection) and V3 (q_lora_rank): latent attention, YaRN with
    # DeepSeek's mscale, one dense layer then MoE layers with shared experts and group-limited routing.
    "deepseek_v2": ("DeepseekV2Config", dict(
        _DEEPSEEK, q_lora_rank=None, n_shared_experts=2, topk_method="group_limited_greedy",
        routed_scaling_factor=1.5, rope_parameters=dict(_DEEPSEEK_YARN, mscale=0.707, mscale_all_dim=0.707),
    )),
    "deepseek_v3": ("DeepseekV3Config", dict(
        _DEEPSEEK, q_lora_rank=48, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters=dict(_DEEPSEEK_YARN, mscale=0.9, mscale_all_dim=1.0),
    )),
}


def cache_root() -> Path:
    """Where servax keeps generated checkpoints ($SERVAX_CACHE or ~/.cache/servax)."""
    return Path(os.environ.get("SERVAX_CACHE", Path.home() / ".cache" / "servax"))


def make_tokenizer():
    """A byte-level BPE PreTrainedTokenizerFast with ChatML special tokens, trained in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|endoftext|>", pad_token="<pad>",
        unk_token=None, additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_checkpoint(
    name: str, out_dir: str | os.PathLike, *, seed: int = 0, dtype: str = "float32",
    **config_overrides: Any,
) -> Path:
    """Write a tiny random Hugging Face checkpoint of architecture `name` to `out_dir`.

    Raises:
        KeyError: `name` is not one of TINY_CONFIGS.
    """
    import torch
    import transformers

    if name not in TINY_CONFIGS:
        raise KeyError(f"no tiny config named {name!r}; known: {sorted(TINY_CONFIGS)}")
    class_name, kwargs = TINY_CONFIGS[name]
    tokenizer = make_tokenizer()
    if len(tokenizer) > VOCAB_SIZE:
        raise AssertionError(f"tokenizer has {len(tokenizer)} tokens, more than {VOCAB_SIZE}")
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    kwargs = dict(kwargs, bos_token_id=eos, eos_token_id=eos)
    kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    kwargs.update(config_overrides)
    config = getattr(transformers, class_name)(**kwargs)

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if class_name == "Gemma4TextConfig":
        _spread_scales(model)
    model = model.to(getattr(torch, dtype)).eval()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "servax_tiny.json").write_text(json.dumps({"name": name, "seed": seed, "dtype": dtype}))
    return out


def _spread_scales(model: Any) -> None:
    """Gemma 4's norm weights, router scales and layer scalars, which transformers initialises
    to ones, drawn from [0.5, 1.5) instead (seeded): a reading of any of them as 1 changes the
    logits."""
    import torch

    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("norm.weight", "layer_scalar", "router.scale", "per_expert_scale")):
                tensor.copy_(torch.rand_like(tensor) + 0.5)


def tiny_checkpoint_path(model_id: str) -> Path:
    """Materialise `servax-tiny/<name>` under the cache on first use and return its folder."""
    name = model_id[len(TINY_PREFIX):]
    out = cache_root() / "tiny" / name
    if (out / "servax_tiny.json").exists():
        return out
    # Written to a private folder and renamed, so concurrent processes never see half a
    # checkpoint; the marker file is written last, so a folder without it is stale.
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    make_tiny_checkpoint(name, tmp)
    if not (out / "servax_tiny.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        try:
            tmp.replace(out)
        except OSError:  # another process won the race; its copy is identical
            pass
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", help="architecture, one of --list")
    parser.add_argument("out_dir", nargs="?")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--list", action="store_true", help="print the known names")
    args = parser.parse_args(argv)
    if args.list or not args.name:
        print("\n".join(sorted(TINY_CONFIGS)))
        return
    if not args.out_dir:
        parser.error("out_dir is required")
    print(make_tiny_checkpoint(args.name, args.out_dir, seed=args.seed, dtype=args.dtype))


if __name__ == "__main__":
    sys.exit(main())
