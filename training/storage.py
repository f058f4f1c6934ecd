"""Small file operations on the run's storage, local or ``s3://``, through pyarrow (the
same filesystem layer Ray Train uses for checkpoints)."""

from __future__ import annotations

import pyarrow.fs as pafs


def _resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    return pafs.FileSystem.from_uri(uri) if "://" in uri else (pafs.LocalFileSystem(), uri)


def upload_directory(local_dir: str, uri: str) -> None:
    """Copy a local folder to ``uri``."""
    filesystem, path = _resolve(uri)
    filesystem.create_dir(path, recursive=True)
    pafs.copy_files(local_dir, path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=filesystem)


def write_text(uri: str, text: str) -> None:
    """Write a small text file at ``uri``."""
    filesystem, path = _resolve(uri)
    filesystem.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with filesystem.open_output_stream(path) as stream:
        stream.write(text.encode())


def read_text(uri: str) -> str | None:
    """The text at ``uri``, or None if there is no such file."""
    filesystem, path = _resolve(uri)
    if filesystem.get_file_info(path).type == pafs.FileType.NotFound:
        return None
    with filesystem.open_input_stream(path) as stream:
        return stream.read().decode()


def remove(uri: str) -> None:
    """Delete the file at ``uri`` if it exists."""
    filesystem, path = _resolve(uri)
    if filesystem.get_file_info(path).type != pafs.FileType.NotFound:
        filesystem.delete_file(path)
