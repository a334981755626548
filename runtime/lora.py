"""LoRA adapters: many fine-tunes of one base model, batched in one step.

An engine with `enable_lora` holds `max_loras + 1` adapter *slots* in the step's params
(slot 0: no adapter, all zeros). For every projection a model declares as a LoRA target
(`LoadedModel.lora_targets`, PEFT's module names: q_proj, k_proj, ...), each layer carries

    a: [slots, in_features, max_lora_rank]      b: [slots, max_lora_rank, out_features]

with the adapter's scaling (lora_alpha / r, or / sqrt(r) with rsLoRA) folded into b, and each
token of a step carries its request's slot (`StepInput.lora_slots`). The model adds

    delta = ((x @ a[s]) masked to the token's slot s) @ b      (one pair of dense matmuls)

so a step mixes requests of different adapters and of the base model, and loading an adapter
is a write into a slot: same shapes, nothing recompiles.

`LoRAManager` keeps adapters read from disk in a host-side LRU (`max_cpu_loras`) and decides
which are resident in the slots: a waiting request is admitted only once its adapter has a
slot (loading it, evicting the least recently used adapter no running request uses), so a
step never needs more than `max_loras` adapters.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from runtime.lora_request import LoRARequest, stable_lora_id  # noqa: F401 - re-exported
from runtime.mesh import logical_to_spec

if TYPE_CHECKING:
    from runtime.request import Request
    from runtime.step import LoadedModel

logger = logging.getLogger("servax.engine")


class LoRAError(ValueError):
    """An adapter that cannot be served (its rank, its modules, its shapes, its files)."""


@dataclasses.dataclass(frozen=True)
class LoRATarget:
    """A projection a model lets LoRA adapt: y = x @ W, x [T, in_features], y [T, out_features].

    in_axis / out_axis: logical axes (runtime.mesh) of the base weight's input and output, so
    the slots shard as the weight does. head_dim / head_repeat: the output is heads of
    head_dim, each stored head_repeat times (the KV heads a model repeats for the mesh).
    """

    in_features: int
    out_features: int
    in_axis: str | None = None
    out_axis: str | None = None
    head_dim: int = 0
    head_repeat: int = 1

    @property
    def stored_out_features(self) -> int:
        return self.out_features * self.head_repeat


@dataclasses.dataclass
class LoRAAdapter:
    """An adapter read from disk, in slot form: per target, a [layers, in, r_max] and a
    [layers, r_max, out] array (zeros where it adapts nothing)."""

    request: LoRARequest
    rank: int
    modules: tuple[str, ...]
    weights: dict[str, tuple[np.ndarray, np.ndarray]]


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


def load_peft_adapter(
    request: LoRARequest, targets: dict[str, LoRATarget], num_layers: int, max_rank: int, dtype: Any,
) -> LoRAAdapter:
    """Read a PEFT LoRA adapter and put it in slot form for a model with `targets`.

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
    return LoRAAdapter(request, rank, tuple(modules), weights)


