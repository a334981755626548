"""Which LoRA adapters are read on the host and which sit in the device slots.

`LoRAManager` keeps adapters read from disk in a host-side LRU (`max_cpu_loras`) and decides
which are resident in the slots (runtime/ops/lora.py): a waiting request is admitted only once
its adapter has a slot (loading it, evicting the least recently used adapter no running request
uses), so a step never needs more than `max_loras` adapters.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Callable

from runtime.engine.lora_request import LoRARequest
from runtime.engine.request import Request
from runtime.ops.lora import LoRAAdapter, LoRAError

logger = logging.getLogger("servax.engine")

__all__ = ["LoRAManager", "LoRAError", "LoRARequest"]


class LoRAManager:
    """Which adapters are on the host and which sit in the device slots.

    Args:
        load: reads an adapter (a LoRARequest) into slot form (LoadedModel.read_lora_adapter).
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

    def acquire(self, request: Request, in_use: set[int]) -> bool:
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
