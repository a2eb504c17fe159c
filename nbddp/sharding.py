"""``nbddp.FSDP``: the settings of sharded training, checked in the kernel.

``dist_fit(model, data, strategy="fsdp")`` shards the model with FSDP2
(``torch.distributed.fsdp.fully_shard``) over all workers;
``strategy=nbddp.FSDP(...)`` changes how. The object is plain data: it
travels to the workers with the other options, and ``dist_fit``'s own
signature does not grow with every FSDP setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

STRATEGIES = ("ddp", "fsdp")


def class_name(cls: Any) -> str:
    """How a module class is named across the kernel and the workers (notebook classes travel by value)."""
    if isinstance(cls, str):
        return cls
    return cls.__qualname__


@dataclass(frozen=True)
class FSDP:
    """Sharded training: each rank holds 1/N of every parameter, gradient and optimizer state.

    Args:
        shard_modules: the module classes to shard as units (classes, or
            their names), e.g. ``{Block}`` or ``{"LlamaDecoderLayer"}``. Default:
            each repeated child block (every layer of an ``nn.ModuleList`` or
            ``nn.Sequential`` whose children share one class, like the layers
            of a transformer), then the root.
        reshard_after_forward: free each unit's gathered parameters after its
            forward (less memory, one more all-gather in backward). ``None``:
            torch's default (True for the units, False for the root).
        cpu_offload: keep the sharded parameters, gradients and optimizer
            state in CPU memory, moved to the GPU per unit (CUDA workers only).
        init_on_meta: build a model *factory* on the ``meta`` device and
            materialise only each rank's shards (when every module that holds
            parameters or buffers can ``reset_parameters()``; otherwise the
            factory's model is built whole, then sharded). A given
            ``nn.Module`` is never built again: its shipped weights are sharded
            in place.

    ``precision="bf16-mixed"`` becomes FSDP's mixed-precision policy: bf16
    parameters and compute, float32 gradient reduction.
    """

    shard_modules: Any = None  # normalised to a frozenset of class names
    reshard_after_forward: bool | None = None
    cpu_offload: bool = False
    init_on_meta: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "shard_modules", module_classes(self.shard_modules, "nbddp.FSDP(shard_modules=...)"))
        for setting, allowed in (("reshard_after_forward", (bool, type(None))), ("cpu_offload", (bool,)),
                                 ("init_on_meta", (bool,))):
            value = getattr(self, setting)
            if not isinstance(value, allowed):
                want = "True, False or None" if type(None) in allowed else "True or False"
                raise TypeError(f"nbddp.FSDP({setting}=...) must be {want}, got {type(value).__name__} {value!r}")

    @property
    def name(self) -> str:
        return "fsdp"


def module_classes(value: Any, where: str, alternative: str = "") -> frozenset[str] | None:
    """nn.Module classes or class names -> a frozenset of names (``None`` stays ``None``); ``alternative`` ends errors."""
    import torch.nn as nn

    if value is None:
        return None
    items = [value] if isinstance(value, (str, type)) else value
    try:
        items = list(items)
    except TypeError:
        raise TypeError(f"{where} takes module classes or their names, e.g. {{Block}}{alternative}; got "
                        f"{type(value).__name__} {value!r}") from None
    if not items:
        raise ValueError(f"{where} is empty; leave it None for the repeated blocks{alternative}")
    for item in items:
        if not (isinstance(item, str) or (isinstance(item, type) and issubclass(item, nn.Module))):
            raise TypeError(f"{where} takes nn.Module classes or their names{alternative}; got {item!r}")
    return frozenset(class_name(i) for i in items)


def resolve_strategy(value: Any) -> Any:
    """``"ddp"``, an ``FSDP`` (``"fsdp"`` is ``FSDP()``), or a model-parallel setting (``nbddp.topologies``)."""
    if isinstance(value, FSDP) or getattr(value, "mp_dim", None) in ("pp", "tp"):
        return value
    if value == "fsdp":
        return FSDP()
    if value == "ddp":
        return "ddp"
    raise ValueError(f"dist_fit(strategy=...) must be one of {STRATEGIES} or an nbddp.FSDP(...), nbddp.Pipeline(...) "
                     f"or nbddp.TensorParallel(...), got {value!r}")
