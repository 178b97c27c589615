"""Reading TOML files: the one place distgrad parses TOML, with a bound on how deeply values nest.

A file's arrays and tables may nest at most ``MAX_DEPTH`` levels; deeper is
refused with a ``ConfigError`` (exit 2), as is anything the parser cannot
read, never a traceback: a file of thousands of nested ``[`` would otherwise
exhaust the interpreter's recursion limit inside the parser.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from distgrad.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

MAX_DEPTH = 32      # levels of nested arrays and tables; distgrad's own files use fewer than five


def nesting_depth(value: Any) -> int:
    """How many levels of arrays and tables ``value`` nests (a scalar: 0), walked without recursion."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        item, depth = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth + 1)
        todo.extend((child, depth + 1) for child in children)
    return deepest


def read_toml(path: str | Path, what: str = "TOML file") -> dict[str, Any]:
    """The document at ``path`` as a dict; ``what`` names the file's kind in errors.

    Raises ``ConfigError`` ``"cannot read {what} {path}: ..."`` when the file
    cannot be read or parsed, or nests arrays and tables deeper than ``MAX_DEPTH``.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {what} {path}: {e}") from e
    too_deep = ConfigError(f"cannot read {what} {path}: arrays or tables nest deeper than {MAX_DEPTH} levels")
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"cannot read {what} {path}: {e}") from e
    except RecursionError:          # the parser recurses once per level: far too deep to be a real file
        raise too_deep from None
    if nesting_depth(document) - 1 > MAX_DEPTH:     # the document itself is the first table
        raise too_deep
    return document
