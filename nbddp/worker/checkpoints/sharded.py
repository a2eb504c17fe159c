"""Sharded checkpoints: one ``torch.distributed.checkpoint`` directory per step, each rank writing its shards.

``checkpoint_dir/step-00000120/`` holds DCP's ``.metadata``, one ``__<rank>_0.distcp``
file per rank, and ``loop.pt``: the loop's own state (step, epoch, position in
the epoch, every rank's RNG, scheduler and scaler), a plain ``torch.save``
file. Written into ``step-00000120.tmp`` and renamed by rank 0 once every
rank has written, so a crash never leaves a half checkpoint under the final
name; the newest ``checkpoint.KEEP`` are kept (file checkpoints of DDP fits
in the same folder count too).

Resume restores model and optimizer shards with DCP's own state-dict
helpers; it needs the same world size as the save, as a mid-epoch resume
does anyway. ``export`` turns a directory into one plain file that
``torch.load`` reads without nbddp or a process group.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import Future
from typing import Any, Callable

import torch
import torch.distributed as dist

from nbddp.worker.checkpoints import background, files as ckpt, trust

LOOP_FILE = ckpt.SHARDED_LOOP_FILE
METADATA = ckpt.SHARDED_METADATA


def _options(flat: bool) -> Any:
    """``flat``: the optimizer's state and hyper-parameters keyed by parameter name, not by position.

    Needed when ranks hold different parameters (pipeline stages): by position,
    every rank's first param group is ``param_groups.0`` and DCP keeps one
    rank's copy, whose parameter names the others do not have.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True) if flat else None


def save(directory: str, step: int, model: Any, optimizer: Any, extra: dict[str, Any], rank: int,
         flat: bool = False) -> None:
    """Collective: every rank writes its shards; rank 0 the loop state, then renames the directory."""
    import torch.distributed.checkpoint as checkpoint
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = ckpt.dir_for(directory, step)
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save that died half way
        os.makedirs(tmp)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer, options=_options(flat))
    checkpoint.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
    if rank == 0:
        torch.save(extra, os.path.join(tmp, LOOP_FILE))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        ckpt.prune(directory)
    dist.barrier()


def save_async(directory: str, step: int, model: Any, optimizer: Any, extra: dict[str, Any], rank: int, writer: Any,
               flat: bool = False) -> Callable[[], None]:
    """Collective: every rank's shards copied to host buffers now, written by ``dcp.async_save``'s thread.

    Returns what is left for the snapshot writer's thread (``background.Writer``): wait for DCP's write
    (every rank's files, then rank 0's ``.metadata``), then rank 0 writes the loop state and renames the
    directory, as ``save`` does. DCP's own collectives run on ``writer.side_group``, not on training's group.
    """
    import torch.distributed.checkpoint as checkpoint
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = ckpt.dir_for(directory, step)
    tmp = final + ".tmp"
    if rank == 0:
        fresh_folder(directory, step)
    dist.barrier()
    model_state, optim_state = get_state_dict(model, optimizer, options=_options(flat))
    loop_state = writer.stage(extra)
    staged = writer.stage({"model": model_state, "optim": optim_state})
    saving = checkpoint.async_save(staged, checkpoint_id=tmp, process_group=writer.side_group(None),
                                   async_stager=background.Staged())
    # the upload's Future (Staged.stage returns the state dict itself; a stager that returns a Future gets an
    # AsyncSaveResponse of two futures instead)
    upload = saving if isinstance(saving, Future) else saving.upload_completion

    def finish() -> None:
        upload.result()
        if rank == 0:
            torch.save(loop_state, os.path.join(tmp, LOOP_FILE))
            publish(tmp, final)

    return finish


def fresh_folder(directory: str, step: int) -> str:
    """An empty owner-only temporary folder for ``step``'s snapshot on this host (a save that died half way
    left one); its path. DCP would make it with its thread's umask."""
    tmp = ckpt.dir_for(directory, step) + ".tmp"
    os.makedirs(directory, mode=0o700, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp, mode=0o700)
    return tmp


