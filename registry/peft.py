"""Reading PEFT LoRA adapters (a local folder or a hub repo) into the slot form servax serves."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from runtime.ops.lora import LoRAAdapter, LoRAError, LoRATarget

_PEFT_KEY = re.compile(r"layers\.(\d+)\.(?:.*\.)?([A-Za-z0-9_]+)\.lora_([AB])(?:\.[A-Za-z0-9_]+)?\.weight$")


def _adapter_dir(path: str) -> Path:
    local = Path(os.path.expanduser(path))
    if local.is_dir():
        return local
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, allow_patterns=["adapter_config.json", "adapter_model.*"]))
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, ...: say what was looked for
        raise LoRAError(f"LoRA adapter {path!r} is neither a local folder nor a reachable hub repo ({e})") from e


def _read_tensors(folder: Path) -> dict[str, np.ndarray]:
    st = folder / "adapter_model.safetensors"
    if st.is_file():
        from safetensors.numpy import load_file

        try:
            return load_file(str(st))
        except Exception:  # noqa: BLE001 - bfloat16 tensors: numpy cannot hold them, torch can
            from safetensors.torch import load_file as load_torch

            return {k: v.float().numpy() for k, v in load_torch(str(st)).items()}
    bin_file = folder / "adapter_model.bin"
    if bin_file.is_file():
        import torch

        return {k: v.float().numpy() for k, v in torch.load(str(bin_file), map_location="cpu", weights_only=True).items()}
    raise LoRAError(f"{folder} has no adapter_model.safetensors (or adapter_model.bin)")


def read_peft_adapter(
    request: Any, max_rank: int, *, targets: dict[str, LoRATarget], num_layers: int, dtype: Any,
) -> LoRAAdapter:
    """Read a PEFT LoRA adapter and put it in slot form for a model with `targets`.

    request: the adapter to read (a runtime.engine.lora_request.LoRARequest: its lora_name,
    and lora_path, a local folder or hub repo, defaulting to the name).

    Raises:
        LoRAError: missing files, a rank above max_rank, modules the model lacks or cannot
            adapt, shapes of another base model, features PEFT adapters may have that servax
            does not serve (biases, DoRA, modules_to_save, fan_in_fan_out).
    """
    folder = _adapter_dir(request.lora_path or request.lora_name)
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise LoRAError(f"{folder} has no adapter_config.json (not a PEFT adapter)")
    config = json.loads(config_file.read_text())
    name = request.lora_name
    if config.get("peft_type", "LORA").upper() != "LORA":
        raise LoRAError(f"adapter {name!r} is a {config.get('peft_type')} adapter; only LORA is supported")
    rank = int(config.get("r", 8))
    if rank > max_rank:
        raise LoRAError(f"adapter {name!r} has rank {rank} > max_lora_rank={max_rank}; raise max_lora_rank")
    for key, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D) weights"),
                     ("modules_to_save", "modules_to_save (fully trained extra modules)")):
        if config.get(key):
            raise LoRAError(f"adapter {name!r} uses {why}, which servax does not serve")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"adapter {name!r} trains biases (bias={config['bias']!r}); only bias='none' is served")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoRAError(f"adapter {name!r} has per-module ranks or alphas (rank_pattern/alpha_pattern)")

    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, tensor in _read_tensors(folder).items():
        m = _PEFT_KEY.search(key)
        if m is None:
            raise LoRAError(f"adapter {name!r}: cannot place tensor {key!r} (not a per-layer lora_A/lora_B weight)")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        pairs.setdefault((layer, module), {})[ab] = np.asarray(tensor, np.float32)
    modules = sorted({module for _, module in pairs})
    unknown = [mod for mod in modules if mod not in targets]
    if unknown:
        raise LoRAError(f"adapter {name!r} adapts {unknown}, which this model cannot adapt; "
                        f"targets: {sorted(targets)}")
    weights = {
        module: (np.zeros((num_layers, t.in_features, max_rank), np.float32),
                 np.zeros((num_layers, max_rank, t.stored_out_features), np.float32))
        for module, t in targets.items()
    }
    for (layer, module), ab in pairs.items():
        if layer >= num_layers:
            raise LoRAError(f"adapter {name!r} adapts layer {layer}; the model has {num_layers} layers")
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: layer {layer} {module} lacks lora_{'B' if 'A' in ab else 'A'}")
        t = targets[module]
        a, b = ab["A"], ab["B"]  # [r, in], [out, r]
        if a.shape != (rank, t.in_features) or b.shape != (t.out_features, rank):
            raise LoRAError(
                f"adapter {name!r}: layer {layer} {module} has lora_A {a.shape} / lora_B {b.shape}, this model "
                f"needs ({rank}, {t.in_features}) / ({t.out_features}, {rank}): an adapter of another base model?")
        b = (b * scaling).T  # [r, out]
        if t.head_repeat > 1:  # each output head stored head_repeat times, as the weight is
            b = np.repeat(b.reshape(rank, -1, t.head_dim), t.head_repeat, axis=1).reshape(rank, -1)
        weights[module][0][layer, :, :rank] = a.T
        weights[module][1][layer, :rank, :] = b
    weights = {m: (a.astype(dtype), b.astype(dtype)) for m, (a, b) in weights.items()}
    return LoRAAdapter(request.lora_name, rank, tuple(modules), weights)


