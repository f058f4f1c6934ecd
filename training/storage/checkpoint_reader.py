"""Reading a checkpoint where it is stored: ``torch.distributed.checkpoint``'s own reader over the
storage's filesystem (local, or S3 through pyarrow as Ray Train stores it), so a rank reads the bytes it
loads and nothing else.

Ray Train's ``Checkpoint.as_directory()`` downloads the whole checkpoint to every node first: every
rank's shards and the optimizer's state, about 12 bytes a parameter for a full fine-tune (91 GB at 7B),
where loading the best step's weights needs the model's share of one rank and a resume that rank's
model and optimizer shards. DCP plans the load from the checkpoint's ``.metadata``: each rank asks
for the byte ranges of the tensors it holds (``FileSystemReader.read_data``, torch 2.13
``torch/distributed/checkpoint/filesystem.py``: the requests grouped by file, each item read at its
``offset`` and ``length``). Here that reader runs over a pyarrow filesystem (:class:`StorageFileSystem`,
DCP's ``FileSystemBase``), and each item is one ranged read (:meth:`CheckpointReader._slice_file`:
an S3 GET with a ``Range``, instead of the zip reader's many small reads of a view), so nothing is
staged on the node's disk either."""

from __future__ import annotations

import io
import os
from contextlib import contextmanager
from typing import Generator

import pyarrow.fs as pafs
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystemBase

from .files import resolve


def storage_of(checkpoint) -> tuple[pafs.FileSystem, str]:
    """A checkpoint's filesystem and path: Ray Train's ``Checkpoint`` (its own filesystem and path), a
    URI (``s3://...``) or a local folder."""
    if hasattr(checkpoint, "filesystem") and hasattr(checkpoint, "path"):
        return checkpoint.filesystem, checkpoint.path
    return resolve(os.fspath(checkpoint))


class StorageFileSystem(FileSystemBase):
    """DCP's filesystem over a pyarrow one, for reading (a checkpoint is written on the node's disk and
    uploaded by Ray Train: training/storage/checkpoint.py)."""

    def __init__(self, filesystem: pafs.FileSystem) -> None:
        self.filesystem = filesystem

    @contextmanager
    def create_stream(self, path, mode: str) -> Generator[io.IOBase, None, None]:
        if "r" not in mode:
            raise ValueError(f"{type(self).__name__} reads only (mode {mode!r})")
        with self.filesystem.open_input_file(str(path)) as stream:
            yield stream

    def concat_path(self, path, suffix: str) -> str:
        return f"{str(path).rstrip('/')}/{suffix}"

    def init_path(self, path) -> str:
        return str(path)

    def exists(self, path) -> bool:
        return self.filesystem.get_file_info(str(path)).type != pafs.FileType.NotFound

    def rename(self, path, new_path) -> None:
        raise NotImplementedError("a checkpoint in storage is read only here")

    def mkdir(self, path) -> None:
        raise NotImplementedError("a checkpoint in storage is read only here")

    def rm_file(self, path) -> None:
        raise NotImplementedError("a checkpoint in storage is read only here")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False  # never chosen by DCP on its own: the reader is handed over explicitly


class CheckpointReader(FileSystemReader):
    """DCP's ``FileSystemReader`` over ``checkpoint``'s storage (see the module's text)."""

    def __init__(self, checkpoint) -> None:
        filesystem, path = storage_of(checkpoint)
        super().__init__(path)
        self.fs, self.path = StorageFileSystem(filesystem), path

    def _slice_file(self, file, sinfo) -> io.BytesIO:
        """One item's bytes, in one read of its range (torch.load then reads them from memory)."""
        file.seek(sinfo.offset)
        return io.BytesIO(file.read(sinfo.length))


def read_small_file(checkpoint, name: str) -> bytes | None:
    """A small file of the checkpoint (its train state, a rank's RNG state), or None where it is absent."""
    filesystem, path = storage_of(checkpoint)
    target = f"{path.rstrip('/')}/{name}"
    if filesystem.get_file_info(target).type == pafs.FileType.NotFound:
        return None
    with filesystem.open_input_stream(target) as stream:
        return stream.read()
