"""Checkpoints: a stage's whole state at a step, written atomically with a checksum.

File format (no pickle anywhere)::

    b"DGCKPT1\\n" | uint32 little-endian header length | msgpack header | payload

The header holds ``stage``, ``run``, ``step``, ``fingerprint``, ``meta`` and a
SHA-256 over those fields and the payload; the payload is an uncompressed ``.npz`` of named
float32 arrays, read back with ``allow_pickle=False``. A file is written to a
temporary name, fsynced, renamed into place and its directory fsynced, so a
crash leaves either the old set of files or the new one. A torn or corrupt
file fails its checksum and the previous checkpoint is used.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import msgpack
import numpy as np

from .errors import ConfigError, DistgradError

MAGIC = b"DGCKPT1\n"
KEEP_LAST = 3                      # checkpoints kept per stage (at least two must survive a torn write)
HEADER_MAX_BYTES = 1 << 20
_NAME = re.compile(r"^(?P<stage>[A-Za-z0-9_.@-]+)-(?P<step>\d{9})\.ckpt$")   # f@2: client 2 of stage f

log = logging.getLogger("distgrad.checkpoint")


class CheckpointError(DistgradError, ValueError):
    """A checkpoint file is torn, corrupt or belongs to something else."""


@dataclass
class Checkpoint:
    stage: str
    run: str
    step: int
    fingerprint: str
    arrays: dict[str, np.ndarray]
    meta: dict[str, Any]
    path: Path


def _digest(fields: Mapping[str, Any], payload: bytes) -> str:
    """SHA-256 over the header fields and the payload: a flipped bit anywhere is caught."""
    digest = hashlib.sha256(msgpack.packb(dict(sorted(fields.items()))))
    digest.update(payload)
    return digest.hexdigest()


def _path(directory: Path, stage: str, step: int) -> Path:
    return directory / f"{stage}-{step:09d}.ckpt"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory: Path, stage: str, run: str, step: int, fingerprint: str,
         arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any] | None = None) -> Path:
    """Write one checkpoint atomically and prune all but the newest ``KEEP_LAST``; return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    np.savez(buffer, **{name: np.asarray(a) for name, a in arrays.items()})
    payload = buffer.getvalue()
    fields = {"stage": stage, "run": run, "step": step, "fingerprint": fingerprint, "meta": dict(meta or {})}
    header = msgpack.packb(dict(fields, sha256=_digest(fields, payload)))
    path = _path(directory, stage, step)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<I", len(header)) + header + payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(directory)
    for old in steps_on_disk(directory, stage)[:-KEEP_LAST]:
        _path(directory, stage, old).unlink(missing_ok=True)
    return path


def load(path: Path) -> Checkpoint:
    """Read and verify one checkpoint; raises ``CheckpointError`` if it is torn or corrupt."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
        raise CheckpointError(f"{path} is not a distgrad checkpoint (bad magic)")
    (size,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    if size > HEADER_MAX_BYTES or start + size > len(data):
        raise CheckpointError(f"{path} is truncated (header)")
    try:
        header = msgpack.unpackb(data[start:start + size], raw=False)
        payload = data[start + size:]
        fields = {k: header[k] for k in ("stage", "run", "step", "fingerprint", "meta")}
        if _digest(fields, payload) != header["sha256"]:
            raise CheckpointError(f"{path} fails its checksum (torn or corrupt)")
        with np.load(io.BytesIO(payload), allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
        return Checkpoint(header["stage"], header["run"], int(header["step"]), header["fingerprint"],
                          arrays, dict(header["meta"]), path)
    except CheckpointError:
        raise
    except Exception as e:  # msgpack/numpy raise many types on corrupt bytes
        raise CheckpointError(f"{path} is corrupt: {type(e).__name__}: {e}") from e


def steps_on_disk(directory: Path, stage: str) -> list[int]:
    """Steps of this stage's checkpoint files, oldest first (not yet verified)."""
    if not directory.is_dir():
        return []
    steps = []
    for entry in directory.iterdir():
        match = _NAME.match(entry.name)
        if match and match["stage"] == stage:
            steps.append(int(match["step"]))
    return sorted(steps)


class CheckpointStore:
    """The checkpoints of one stage in one directory, for one experiment."""

    def __init__(self, directory: Path, stage: str, fingerprint: str, match: Mapping[str, Any] | None = None) -> None:
        """Checkpoints count only if their stage, experiment fingerprint and the ``match``
        items of their meta (e.g. seed, --init overrides) are these."""
        if directory.exists() and not directory.is_dir():
            raise ConfigError(f"--checkpoint-dir {directory} exists and is not a directory")
        self.directory, self.stage, self.fingerprint = directory, stage, fingerprint
        self.match = dict(match or {})

    def save(self, run: str, step: int, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> Path:
        return save(self.directory, self.stage, run, step, self.fingerprint, arrays, meta)

    def valid(self, run: str | None = None) -> list[Checkpoint]:
        """Every checkpoint that verifies (and belongs to ``run`` if given), oldest first.

        Corrupt files are reported and skipped, so the previous one serves.
        """
        found = []
        for step in steps_on_disk(self.directory, self.stage):
            path = _path(self.directory, self.stage, step)
            try:
                ckpt = load(path)
            except CheckpointError as e:
                log.warning("skipping checkpoint: %s", e)
                continue
            if ckpt.stage != self.stage or ckpt.fingerprint != self.fingerprint:
                log.warning("skipping checkpoint %s: it belongs to another stage or experiment", path)
                continue
            if any(ckpt.meta.get(key) != value for key, value in self.match.items()):
                log.warning("skipping checkpoint %s: made with other settings %s", path,
                            {k: ckpt.meta.get(k) for k in self.match})
                continue
            if run is None or ckpt.run == run:
                found.append(ckpt)
        return found

    def latest(self) -> Checkpoint | None:
        """The newest valid checkpoint, or None."""
        valid = self.valid()
        return valid[-1] if valid else None

    def steps(self, run: str) -> list[int]:
        return [c.step for c in self.valid(run)]

    def at(self, run: str, step: int) -> Checkpoint | None:
        for ckpt in self.valid(run):
            if ckpt.step == step:
                return ckpt
        return None

    def discard_other_runs(self, run: str) -> None:
        """Delete this stage's checkpoints that belong to another run (a new run owns the directory)."""
        for ckpt in self.valid():
            if ckpt.run != run:
                ckpt.path.unlink(missing_ok=True)
