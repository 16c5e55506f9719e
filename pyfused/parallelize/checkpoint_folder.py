"""A checkpoint folder that is either complete or absent: the commit protocol of ``checkpoint.save``.

``save("ckpt/step_100", ...)`` never writes into ``ckpt/step_100`` itself. Every rank writes its
shards into the staging folder ``ckpt/step_100.partial`` (emptied first by the coordinator, group rank
0); once DCP's save has returned -- on the coordinator that means every rank's write returned and
the metadata is written -- the coordinator writes the ``COMPLETE`` marker into the staging folder
(a temporary file, fsync'ed, renamed), moves an existing ``ckpt/step_100`` aside to
``ckpt/step_100.old``, renames the staging folder to ``ckpt/step_100``, and deletes the old one. So:

* a save interrupted before the commit (a rank killed or frozen, a full disk) leaves the previous
  ``ckpt/step_100`` untouched: its files are never overwritten in place;
* a folder without the marker (a save from before this protocol, a plain ``dcp.save``, a copy cut
  short) is refused by ``load`` unless the caller opts out;
* a crash between the two renames (microseconds) leaves no ``ckpt/step_100``, the complete new
  checkpoint in ``.partial`` and the previous one in ``.old``; ``load`` then refuses and names both.

The renames are atomic on one POSIX filesystem (the staging folder is a sibling of the target). The
marker holds a JSON record (world size, time) for people; only its presence counts.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Optional

COMPLETE = "COMPLETE"
STAGING = ".partial"
REPLACED = ".old"


def staging_folder(final: Path) -> Path:
    return final.with_name(final.name + STAGING)


def replaced_folder(final: Path) -> Path:
    return final.with_name(final.name + REPLACED)


def is_complete(folder) -> bool:
    """Whether ``folder`` holds a checkpoint whose save finished on every rank."""
    return (Path(folder) / COMPLETE).is_file()


def incomplete_reason(folder) -> Optional[str]:
    """Why ``folder`` is not a complete checkpoint, or None if it is one."""
    folder = Path(folder)
    if is_complete(folder):
        return None
    staged, old = staging_folder(folder), replaced_folder(folder)
    if not folder.exists():
        if is_complete(staged):
            return (f"{folder} does not exist, but {staged} holds a complete checkpoint and {old} "
                    f"the one it replaces: the save stopped between its two renames; rename "
                    f"{staged.name} to {folder.name} to use the new one")
        return f"{folder} does not exist"
    return (f"{folder} has no {COMPLETE} marker: its save did not finish on every rank, or it was "
            f"not written by pyfused.parallelize.checkpoint.save; pass allow_incomplete=True to "
            f"load it anyway")


def prepare(final: Path) -> None:
    """On the coordinator, before the ranks write: an empty staging folder (the leftovers of an
    interrupted save of the same checkpoint removed)."""
    staged = staging_folder(final)
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir(parents=True)


def commit(final: Path, world_size: int) -> None:
    """On the coordinator, after every rank's write returned: mark the staging folder complete and
    move it to ``final`` (replacing a previous checkpoint there)."""
    staged, old = staging_folder(final), replaced_folder(final)
    record = json.dumps({"world_size": world_size, "time": time.time()})
    _write_durably(staged / COMPLETE, record)
    _fsync_dir(staged)
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.rename(final, old)
    os.rename(staged, final)
    _fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)


def _write_durably(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