class LoRAManager:
    """Which adapters are on the host and which sit in the device slots.

    Args:
        load: reads an adapter (a LoRARequest) into slot form (load_peft_adapter bound to the model).
        write_slot: writes an adapter's slot-form weights (or None: zeros) into a device slot.
        max_loras: device slots for adapters (slot 0 is the base model's).
        max_cpu_loras: adapters kept read on the host (at least max_loras).
    """

    def __init__(self, load: Callable[[LoRARequest], LoRAAdapter], write_slot: Callable[[int, LoRAAdapter | None], None],
                 *, max_loras: int, max_cpu_loras: int | None = None):
        self._load = load
        self._write_slot = write_slot
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.registered: dict[int, LoRARequest] = {}  # lora_int_id -> request, every adapter added
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU, most recent last
        self.slots: list[int | None] = [None] * (max_loras + 1)  # slot -> lora_int_id; slot 0 unused
        self.last_used: dict[int, int] = {}  # slot -> step counter
        self._clock = 0
        self.num_loads = 0  # adapter writes into a device slot
        self.requests_per_adapter: dict[str, int] = {}
        # add/remove come from request threads (validation), acquire from the engine loop.
        self._lock = threading.RLock()

    # -- host side -----------------------------------------------------------------------
    def add(self, request: LoRARequest) -> LoRAAdapter:
        """Register an adapter and read it (validating it) into the host cache."""
        with self._lock:
            known = self.registered.get(request.lora_int_id)
            if known is not None and known.lora_name != request.lora_name:
                raise LoRAError(f"lora_int_id {request.lora_int_id} is already {known.lora_name!r}")
            for other in self.registered.values():
                if other.lora_name == request.lora_name and other.lora_int_id != request.lora_int_id:
                    raise LoRAError(f"an adapter named {request.lora_name!r} is already loaded (id {other.lora_int_id})")
            adapter = self._host(request)
            self.registered[request.lora_int_id] = request
            return adapter

    def _host(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self.cpu.get(request.lora_int_id)
        if adapter is None:
            adapter = self._load(request)
            logger.info("LoRA adapter %r (id %d, rank %d, %s) read from %s", request.lora_name, request.lora_int_id,
                        adapter.rank, ",".join(adapter.modules), request.lora_path)
            self.cpu[request.lora_int_id] = adapter
            while len(self.cpu) > self.max_cpu_loras:
                evicted, _ = self.cpu.popitem(last=False)
                logger.info("LoRA adapter id %d dropped from the host cache (max_cpu_loras=%d)", evicted,
                            self.max_cpu_loras)
        self.cpu.move_to_end(request.lora_int_id)
        return adapter

    def remove(self, lora_int_id: int, in_use: set[int]) -> LoRARequest:
        """Forget an adapter (its slot is cleared). Raises LoRAError if unknown or in use."""
        with self._lock:
            request = self.registered.get(lora_int_id)
            if request is None:
                raise LoRAError(f"no LoRA adapter with id {lora_int_id} is loaded")
            if lora_int_id in in_use:
                raise LoRAError(f"LoRA adapter {request.lora_name!r} is serving requests; retry when they finish")
            del self.registered[lora_int_id]
            self.cpu.pop(lora_int_id, None)
            for slot, held in enumerate(self.slots):
                if held == lora_int_id:
                    self._write_slot(slot, None)
                    self.slots[slot] = None
            return request

        # -- device slots --------------------------------------------------------------------
    def slot_of(self, lora_int_id: int) -> int | None:
        try:
            return self.slots.index(lora_int_id, 1)
        except ValueError:
            return None

    def acquire(self, request: "Request", in_use: set[int]) -> bool:
        """Make the request's adapter resident (0 for none). False when every slot holds an
        adapter that running requests (`in_use`, lora ids) still need."""
        with self._lock:
            lora = request.lora_request
            if lora is None:
                request.lora_slot = 0
                return True
            self._clock += 1
            slot = self.slot_of(lora.lora_int_id)
            if slot is None:
                free = [s for s in range(1, len(self.slots)) if self.slots[s] not in in_use]
                if not free:
                    return False
                slot = min(free, key=lambda s: (self.slots[s] is not None, self.last_used.get(s, -1)))
                if lora.lora_int_id not in self.registered:
                    self.add(lora)
                adapter = self._host(lora)
                self._write_slot(slot, adapter)
                self.slots[slot] = lora.lora_int_id
                self.num_loads += 1
            self.last_used[slot] = self._clock
            request.lora_slot = slot
            return True

    def count_request(self, lora: LoRARequest | None) -> None:
        if lora is not None:
            self.requests_per_adapter[lora.lora_name] = self.requests_per_adapter.get(lora.lora_name, 0) + 1


def add_lora_slots(model: "LoadedModel", *, max_loras: int, max_rank: int, mesh: Mesh) -> None:
    """Give a model's layers their (zero) adapter slot tables, before a runner takes its params.

    params[layers]["lora"][module] = {"a": [layers, slots, in, r], "b": [layers, slots, r, out]}
    (slots = max_loras + 1), sharded on the logical axes of the base weight's input / output,
    and param_shardings to match.

    Raises:
        LoRAError: the model offers no LoRA targets (the torchax path).
    """
    if not model.lora_targets:
        raise LoRAError(
            f"LoRA adapters run on the native JAX models (Llama, Mistral, Qwen2, Qwen3); {model.model_id} runs "
            f"on the {model.impl} path, which cannot apply adapter slots"
        )
    key = model.stages.layers_key if model.stages is not None else "layers"
    if isinstance(model.params[key], list) or "lora" in model.params[key]:
        raise LoRAError(
            f"{model.model_id}: this loaded model already serves an engine (its adapter slots or layers belong "
            "to it); a second engine with enable_lora needs its own registry.load"
        )
    num_layers = model.kv_spec.num_layers
    slots, tables, specs = max_loras + 1, {}, {}
    for name, t in model.lora_targets.items():
        shapes = {"a": (num_layers, slots, t.in_features, max_rank),
                  "b": (num_layers, slots, max_rank, t.stored_out_features)}
        axes = {"a": ("layers", None, t.in_axis, None), "b": ("layers", None, None, t.out_axis)}
        specs[name] = {ab: logical_to_spec(axes[ab], shapes[ab], mesh) for ab in shapes}
        tables[name] = {
            ab: jax.jit(functools.partial(jnp.zeros, shape, model.kv_spec.dtype),
                        out_shardings=NamedSharding(mesh, specs[name][ab]))()
            for ab, shape in shapes.items()
        }
    model.params = {**model.params, key: {**model.params[key], "lora": tables}}
    model.param_shardings = {**model.param_shardings, key: {**model.param_shardings[key], "lora": specs}}
