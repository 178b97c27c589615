"""The one JSON writer of distgrad: every JSON text it writes (summaries, traces, metrics, progress lines,
reports, digests) goes through ``json_text``, so none holds ``NaN`` or ``Infinity``, which are not JSON.

A float that is not finite is written as a string: ``"inf"``, ``"-inf"`` or ``"nan"`` (an undefined figure,
e.g. a loss that diverged). ``float(value)`` reads each back; ``null`` stays what it always meant, a figure
that was not measured or has no value (a metric undefined on one class). ``strict=True`` refuses them
instead, for text that must read back as the same numbers (a scheduler's state).

Reading JSON that a file holds goes through ``parse_json``: whatever is wrong with the text (not UTF-8, not
JSON, nested deeper than Python's parser recurses) is a ``ConfigError`` naming where it came from, never a
traceback.
"""

from __future__ import annotations

import json
import math
from typing import Any

from distgrad.errors import ConfigError

NONFINITE_TEXT = {math.inf: "inf", -math.inf: "-inf"}     # and NaN: "nan"


def finite_or_text(value: float) -> float | str:
    """``value`` if finite, else its text: ``"inf"``, ``"-inf"`` or ``"nan"``."""
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else NONFINITE_TEXT[value]


def _replace_nonfinite(obj: Any) -> Any:
    """``obj`` with every non-finite float (numpy's too) in it replaced by its text; tuples become lists."""
    if isinstance(obj, float):                       # numpy's float64 is a float
        return finite_or_text(obj)
    if isinstance(obj, dict):
        return {key: _replace_nonfinite(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_replace_nonfinite(value) for value in obj]
    if hasattr(obj, "dtype") and getattr(obj, "shape", None) == () and obj.dtype.kind == "f":
        return finite_or_text(float(obj))            # a numpy scalar of another float width
    return obj


def json_text(obj: Any, *, strict: bool = False, **options: Any) -> str:
    """``obj`` as JSON text (``json.dumps``'s ``options``: ``indent``, ``sort_keys``, ``separators``, ...),
    never with ``NaN`` or ``Infinity``: a non-finite float is written as ``"inf"``, ``"-inf"`` or ``"nan"``;
    with ``strict``, it raises ``ValueError`` instead."""
    return json.dumps(obj if strict else _replace_nonfinite(obj), allow_nan=False, **options)


def parse_json(text: str | bytes, where: str) -> Any:
    """``text`` (bytes as UTF-8) parsed as one JSON value. ``ConfigError`` naming ``where`` when it is not
    UTF-8, not JSON, or nested too deeply for the parser (``RecursionError``: no file distgrad writes comes
    near that depth)."""
    try:
        return json.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
    except UnicodeDecodeError:
        raise ConfigError(f"{where} is not UTF-8 text") from None
    except RecursionError:
        raise ConfigError(f"{where} is JSON nested too deeply to be one distgrad wrote") from None
    except ValueError as e:          # JSONDecodeError, a number too long to convert
        raise ConfigError(f"{where} is not JSON: {e}") from None
