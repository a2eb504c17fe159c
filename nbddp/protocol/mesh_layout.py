"""The mesh a model-parallel fit trains on: ``dist_fit(mesh=...)`` checked, and where each rank sits in it.

A fit's ranks form a 2-D mesh ``(dp, mp)``: ``mp`` ranks hold one copy of
the model between them (the stages of a pipeline, ``"pp"``, or the shards of
tensor parallelism, ``"tp"``), and ``dp`` such groups train on different data
(DDP or FSDP over ``"dp"``). Rank ``r`` sits at ``(r // mp, r % mp)``: the
ranks of one model-parallel group are neighbours (on one host, the fast
links). Plain arithmetic, read alike by the kernel's checks and the workers'
device mesh (``worker/engine/device_mesh.py``); what runs on the mesh is the
strategy's business (``parallel_settings.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MESH_DIMS = ("dp", "pp", "tp")


def count(where: str, name: str, value: object, minimum: int) -> int:
    """``value`` as a whole number of at least ``minimum``, or an error naming ``where(name=...)``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}({name}=...) must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{where}({name}=...) must be >= {minimum}, got {value}")
    return value


def check_mesh_shape(mesh: dict[str, int] | None) -> dict[str, int] | None:
    """``dist_fit(mesh=...)``: named dimensions and their sizes (the world size is checked later)."""
    if mesh is None:
        return None
    if not isinstance(mesh, dict) or not mesh:
        raise TypeError(f"dist_fit(mesh=...) must be a dict of dimension -> size, e.g. {{'dp': 2, 'pp': 2}}; got {mesh!r}")
    unknown = sorted(set(mesh) - set(MESH_DIMS))
    if unknown:
        raise ValueError(f"dist_fit(mesh=...) has unknown dimension(s) {unknown}; the dimensions are {MESH_DIMS}")
    for dim, size in mesh.items():
        count("dist_fit(mesh=...)", dim, size, 1)
    if mesh.get("pp", 1) > 1 and mesh.get("tp", 1) > 1:
        raise ValueError(f"dist_fit(mesh={mesh}): pipeline and tensor parallelism together (3-D) are not supported; "
                         "use {'dp': ..., 'pp': ...} or {'dp': ..., 'tp': ...}")
    return {dim: mesh[dim] for dim in MESH_DIMS if dim in mesh}


@dataclass(frozen=True)
class Layout:
    """Where a rank sits in a ``(dp, mp)`` mesh; ``kind`` is ``"pp"``, ``"tp"`` or ``""`` (data parallel only)."""

    dp: int
    mp: int = 1
    kind: str = ""
    names: tuple[str, ...] = field(default=("dp",))

    def coords(self, rank: int) -> tuple[int, int]:
        return rank // self.mp, rank % self.mp

    def mp_ranks(self, dp_rank: int) -> list[int]:
        return list(range(dp_rank * self.mp, (dp_rank + 1) * self.mp))

    def dp_ranks(self, mp_rank: int) -> list[int]:
        return list(range(mp_rank, self.dp * self.mp, self.mp))


def layout(mesh: dict[str, int] | None, world: int) -> Layout:
    """The ``Layout`` of a resolved mesh (``None``: every rank a data-parallel replica)."""
    if not mesh:
        return Layout(dp=world)
    kind = "pp" if "pp" in mesh else "tp" if "tp" in mesh else ""
    return Layout(dp=mesh["dp"], mp=mesh.get(kind, 1), kind=kind, names=("dp", kind) if kind else ("dp",))
