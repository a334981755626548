"""Import torchax 0.0.13 on torch 2.13.

torch 2.13 removed the named-tensor overloads of many aten ops (`aten.prod.dim_Dimname`,
`aten.index_copy.dimname`, `aten.norm.names_ScalarOpt_dim`, `aten.std.correction_names`,
...). torchax 0.0.13 names them at import time, as keys of its autocast policy table and
in lists handed to `torch._decomp.get_decompositions` (loaded when the first
`torchax.default_env()` is built), so `import torchax` raises AttributeError. (torchax main has since dropped them.)

`import_torchax()` imports torchax while a lookup of a *missing named-tensor overload* on
an `OpOverloadPacket` returns a unique inert `MissingOverload` sentinel instead of raising.
Such sentinels are harmless where torchax puts them: no real op ever equals one, and
`get_decompositions` ignores non-operators. Any other missing overload still raises, and
the original `__getattr__` is restored as soon as the import is done. Sentinel keys left in
torchax's autocast table are then removed, so nothing of the shim survives in torchax's
state.
"""

from __future__ import annotations

import re
import threading
from types import ModuleType

# Overload names of named-tensor variants: "dim_Dimname", "dimname", "Dimname_Scalar",
# "names_dim", "correction_names", "names_ScalarOpt_dim_dtype", "dimname_out", ...
_NAMED_TENSOR_OVERLOAD = re.compile(r"(?i)dimname|(?:^|_)names(?:$|_)")

_lock = threading.Lock()
_torchax: ModuleType | None = None


class MissingOverload:
    """Stands in for an aten overload that this torch build no longer has."""

    __slots__ = ("packet", "name")

    def __init__(self, packet: str, name: str):
        self.packet = packet
        self.name = name

    def __repr__(self) -> str:
        return f"MissingOverload({self.packet}.{self.name})"


def is_named_tensor_overload(name: str) -> bool:
    """True for the overload names of named-tensor (Dimname) variants of aten ops."""
    return bool(_NAMED_TENSOR_OVERLOAD.search(name))


def import_torchax() -> ModuleType:
    """Import torchax (once) tolerating torch 2.13's removed named-tensor overloads.

    Returns:
        the torchax module, with its default environment (and so its op tables) built.
        Calling again returns the same module.

    Raises:
        ImportError / AttributeError: torchax fails for another reason than the
            named-tensor overloads (those are never hidden).
    """
    global _torchax
    with _lock:
        if _torchax is not None:
            return _torchax
        import sys

        if "torchax" in sys.modules and hasattr(sys.modules["torchax"], "extract_jax"):
            _torchax = sys.modules["torchax"]  # imported already, e.g. on a fixed torch
            return _torchax

        from torch._ops import OpOverloadPacket

        original = OpOverloadPacket.__getattr__
        sentinels: list[MissingOverload] = []

        def tolerant_getattr(self, key: str):
            try:
                return original(self, key)
            except AttributeError:
                if not is_named_tensor_overload(key):
                    raise
                sentinel = MissingOverload(str(self), key)
                sentinels.append(sentinel)
                return sentinel

        OpOverloadPacket.__getattr__ = tolerant_getattr
        try:
            import torchax

            # The op tables (decompositions, jaten) load lazily with the first
            # Environment; build it now, inside the tolerant window.
            torchax.default_env()
        finally:
            OpOverloadPacket.__getattr__ = original
        _drop_sentinel_keys(sentinels)
        _torchax = torchax
        return torchax


def _drop_sentinel_keys(sentinels: list[MissingOverload]) -> None:
    """Remove the sentinels torchax stored as keys of its autocast policy table."""
    if not sentinels:
        return
    import torchax.amp as amp

    for value in vars(amp).values():
        if isinstance(value, dict):
            for key in [k for k in value if isinstance(k, MissingOverload)]:
                del value[key]
