"""Checkpoints: a stage's whole state at a step, written atomically with a checksum.

File format (no pickle anywhere)::

    b"DGCKPT1\\n" | uint32 little-endian header length | msgpack header | payload

The header holds ``stage``, ``run``, ``step``, ``fingerprint``, ``meta`` and a
SHA-256 over those fields and the payload; the payload is an uncompressed ``.npz`` of named
arrays (float32, and the optimizer's int64 update count), read back with ``allow_pickle=False``. A file is written to a
temporary name, fsynced, renamed into place and its directory fsynced, so a
crash leaves either the old set of files or the new one. A torn or corrupt
file fails its checksum and the previous checkpoint is used.

Files are named ``STAGE-RUN-STEPSTEPSTEP.ckpt`` (the run id, or a hash of it
when it is not plain letters and digits), so several runs share a directory:
a save prunes only its own run's older files and never another run's. A stage
process holds ``DIR/.STAGE.lock`` (``lock_stage``) for its whole life, so two
processes of one stage never share a directory.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import logging
import os
import re
import stat
import struct
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import msgpack
import numpy as np

from distgrad.errors import CheckpointWriteError, ConfigError, DistgradError
from distgrad.config.npzfile import object_members, write_npz

MAGIC = b"DGCKPT1\n"
KEEP_LAST = 3                      # checkpoints kept per stage and run (at least two must survive a torn write)
HEADER_MAX_BYTES = 1 << 20
RUN_TOKEN_MAX = 64                 # a longer run id, or one with other characters, is named by its hash
_PLAIN_STAGE = r"[A-Za-z0-9_.@-]+"          # a stage named with these characters is itself in file names
# f@2: client 2 of stage f; ~HASH: a stage whose name has other characters (``stage_token``)
_STAGE = rf"(?P<stage>{_PLAIN_STAGE}|~[0-9a-f]{{32}})"
_NAME = re.compile(rf"^{_STAGE}-(?P<run>[A-Za-z0-9]{{1,{RUN_TOKEN_MAX}}})-(?P<step>\d{{9,}})\.ckpt$")
_OLD_NAME = re.compile(rf"^{_STAGE}-(?P<step>\d{{9}})\.ckpt$")            # before run ids were in names
_TMP = re.compile(r"^\.(?P<name>.+\.ckpt)\.(?P<pid>\d+)\.tmp$")              # a save's temporary file

log = logging.getLogger("distgrad.stage.checkpoint")


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
    saved_ns: int | None = None     # wall clock of the save (None in files older than this field)


_HEADER_TYPES: dict[str, type] = {"stage": str, "run": str, "step": int, "fingerprint": str, "meta": dict}


def _digest(fields: Mapping[str, Any], payload: bytes) -> str:
    """SHA-256 over the header fields and the payload: a flipped bit anywhere is caught."""
    digest = hashlib.sha256(msgpack.packb(dict(sorted(fields.items()))))
    digest.update(payload)
    return digest.hexdigest()


def run_token(run: str) -> str:
    """The run as it appears in file names: itself when plain letters and digits, else a hash of it
    (a serving stage's run id comes from the network and must not make a path)."""
    if re.fullmatch(rf"[A-Za-z0-9]{{1,{RUN_TOKEN_MAX}}}", run):
        return run
    return "h" + hashlib.sha256(run.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def stage_token(stage: str) -> str:
    """The stage as it appears in file names (its checkpoints, its lock): itself when made of letters, digits
    and ``_.@-``, else ``~`` and a hash of it, so that a stage file's name with a space, a slash or other
    characters neither leaves the directory nor makes files that are never found again (resumed, pruned)."""
    if re.fullmatch(_PLAIN_STAGE, stage):
        return stage
    return "~" + hashlib.sha256(stage.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _path(directory: Path, stage: str, run: str, step: int) -> Path:
    return directory / f"{stage_token(stage)}-{run_token(run)}-{step:09d}.ckpt"


def _parse(name: str) -> tuple[str, str | None, int] | None:
    """(stage, run token or None for an old-format name, step) of a checkpoint file name."""
    match = _NAME.match(name) or _OLD_NAME.match(name)
    if match is None:
        return None
    return match["stage"], match.groupdict().get("run"), int(match["step"])


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory: Path, stage: str, run: str, step: int, fingerprint: str,
         arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any] | None = None) -> Path:
    """Write one checkpoint atomically and prune all but the newest ``KEEP_LAST`` of this stage's
    ``run`` (never another run's files); return its path.

    Raises ``CheckpointWriteError`` naming the directory and the cause when it
    cannot be written (disk full, read-only); the temporary file is removed.
    """
    buffer = io.BytesIO()
    write_npz(buffer, {name: np.asarray(a) for name, a in arrays.items()})
    payload = buffer.getvalue()
    fields = {"stage": stage, "run": run, "step": step, "fingerprint": fingerprint, "meta": dict(meta or {}),
              "saved_ns": time.time_ns()}           # which run was written last (see ``latest``)
    header = msgpack.packb(dict(fields, sha256=_digest(fields, payload)))
    path = _path(directory, stage, run, step)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<I", len(header)) + header + payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(directory)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise CheckpointWriteError(f"cannot write checkpoint {path.name} of stage {stage} in --checkpoint-dir "
                                   f"{directory}: {e.strerror or e}") from e
    token = run_token(run)
    for old in [s for s, r in _files(directory, stage) if r == token][:-KEEP_LAST]:
        _path(directory, stage, run, old).unlink(missing_ok=True)
    return path


