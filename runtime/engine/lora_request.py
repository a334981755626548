"""What names a LoRA adapter in a request, without the runtime's JAX imports: the ingress
process (which never runs a model) imports these, and so does `serve run`'s app builder."""

from __future__ import annotations

import dataclasses
import zlib


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """One adapter, as vLLM names it: `LoRARequest("sql", 1, "/path/to/sql-lora")`.

    Attributes:
        lora_name: the adapter's name (what HTTP requests put in `model`).
        lora_int_id: a positive integer unique to this adapter in the engine.
        lora_path: a local folder in PEFT format (adapter_config.json + adapter_model.safetensors),
            or a hub id (downloaded when the hub is reachable).
        base_model_name: the base it was trained on (informational).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")


def stable_lora_id(name: str, path: str) -> int:
    """A positive lora_int_id derived from an adapter's name and path, the same in every
    process (the ingress and each replica agree without talking), different when a name is
    loaded again from another path."""
    return zlib.crc32(f"{name}\0{path}".encode()) % (2**31 - 2) + 1
