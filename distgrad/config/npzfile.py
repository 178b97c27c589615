"""``.npz`` archives: writing them without pickles, reading those a user hands us (``--load`` parameter
files), and the rule for their values.

Nothing is pickled: ``write_npz`` refuses an array of Python objects (which
``numpy.savez`` would pickle), and every read uses ``allow_pickle=False``.
``read_npz`` reads an archive whole, every member decompressed and its CRC-32
checked; a cut-short or bit-flipped file, a member that holds Python objects,
or a file that is no archive at all is a ``ConfigError`` naming the file (and
the member, where one is at fault), never a traceback.
"""

from __future__ import annotations

import zipfile
import zlib
from pathlib import Path
from typing import IO, Mapping

import numpy as np

from distgrad.errors import ConfigError

# What a damaged or foreign file raises while numpy opens or reads it: zipfile's BadZipFile ("File is not a
# zip file", "Bad CRC-32"), zlib's error, EOFError for a cut-short member, ValueError for a bad ``.npy``
# header or an object (pickled) member, OSError for what the file system says.
READ_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, ValueError, OSError)
ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")     # a zip archive's first member, or an empty archive
NPY_MAGIC = b"\x93NUMPY"                         # a plain .npy array (refused below, naming it)
CHECKPOINT_START = b"DGCKPT"                      # how a distgrad checkpoint begins (stage/checkpoint.MAGIC)


def write_npz(file: str | Path | IO[bytes], arrays: Mapping[str, np.ndarray]) -> None:
    """The uncompressed ``.npz`` archive ``numpy.savez`` writes, one member per array, under any name (``file``
    and ``allow_pickle`` too, which ``savez`` would take as its own arguments); ``TypeError`` naming the array,
    before anything is written, for one of Python objects (``savez`` would pickle it)."""
    for name, array in arrays.items():
        if array.dtype.hasobject:
            raise TypeError(f"array {name!r} holds Python objects (dtype {array.dtype}); distgrad writes no "
                            f"pickles: give numbers")
    with zipfile.ZipFile(file, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in arrays.items():
            with archive.open(f"{name}.npy", mode="w", force_zip64=True) as member:     # zip64 as savez does
                np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)


def object_members(archive: np.lib.npyio.NpzFile) -> list[str]:
    """The members of an open archive whose dtype holds Python objects (pickled), read from their
    ``.npy`` headers without loading them."""
    found = []
    members = archive.zip
    if members is None:
        raise ValueError("object_members reads an open archive; this one is closed")
    names = set(members.namelist())
    for name in archive.files:
        with members.open(f"{name}.npy" if f"{name}.npy" in names else name) as member:
            version = np.lib.format.read_magic(member)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            if read_header(member)[2].hasobject:
                found.append(name)
    return found


def member_error(what: str, path: str | Path, member: str, reason: str) -> ConfigError:
    """The one form of a refusal of a member: ``"{what} {path}: member {member!r} {reason}"``."""
    return ConfigError(f"{what} {path}: member {member!r} {reason}")


def read_npz(path: str | Path, what: str) -> dict[str, np.ndarray]:
    """Every member of the ``.npz`` archive at ``path``, read whole; ``what`` names the file's use in
    errors (e.g. ``"--load"``).

    Raises ``ConfigError`` ``"{what} {path}: ..."`` naming the member when one
    cannot be read (cut short, bad CRC, pickled objects), and naming the file
    when it is not an npz archive.
    """
    try:
        with open(path, "rb") as f:
            start = f.read(len(NPY_MAGIC))
        archive = np.load(path, allow_pickle=False) if start.startswith(ZIP_MAGIC) or start == NPY_MAGIC else None
    except READ_ERRORS as e:
        raise ConfigError(f"{what} {path}: not a readable npz archive ({type(e).__name__}: {e})") from e
    if archive is None:     # numpy would take it for a pickle and say so, advising an unsafe load: name what it is
        kind = ("a distgrad checkpoint (of --checkpoint-dir), which holds a whole run's state"
                if start.startswith(CHECKPOINT_START) else f"a file beginning {start!r}")
        raise ConfigError(f"{what} {path}: not a readable npz archive: it is {kind}; {what} takes the parameters "
                          f"file that --save writes (.npz; .pt for a torch stage)")
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise ConfigError(f"{what} {path}: not an npz archive of named arrays (a plain .npy array?)")
    arrays = {}
    with archive:
        for name in archive.files:
            try:
                arrays[name] = archive[name]
            except READ_ERRORS as e:
                raise member_error(what, path, name, f"cannot be read: the file is damaged or not what "
                                                     f"numpy.savez writes ({type(e).__name__}: {e})") from e
    return arrays


def check_values(what: str, path: str | Path, arrays: dict[str, np.ndarray], dtype: np.dtype) -> None:
    """Raise ``ConfigError`` naming the file and the member unless every array is exactly of ``dtype``
    (nothing is cast: an int64, float64 or complex member is refused, not converted) and finite."""
    for name, array in arrays.items():
        if array.dtype != dtype:
            raise member_error(what, path, name, f"is {array.dtype}, the parameter is {np.dtype(dtype)} "
                                                 f"(values are never cast)")
        if not np.isfinite(array).all():
            raise member_error(what, path, name, "holds values that are not finite (Inf or NaN)")
