"""Small file operations on the run's storage, local or ``s3://``, through pyarrow (the
same filesystem layer Ray Train uses for checkpoints)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Collection

import pyarrow.fs as pafs

#: The node's fast disk in the Ray pods (an emptyDir on its NVMe): checkpoints and exports are
#: staged there before their upload (training/storage/checkpoint.py, training/modeling/export.py).
SCRATCH_ENV = "RAY_TRAIN_EKS_SCRATCH"


def export_scratch() -> str | None:
    """Where an export is written before its upload: the node's fast disk in the Ray pods
    (``RAY_TRAIN_EKS_SCRATCH``, the emptyDir the pod's ephemeral storage request sizes for it), else
    the system's temp folder (a container's /tmp is on the node's root volume, often too small for a
    model)."""
    folder = os.environ.get(SCRATCH_ENV)
    if folder:
        os.makedirs(folder, exist_ok=True)
    return folder or None


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem of ``uri`` (``s3://``: pyarrow's S3, as Ray Train's; a path: the local one) and the path in it."""
    return pafs.FileSystem.from_uri(uri) if "://" in uri else (pafs.LocalFileSystem(), uri)


def upload_directory(local_dir: str, uri: str) -> None:
    """Copy a local folder to ``uri``."""
    filesystem, path = resolve(uri)
    filesystem.create_dir(path, recursive=True)
    pafs.copy_files(local_dir, path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=filesystem)


def download(uri: str, destination: Path, *, names: Collection[str] | None = None) -> Path:
    """Copy a file or a folder at ``uri`` into the local folder ``destination``; returns
    the local path of what was copied (with the pod's Pod Identity credentials on S3). ``names``:
    of a folder, only the files at its top with these names."""
    filesystem, path = resolve(uri)
    info = filesystem.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"{uri} does not exist (or this pod's role cannot read it)")
    destination.mkdir(parents=True, exist_ok=True)
    target = destination / Path(path).name if info.type == pafs.FileType.File else destination
    if names is not None and info.type == pafs.FileType.Directory:
        for entry in filesystem.get_file_info(pafs.FileSelector(path)):
            if entry.type == pafs.FileType.File and entry.base_name in names:
                pafs.copy_files(entry.path, str(target / entry.base_name), source_filesystem=filesystem,
                                destination_filesystem=pafs.LocalFileSystem())
        return target
    pafs.copy_files(path, str(target), source_filesystem=filesystem, destination_filesystem=pafs.LocalFileSystem())
    return target


def version(uri: str) -> str:
    """What changes whenever the object at ``uri`` is written again: its S3 ETag (from the
    object's metadata, as pyarrow's S3 input stream reads it with HeadObject), else its size
    and modification time. Raises FileNotFoundError when there is none."""
    filesystem, path = resolve(uri)
    info = filesystem.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"{uri} does not exist (or this pod's role cannot read it)")
    if info.type == pafs.FileType.File:
        with filesystem.open_input_file(path) as stream:
            metadata = stream.metadata() or {}
        etag = metadata.get("ETag") or metadata.get(b"ETag")
        if etag:
            return f"etag {etag.decode() if isinstance(etag, bytes) else etag}"
    return f"size {info.size} mtime {info.mtime_ns}"


def write_bytes(uri: str, data: bytes) -> None:
    """Write a small file at ``uri``, replacing it whole (S3 has no append): an S3 PUT
    replaces it atomically, and so does a local rename, so a reader never sees half a file."""
    filesystem, path = resolve(uri)
    filesystem.create_dir(path.rsplit("/", 1)[0], recursive=True)
    local = isinstance(filesystem, pafs.LocalFileSystem)
    target = f"{path}.{os.getpid()}.partial" if local else path
    with filesystem.open_output_stream(target) as stream:
        stream.write(data)
    if local:
        os.replace(target, path)


def write_text(uri: str, text: str) -> None:
    """Write a small text file at ``uri``."""
    write_bytes(uri, text.encode())


def read_bytes(uri: str) -> bytes | None:
    """The bytes at ``uri``, or None if there is no such file."""
    filesystem, path = resolve(uri)
    if filesystem.get_file_info(path).type == pafs.FileType.NotFound:
        return None
    with filesystem.open_input_stream(path) as stream:
        return stream.read()


def read_text(uri: str) -> str | None:
    """The text at ``uri``, or None if there is no such file."""
    data = read_bytes(uri)
    return None if data is None else data.decode()


def remove(uri: str) -> None:
    """Delete the file at ``uri`` if it exists."""
    filesystem, path = resolve(uri)
    if filesystem.get_file_info(path).type != pafs.FileType.NotFound:
        filesystem.delete_file(path)
