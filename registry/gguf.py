"""GGUF files as model sources, converted once into a Hugging Face checkpoint folder.

A `.gguf` file, or a folder holding exactly one (and no config.json), is read with the
`gguf` package (pure Python + NumPy, memory-mapped). Its metadata becomes config.json and
generation_config.json; its tensors are dequantized and renamed to the Hugging Face names,
undoing the Q/K row permutation that llama.cpp's converter applies to Llama models and
splitting mixture-of-experts layers' merged experts into one tensor per expert (Mixtral,
Qwen2-MoE, Qwen3-MoE; registry/gguf_tensors.py); the tokenizer and chat template are built by transformers from
the `tokenizer.ggml.*` metadata. The folder lives in the servax cache under `gguf/<stem>-<sha256 prefix>/` and
is written atomically, so every later start reads plain safetensors through the normal
paths (native JAX or torchax) and never parses the GGUF again.

Quantized tensors become float32 (dequantization is exact in float32: each weight is a
float16 scale times a small integer, plus an offset); F16 and BF16 tensors keep their
dtype. Q8_0 tensors are also written as stored, int8 values and a float16 scale per block of
32, under `q8_0/` (registry.weights.open_q8_0), which `quantization="gguf"` serves as int8;
Q4_0, Q4_1 and Q4_K as stored under `q4/`, Q5_0, Q5_1 and Q5_K as stored under `q5/` (5-bit
values, a scale and an offset per 32 inputs), and Q6_K as stored under `q6/` (6-bit values less
32 as int8, a scale per 16 inputs).

    python -m registry.gguf model.Q4_K_M.gguf            # convert now, print the folder
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from registry.errors import ModelLoadError
from registry.gguf_tensors import (
    ARCHITECTURES, FIVE_BIT_TYPES, FOUR_BIT_TYPES, SIX_BIT_TYPES, GGUFArchitecture, architecture, check_tensor_types,
    K_QUANT_SUPERS, five_bit_parts, four_bit_parts, hf_names, hf_shape_dtype, hf_tensor, q8_0_parts, six_bit_parts,
    super_scale_parts, write_safetensors,
)

GGUF_SUFFIX = ".gguf"
MARKER = "servax_gguf.json"  # written last: a folder without it is incomplete
# the folder's layout; a folder of another format is converted again (2: q8_0/ added, 3: q4/, 4: Q5/Q6
# tensors requantized into q8_0/, 5: Q5 tensors as stored in q5/, only Q6_K requantized, 6: Q6_K as stored in q6/,
# 7: K-quants' super-scales beside their scales)
FORMAT = 7
_MAGIC = b"GGUF"


def find_gguf_file(path: Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the only .gguf in a folder without config.json.

    Returns None when `path` is not a GGUF source (a checkpoint folder, or another file).

    Raises:
        ModelLoadError: a folder without config.json holding several .gguf files.
    """
    if path.is_file():
        return path if path.suffix == GGUF_SUFFIX else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    files = sorted(path.glob("*" + GGUF_SUFFIX))
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise ModelLoadError(f"{path}: holds several GGUF files ({names}); pass the path of the one to serve")
    return files[0] if files else None


def gguf_checkpoint_path(gguf_file: Path) -> Path:
    """Convert `gguf_file` into the servax cache on first use; return the checkpoint folder.

    The folder is named after the file and the first 16 hex digits of its sha256, so an
    edited file is converted again and identical files share one conversion.

    Raises:
        ModelLoadError: see `convert_gguf`.
    """
    from registry.tiny import cache_root

    gguf_file = Path(gguf_file).resolve()
    with open(gguf_file, "rb") as fh:  # every start hashes the file: the key must follow its content
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    out = cache_root() / "gguf" / f"{gguf_file.stem}-{digest[:16]}"
    return build_once(out, lambda tmp: convert_gguf(gguf_file, tmp, source={"file": str(gguf_file), "sha256": digest}))