def _pickled(path: Path, what: str) -> ConfigError:
    """The refusal of a checkpoint that passes its checksum but holds pickled data: not a torn file to skip
    (distgrad never writes one), so the stage stops (exit 2) and leaves every file as it is."""
    return ConfigError(f"checkpoint {path} passes its checksum, but {what}: distgrad never writes or reads "
                       f"pickled data. Nothing was loaded or changed; remove the file, or give another "
                       f"--checkpoint-dir")


def load(path: Path) -> Checkpoint:
    """Read and verify one checkpoint; raises ``CheckpointError`` if it is torn or corrupt, and
    ``ConfigError`` if it verifies but holds pickled data (``_pickled``)."""
    try:
        data = _read_regular(path)
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
        # ``saved_ns`` is absent from files written before it existed.
        fields = {k: header[k] for k in ("stage", "run", "step", "fingerprint", "meta", "saved_ns") if k in header}
        if _digest(fields, payload) != header["sha256"]:
            raise CheckpointError(f"{path} fails its checksum (torn or corrupt)")
        for key, kind in _HEADER_TYPES.items():     # a file of another writer may pass its checksum
            value = header.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise CheckpointError(f"{path} is not a checkpoint of this format: its header's {key!r} is "
                                      f"{type(value).__name__}, not {kind.__name__}")
        if not zipfile.is_zipfile(io.BytesIO(payload)):
            raise _pickled(path, "its arrays are not an npz archive (a pickle?)")
        with np.load(io.BytesIO(payload), allow_pickle=False) as npz:
            objects = object_members(npz)
            if objects:
                raise _pickled(path, f"its arrays {objects} hold Python objects (pickled)")
            arrays = {name: npz[name] for name in npz.files}
        saved = header.get("saved_ns")
        return Checkpoint(header["stage"], header["run"], int(header["step"]), header["fingerprint"],
                          arrays, dict(header["meta"]), path, saved if isinstance(saved, int) else None)
    except (CheckpointError, ConfigError):
        raise
    except Exception as e:  # msgpack/numpy raise many types on corrupt bytes
        raise CheckpointError(f"{path} is corrupt: {type(e).__name__}: {e}") from e


def _read_regular(path: Path) -> bytes:
    """The bytes of ``path``, refused (``CheckpointError``) unless it is a regular file: opened without
    blocking, so a FIFO or device under a checkpoint's name cannot hold the stage forever."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as f:
            fd = -1                         # closed by the file object
            return f.read()
    finally:
        if fd >= 0:
            os.close(fd)


def _files(directory: Path, stage: str) -> list[tuple[int, str | None]]:
    """(step, run token or None for an old-format name) of this stage's checkpoint files, by step."""
    if not directory.is_dir():
        return []
    found = []
    token = stage_token(stage)
    for entry in directory.iterdir():
        parsed = _parse(entry.name)
        if parsed is not None and parsed[0] == token:
            found.append((parsed[2], parsed[1]))
    return sorted(found, key=lambda item: (item[0], item[1] or ""))


def steps_on_disk(directory: Path, stage: str) -> list[int]:
    """Steps of this stage's checkpoint files of every run, oldest first (not yet verified)."""
    return [step for step, _ in _files(directory, stage)]