def publish(tmp: str, final: str) -> None:
    """A host's snapshot folder under its final name, its files owner-only whatever the umask of DCP's thread:
    rank 0's host's here, every other host's in ``shard_copies``."""
    for name in os.listdir(tmp):
        os.chmod(os.path.join(tmp, name), 0o600)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)


def load(path: str, model: Any, optimizer: Any, flat: bool = False) -> dict[str, Any]:
    """Collective: restore this rank's model and optimizer shards; return the loop state."""
    import torch.distributed.checkpoint as checkpoint
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if os.path.isfile(path):
        raise ValueError(f"resume={path!r} is a checkpoint of a DDP fit (one file); resume it with strategy='ddp'")
    if not ckpt.is_sharded(path):
        raise ValueError(f"resume={path!r} is not a sharded nbddp checkpoint (no {METADATA} and {LOOP_FILE} in it); pass "
                         "a step-* directory that dist_fit(strategy='fsdp', checkpoint_dir=...) wrote, or that directory")
    model_state, optim_state = get_state_dict(model, optimizer, options=_options(flat))  # shapes for DCP to load into
    reader, planner = trust.reader(path), trust.planner(path)
    with trust.refusals_raised(planner):  # in place, into these two
        checkpoint.load({"model": model_state, "optim": optim_state}, checkpoint_id=path, storage_reader=reader,
                        planner=planner)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=_options(flat))
    return trust.load_file(os.path.join(path, LOOP_FILE))


def reads(path: str, model: Any, optimizer: Any, flat: bool = False) -> set[str]:
    """The files ``load`` of ``path`` reads on this rank: ``.metadata``, ``loop.pt``, and those DCP's own load plan
    takes this rank's pieces from (its shard's file, and the one each entry DCP saved once, deduplicated, is in).

    Needs only ``.metadata`` in ``path``: an elastic relaunch across hosts copies the rest in (``shard_fetch.py``).
    """
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=_options(flat))
    metadata = trust.reader(path).read_metadata()
    planner = DefaultLoadPlanner()  # load's own planner: the same plan, made the same way
    planner.set_up_planner({"model": model_state, "optim": optim_state}, metadata, False)
    plan = planner.create_local_plan()
    return {metadata.storage_data[item.storage_index].relative_path for item in plan.items} | {METADATA, LOOP_FILE}


def export(path: str, out: str, trust_checkpoint: bool = False) -> str:
    """Write a sharded checkpoint as one plain ``torch.save`` file: ``{"model": full state dict, "optimizer": ..., step...}``.

    Runs in one process, with no process group. The model's state dict has the
    module's own keys (``model.load_state_dict(torch.load(out)["model"])``
    works on a plain module); the optimizer state is keyed by parameter name.
    ``path`` is read as ``trust.py`` reads any folder given to nbddp, unless ``trust_checkpoint``.
    """
    with trust.trusting(trust_checkpoint, option="nbddp.export_checkpoint(path, out, trust_checkpoint=True)"):
        if not ckpt.is_sharded(path):
            raise ValueError(f"export_checkpoint({path!r}): not a sharded nbddp checkpoint directory (it needs "
                             f"{METADATA} and {LOOP_FILE}); pass a step-* directory under the fit's checkpoint_dir")
        state = whole_state(path)
        loop = trust.load_file(os.path.join(path, LOOP_FILE))
    tmp = out + ".tmp"
    plain = {"model": state["model"], "optimizer": state["optim"],
             **{k: loop[k] for k in ("step", "epoch", "batches_done", "world_size", "batch_size") if k in loop}}
    torch.save(plain, tmp)
    os.replace(tmp, out)
    return out


def whole_state(path: str) -> dict[str, Any]:
    """Every tensor and value of the DCP folder ``path`` in this process, no process group (what torch's
    ``dcp_to_torch_save`` reads, through ``trust.py``'s reader and planner)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    reader, planner = trust.reader(path), trust.planner(path, empty=True)
    with trust.refusals_raised(planner):
        _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
    return state