def build_once(out: Path, build: Callable[[Path], Any]) -> Path:
    """Run `build(tmp_folder)` unless `out` is complete already, then move the result to `out`.

    The work happens in a private folder that is renamed at the end, so concurrent
    processes never see half a checkpoint; `build` writes MARKER last.
    """
    if is_current_conversion(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        build(tmp)
        if not is_current_conversion(out):
            shutil.rmtree(out, ignore_errors=True)
            try:
                tmp.replace(out)
            except OSError:  # another process won the race; its copy is the same
                pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def is_current_conversion(folder: Path) -> bool:
    """Whether `folder` is a finished conversion in this servax's format (MARKER written, FORMAT)."""
    try:
        return json.loads((folder / MARKER).read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


def convert_gguf(gguf_file: Path, out_dir: Path, *, source: dict | None = None) -> Path:
    """Write a Hugging Face checkpoint folder for `gguf_file` into `out_dir`.

    Writes config.json, generation_config.json, model.safetensors, the Q8_0 tensors as stored
    (q8_0/model.safetensors), the Q4_0 / Q4_1 / Q4_K tensors as stored (q4/model.safetensors:
    4-bit values one a byte, a scale and an offset per 32 inputs), the Q5_0 / Q5_1 / Q5_K ones
    likewise (q5/), the Q6_K ones (q6/: int8 values, a scale per 16 inputs; each K-quant with its
    float16 super-scales per 256 inputs, `.super_scale` and `.super_offset`), the tokenizer files
    (with the chat template) and, last, MARKER
    (a JSON note of the format, the source and the tensor types found).

    Raises:
        ModelLoadError: not a GGUF file, truncated, an architecture or tensor type that
            cannot be converted, or tokenizer metadata missing or unusable.
    """
    gguf_file = Path(gguf_file)
    reader = read_gguf(gguf_file)
    meta = _Metadata(reader, gguf_file)
    arch_name = meta.get("general.architecture")
    arch = architecture(arch_name, int(meta.get(f"{arch_name}.expert_count", 0)))
    if arch is None:
        raise ModelLoadError(
            f"{gguf_file.name}: GGUF architecture {arch_name!r} is not supported; supported: "
            f"{', '.join(ARCHITECTURES)} (llama with expert_count: Mixtral)"
        )
    tensors = {t.name: t for t in reader.tensors}
    check_tensor_types(gguf_file, reader.tensors)
    _check_tokenizer_metadata(gguf_file, meta)
    config = _hf_config(meta, arch_name, arch, tensors)
    names = hf_names(gguf_file, arch_name, arch, tensors, config)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    (out_dir / "generation_config.json").write_text(json.dumps(_special_ids(meta), indent=2) + "\n")
    write_safetensors(out_dir / "model.safetensors", [
        (hf_name, *hf_shape_dtype(tensor), functools.partial(hf_tensor, tensor, config, arch))
        for hf_name, tensor in names.items()
    ])
    q8_0 = [(hf_name, tensor) for hf_name, tensor in names.items()
            if tensor.tensor_type.name == "Q8_0" and len(tensor.shape) >= 2]
    if q8_0:
        from registry.weights import Q8_0_FOLDER

        (out_dir / Q8_0_FOLDER).mkdir()
        entries = []
        for hf_name, tensor in q8_0:
            shape, _ = hf_shape_dtype(tensor)
            part = functools.lru_cache(1)(functools.partial(q8_0_parts, tensor, config, arch))
            entries.append((hf_name, shape, "I8", lambda part=part: part()[0]))
            entries.append((hf_name + ".scale", (*shape[:-1], shape[-1] // 32), "F16", lambda part=part: part()[1]))
        write_safetensors(out_dir / Q8_0_FOLDER / "model.safetensors", entries)
    from registry.weights import FIVE_BIT_FOLDER, FOUR_BIT_FOLDER, SIX_BIT_FOLDER

    four_bit = _write_as_stored(out_dir / FOUR_BIT_FOLDER, names, FOUR_BIT_TYPES, four_bit_parts, config, arch)
    five_bit = _write_as_stored(out_dir / FIVE_BIT_FOLDER, names, FIVE_BIT_TYPES, five_bit_parts, config, arch)
    six_bit = _write_as_stored(out_dir / SIX_BIT_FOLDER, names, SIX_BIT_TYPES, six_bit_parts, config, arch, group=16)
    _save_tokenizer(gguf_file, out_dir)
    types = sorted({t.tensor_type.name for t in reader.tensors})
    (out_dir / MARKER).write_text(json.dumps(
        {"format": FORMAT, "source": source or {"file": str(gguf_file)}, "architecture": arch_name,
         "tensor_types": types, "q8_0_tensors": len(q8_0), "four_bit_tensors": four_bit, "five_bit_tensors": five_bit,
         "six_bit_tensors": six_bit}, indent=2,
    ) + "\n")
    return out_dir


def _write_as_stored(folder: Path, names: dict, kinds: tuple[str, ...], parts: Callable, config,
                     arch: GGUFArchitecture, group: int = 32) -> int:
    """The matrices of `names` stored in one of `kinds` written as stored into folder/model.safetensors:
    values (uint8), a float32 scale and offset per 32 inputs (`parts` decodes them); with `group` 16
    (Q6_K) int8 values and a scale per 16 inputs, no offsets; K-quants' float16 super-scales per 256
    inputs too (their scales' and offsets' codes times them). Returns how many."""
    chosen = [(hf_name, tensor) for hf_name, tensor in names.items()
              if tensor.tensor_type.name in kinds and len(tensor.shape) >= 2]
    if chosen:
        folder.mkdir()
        entries = []
        for hf_name, tensor in chosen:
            shape, _ = hf_shape_dtype(tensor)
            groups = (*shape[:-1], shape[-1] // group)
            part = functools.lru_cache(1)(functools.partial(parts, tensor, config, arch))
            entries += [(hf_name, shape, "U8" if group == 32 else "I8", lambda part=part: part()[0]),
                        (hf_name + ".scale", groups, "F32", lambda part=part: part()[1])]
            if group == 32:
                entries.append((hf_name + ".offset", groups, "F32", lambda part=part: part()[2]))
            if tensor.tensor_type.name in K_QUANT_SUPERS:  # their scales' (offsets') super-scales
                supers = (*shape[:-1], shape[-1] // 256)
                sup = functools.lru_cache(1)(functools.partial(super_scale_parts, tensor, config, arch))
                entries.append((hf_name + ".super_scale", supers, "F16", lambda sup=sup: sup()[0]))
                if group == 32:
                    entries.append((hf_name + ".super_offset", supers, "F16", lambda sup=sup: sup()[1]))
        write_safetensors(folder / "model.safetensors", entries)
    return len(chosen)


def read_gguf(gguf_file: Path):
    """Open a GGUF file (memory-mapped): its metadata and a view of every tensor.

    Raises:
        ModelLoadError: wrong magic, or a header or tensor data that the file does not hold.
    """
    import gguf

    size = gguf_file.stat().st_size
    with open(gguf_file, "rb") as fh:
        head = fh.read(4)
    if head != _MAGIC:
        raise ModelLoadError(f"{gguf_file}: not a GGUF file (it starts with {head!r}, a GGUF file with {_MAGIC!r})")
    try:
        # Every tensor becomes a view of the memory map here, so a short file fails now, not later.
        return gguf.GGUFReader(gguf_file)
    except Exception as e:  # noqa: BLE001 - ValueError, IndexError, ... from deep inside the reader
        raise ModelLoadError(
            f"{gguf_file}: truncated or corrupt GGUF file ({size} bytes; reading it failed with "
            f"{type(e).__name__}: {e})"
        ) from None


class _Metadata:
    """The GGUF key/value metadata with errors that name the file and the key."""

    def __init__(self, reader, gguf_file: Path):
        self.fields, self.file = reader.fields, gguf_file

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str, default: Any = ...) -> Any:
        if key not in self.fields:
            if default is ...:
                raise ModelLoadError(f"{self.file.name}: GGUF metadata has no {key!r}")
            return default
        return self.fields[key].contents()


def _check_tokenizer_metadata(gguf_file: Path, meta: _Metadata) -> None:
    missing = [k for k in ("tokenizer.ggml.model", "tokenizer.ggml.tokens") if k not in meta]
    if missing:
        raise ModelLoadError(
            f"{gguf_file.name}: no tokenizer in the GGUF metadata (missing {', '.join(missing)}); "
            "servax builds the tokenizer and chat template from it"
        )


def _one(meta: _Metadata, key: str, default: Any = ...) -> Any:
    """A metadata value that may be stored per layer (a list); all layers must agree."""
    value = meta.get(key, default)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ModelLoadError(f"{meta.file.name}: per-layer {key} values differ ({value}); not supported")
        value = value[0]
    return value


def _hf_config(meta: _Metadata, arch_name: str, arch: GGUFArchitecture, tensors: dict):
    import transformers

    p = arch_name + "."
    if "rope_freqs.weight" in tensors:
        raise ModelLoadError(
            f"{meta.file.name}: has rope_freqs.weight (Llama 3.1-style rope scaling stored as factors), "
            "which cannot be converted yet"
        )
    hidden = int(meta.get(p + "embedding_length"))
    heads = int(_one(meta, p + "attention.head_count"))
    kv_heads = int(_one(meta, p + "attention.head_count_kv", heads))
    head_dim = int(meta.get(p + "attention.key_length", hidden // heads))
    rope_dims = int(meta.get(p + "rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelLoadError(f"{meta.file.name}: partial rotary ({rope_dims} of {head_dim} dims) is not supported")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta.get(p + "rope.freq_base", 10000.0))}
    scaling = meta.get(p + "rope.scaling.type", "none")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=float(meta.get(p + "rope.scaling.factor")))
    elif scaling != "none":
        raise ModelLoadError(f"{meta.file.name}: rope scaling {scaling!r} is not supported (none, linear)")
    vocab = int(tensors["token_embd.weight"].shape[-1]) if "token_embd.weight" in tensors else None
    kwargs = dict(
        architectures=[arch.hf_architecture],
        vocab_size=vocab or len(meta.get("tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=int(_one(meta, p + "feed_forward_length", 0 if arch.moe_prefix else ...)),
        num_hidden_layers=int(meta.get(p + "block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(meta.get(p + "context_length", 2048)),
        rms_norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon")),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in tensors,
        hidden_act="silu",
        dtype=_checkpoint_dtype(tensors.values()),
        **_special_ids(meta),
    )
    if arch.moe_prefix:
        kwargs.update(_moe_config(meta, p, arch, tensors))
    return getattr(transformers, arch.config_class)(**kwargs)


def _moe_config(meta: _Metadata, p: str, arch: GGUFArchitecture, tensors: dict) -> dict[str, Any]:
    """The experts' config keys, from `{arch}.expert_*` metadata (sizes missing there: from the tensors).

    Every layer must be a MoE layer (llama.cpp's leading dense blocks are refused by hf_names:
    their ffn_gate/ffn_up/ffn_down have no counterpart)."""
    num_experts, top_k = int(meta.get(p + "expert_count")), int(meta.get(p + "expert_used_count"))
    gate = tensors.get("blk.0.ffn_gate_exps.weight")
    expert_size = int(meta.get(p + "expert_feed_forward_length", gate.shape[1] if gate is not None else 0))
    if arch.hf_architecture == "MixtralForCausalLM":  # llama.cpp writes the experts' size as feed_forward_length
        return dict(num_local_experts=num_experts, num_experts_per_tok=top_k,
                    intermediate_size=int(gate.shape[1]) if gate is not None else expert_size)
    config = dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=expert_size,
                  norm_topk_prob=bool(meta.get(p + "expert_weights_norm", arch.norm_topk_prob)),
                  decoder_sparse_step=1, mlp_only_layers=[])
    shared = tensors.get("blk.0.ffn_gate_shexp.weight")
    if shared is not None:
        config["shared_expert_intermediate_size"] = int(
            meta.get(p + "expert_shared_feed_forward_length", shared.shape[1]))
    return config


def _checkpoint_dtype(tensors) -> str:
    """float16 / bfloat16 when every matrix is stored so, else float32 (what quantized types become)."""
    kinds = {t.tensor_type.name for t in tensors if len(t.shape) > 1}
    return {frozenset({"F16"}): "float16", frozenset({"BF16"}): "bfloat16"}.get(frozenset(kinds), "float32")


def _special_ids(meta: _Metadata) -> dict[str, Any]:
    """bos/eos/pad token ids for config.json and generation_config.json (eos may be a list)."""
    ids: dict[str, Any] = {}
    for key, name in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        if f"tokenizer.ggml.{key}_token_id" in meta:
            ids[name] = int(meta.get(f"tokenizer.ggml.{key}_token_id"))
    # Chat models often end a turn with an end-of-turn token that is not the EOS.
    eos = [ids["eos_token_id"]] if "eos_token_id" in ids else []
    for key in ("eot", "eom"):
        extra = meta.get(f"tokenizer.ggml.{key}_token_id", None)
        if extra is not None and int(extra) not in eos:
            eos.append(int(extra))
    if eos:
        ids["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return ids


def _save_tokenizer(gguf_file: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds on metadata it cannot use
        raise ModelLoadError(
            f"{gguf_file.name}: cannot build the tokenizer from the GGUF metadata ({type(e).__name__}: {e})"
        ) from None
    tokenizer.save_pretrained(out_dir)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf_file", type=Path)
    args = parser.parse_args(argv)
    print(gguf_checkpoint_path(args.gguf_file))


if __name__ == "__main__":
    sys.exit(main())