class StageLock:
    """``DIR/.STAGE.lock``, held (``flock``, exclusive) by the one process running the stage there.

    The kernel drops the lock when the process dies, even by SIGKILL, so a
    stage restarted at once gets it back.
    """

    def __init__(self, directory: Path, stage: str, fd: int) -> None:
        self.directory, self.stage, self._fd = directory, stage, fd
        self.path = directory / f".{stage_token(stage)}.lock"

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)          # closing the descriptor drops the lock
            self._fd = -1

    def __enter__(self) -> "StageLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_stage(directory: Path, stage: str) -> StageLock:
    """Take ``DIR/.STAGE.lock`` before anything else reads or writes this stage's files there.

    Raises ``ConfigError`` (exit 2) naming the directory and the OS reason when it
    cannot be created or written, and naming the pid of the holder when another
    process runs this stage there. Once held, removes this stage's temporary
    files left by a crash (``.STAGE-...ckpt.PID.tmp``), and nothing else.
    """
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"--checkpoint-dir {directory} exists and is not a directory")
    path = directory / f".{stage_token(stage)}.lock"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK | os.X_OK):     # a read-only mount says so here, even to root
            raise OSError(errno.EROFS if _read_only(directory) else errno.EACCES,
                          os.strerror(errno.EROFS if _read_only(directory) else errno.EACCES))
        # Never through a symlink, nor waiting on a FIFO: the pid written below must not land in another file.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR):
            raise _not_a_lock(directory, path) from e
        raise ConfigError(f"--checkpoint-dir {directory} is not writable: {e.strerror or e}") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _not_a_lock(directory, path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _read_pid(fd)
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise ConfigError(f"--checkpoint-dir {directory}: cannot lock {path}: {e.strerror or e}") from e
        raise ConfigError(f"--checkpoint-dir {directory} is in use: stage {stage} is already running there "
                          f"(pid {holder or '?'} holds {path}); two processes of one stage would fight over its "
                          f"run. Stop that process first, or give this one another directory") from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except OSError as e:
        os.close(fd)
        raise ConfigError(f"--checkpoint-dir {directory} is not writable: {e.strerror or e}") from e
    lock = StageLock(directory, stage, fd)
    _remove_stale_temporaries(directory, stage)
    return lock


def _not_a_lock(directory: Path, path: Path) -> ConfigError:
    """The refusal of a lock path that is no regular file (a symlink, a directory, a FIFO), left as it is."""
    return ConfigError(f"--checkpoint-dir {directory}: {path} is not a regular file (a symlink, directory or "
                       f"FIFO?), so it cannot be the stage's lock and nothing was written through it. Remove it, "
                       f"or give another directory")


def _read_only(directory: Path) -> bool:
    return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)


def _read_pid(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return text if text.isdigit() else ""


def _remove_stale_temporaries(directory: Path, stage: str) -> None:
    """Delete this stage's ``.NAME.ckpt.PID.tmp`` files: only its lock holder writes them, so they are a
    crash's leftovers. Other stages' temporaries and files of any other shape stay."""
    for entry in directory.iterdir():
        match = _TMP.match(entry.name)
        parsed = _parse(match["name"]) if match else None
        if parsed is not None and parsed[0] == stage_token(stage):
            log.info("removing %s, left by a crash of stage %s", entry, stage)
            entry.unlink(missing_ok=True)


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
        wanted = None if run is None else run_token(run)
        for step, token in _files(self.directory, self.stage):
            if token is not None and wanted is not None and token != wanted:
                continue                    # another run's file: not even read
            name = stage_token(self.stage)
            path = (self.directory / f"{name}-{step:09d}.ckpt" if token is None
                    else self.directory / f"{name}-{token}-{step:09d}.ckpt")
            try:
                ckpt = load(path)
            except CheckpointError as e:
                log.warning("skipping checkpoint: %s", e)
                continue
            if ckpt.step != step or (token is not None and run_token(ckpt.run) != token):
                log.warning("skipping checkpoint %s: its name does not match its header", path)
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
        """The newest valid checkpoint of the run written most recently, or None.

        Several runs with these settings may share the directory (other runs'
        files are never deleted); the one a stage resumes is the one it saved
        last, whatever the step numbers of the others.
        """
        newest: dict[str, Checkpoint] = {}
        written: dict[str, int] = {}
        for ckpt in self.valid():
            newest[ckpt.run] = ckpt                  # valid() is by step: the last is the run's newest
            written[ckpt.run] = max(written.get(ckpt.run, 0), _written_ns(ckpt))
        if not newest:
            return None
        return newest[max(newest, key=lambda run: (written[run], newest[run].step))]

    def steps(self, run: str) -> list[int]:
        return [c.step for c in self.valid(run)]

    def at(self, run: str, step: int) -> Checkpoint | None:
        for ckpt in self.valid(run):
            if ckpt.step == step:
                return ckpt
        return None



def _written_ns(ckpt: Checkpoint) -> int:
    """When a checkpoint was saved: its header's ``saved_ns``, else (older files) the file's mtime."""
    if ckpt.saved_ns is not None:
        return ckpt.saved_ns
    try:
        return ckpt.path.stat().st_mtime_ns
    except OSError:
        return 0
