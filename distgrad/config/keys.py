"""The declaration of a file key (``Key``) and the checks of its value (``Check``), with the one reader that
every key goes through (``read_keys``) and the refusal of keys no declaration names (``refuse_unknown``).

The tables of declarations are ``distgrad.config.schema``'s; the same checks serve a command-line value of
the same range (``distgrad.config.experiment.check_run_settings``), so a bool is never taken for an integer
anywhere a file or a flag gives one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from distgrad.errors import ConfigError
from distgrad.wire.codecs import parse_codec


def is_whole(value: Any) -> bool:
    """Whether ``value`` is an int and not a bool (TOML integers)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Check:
    """What a key's value must be. ``kind`` is the reference's type ("integer >= 1"), ``expect`` the error's
    words ("a positive integer"), ``accepts`` the test; ``convert`` (optional) returns the value as the parser
    keeps it, or raises ``ConfigError`` saying why it is refused (its text then follows the key's name)."""

    kind: str
    expect: str
    accepts: Callable[[Any], bool]
    convert: Callable[[Any], Any] | None = None


def whole(low: int, high: int | None = None) -> Check:
    """An integer (not a bool) from ``low`` (to ``high``, inclusive)."""
    if high is not None:
        return Check(f"integer {low} to {high}", f"an integer from {low} to {high}",
                     lambda v: is_whole(v) and low <= v <= high)
    expect = {0: "a non-negative integer", 1: "a positive integer"}.get(low, f"an integer >= {low}")
    return Check(f"integer >= {low}", expect, lambda v: is_whole(v) and v >= low)


def one_of(choices: tuple[str, ...], expect: str | None = None) -> Check:
    """One of the strings ``choices``."""
    return Check(" | ".join(f'"{c}"' for c in choices), expect or f"one of {list(choices)}",
                 lambda v: isinstance(v, str) and v in choices)


def _shape(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(is_whole(v) and v > 0 for v in value)


def _device(value: Any) -> bool:
    return isinstance(value, str) and (value in ("cpu", "cuda") or (value.startswith("cuda:")
                                                                    and value[5:].isdigit()))


def _module(value: Any) -> bool:
    return isinstance(value, str) and value.count(":") == 1 and all(value.split(":"))


def _columns(value: Any) -> bool:
    return (isinstance(value, list) and bool(value) and all(is_whole(c) and c >= 0 for c in value)
            and len(set(value)) == len(value))


def _stage_names(value: Any) -> bool:
    return (isinstance(value, list) and len(value) >= 2 and all(isinstance(n, str) and n for n in value)
            and len(set(value)) == len(value))


def _early_stopping(value: Any) -> bool:
    return (isinstance(value, dict) and set(value) == {"metric", "patience"} and isinstance(value["metric"], str)
            and is_whole(value["patience"]) and value["patience"] >= 1)


def _codec(value: Any) -> str:
    return parse_codec(value).name


def _input_guard(value: Any) -> bool:
    if not isinstance(value, dict) or "max_r2" not in value or not set(value) <= {"max_r2", "after"}:
        return False
    r2, after = value["max_r2"], value.get("after", 0)
    return (isinstance(r2, (int, float)) and not isinstance(r2, bool) and 0 < r2 <= 1
            and is_whole(after) and after >= 0)


FLAG = Check("boolean", "true or false", lambda v: isinstance(v, bool))
TEXT = Check("string", "a string", lambda v: isinstance(v, str))
NAME = Check("string", "a non-empty string", lambda v: isinstance(v, str) and bool(v))
TABLE = Check("table", "a table", lambda v: isinstance(v, dict))
NAMES = Check("array of strings", 'a list of names such as ["auc", "f1"]',
              lambda v: isinstance(v, list) and all(isinstance(m, str) for m in v))
STAGE_NAMES = Check("array of strings", "a list of the stages' unique names in order, at least two", _stage_names)
STAGE_TABLES = Check("array of tables", "at least one [[stages]] table",
                     lambda v: isinstance(v, list) and bool(v))
LAYERS = Check("array of layer tables", "a list of layers", lambda v: isinstance(v, list))
BOTTOM = Check("array of layer tables", "a list of layer tables",
               lambda v: isinstance(v, list) and bool(v) and all(isinstance(t, dict) for t in v))
MODULE = Check('string "package.module:factory"', '"package.module:factory"', _module)
OPTIMIZER = Check("table", 'a table such as { type = "adam", lr = 0.01 }', lambda v: isinstance(v, dict))
SCHEDULER = Check("table", 'a table naming a torch.optim.lr_scheduler class, such as { type = "StepLR", '
                           'step_size = 10, gamma = 0.5 }',
                  lambda v: isinstance(v, dict) and isinstance(v.get("type"), str))
SCORE = Check("string", 'a reported score such as "test_accuracy"', lambda v: isinstance(v, str))
EARLY_STOPPING = Check("table", 'a table { metric = "test_loss", patience = K } with K >= 1', _early_stopping)
COLUMNS = Check("array of integers", "a list of distinct feature column indices (0, 1, ...)", _columns)
SHAPE = Check("array of integers", "a list of positive whole numbers", _shape)
ROW_SHAPE = Check("array of integers", "a list of positive whole numbers ([] for one value a row)",
                  lambda v: v == [] or _shape(v))
GUARD_AFTER_STEPS = 50     # input_guard's default 'after': the steps it does not judge (a layer's start)
INPUT_GUARD = Check("table", "a table { max_r2 = R } (0 < R <= 1), optionally with after = K (steps, K >= 0)",
                    _input_guard, lambda v: (float(v["max_r2"]), int(v.get("after", GUARD_AFTER_STEPS))))
DEVICE = Check('"cpu" | "cuda" | "cuda:N"', '"cpu", "cuda" or "cuda:N"', _device)
CODEC = Check("string", "a codec name", lambda v: True, _codec)


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()   # the default of a key every file must give
ABSENT = None                 # the default of an optional key: no value when absent


def _toml(value: Any) -> str:
    """A default as a TOML file would spell it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


@dataclass(frozen=True)
class Key:
    """One key: ``check`` (its type and range; ``None`` when its form depends on other keys, then
    ``checked_by`` names what checks it), ``help`` (its meaning), ``default`` (the value of an absent key,
    ``REQUIRED``, or ``ABSENT``), ``who`` may set it, ``why`` only they may (the error's reason), ``kind`` and
    ``shown`` (the reference's type and default when the check and the value do not say them), ``notes``
    (``(value, text)``: a refused value's explanation, appended to its error)."""

    check: Check | None
    help: str
    default: Any = ABSENT
    who: str = ""
    why: str = ""
    kind: str = ""
    shown: str = ""
    checked_by: str = ""
    notes: tuple[tuple[Any, str], ...] = ()

    @property
    def type_text(self) -> str:
        """The key's type as the reference shows it."""
        return self.kind or (self.check.kind if self.check is not None else "")

    @property
    def default_text(self) -> str:
        """The key's default as the reference shows it."""
        if self.shown:
            return self.shown
        if self.default is REQUIRED:
            return "required"
        return "absent" if self.default is ABSENT else _toml(self.default)

    def read(self, table: Mapping[str, Any], name: str, where: str) -> Any:
        """``table[name]`` checked (as ``check.convert`` keeps it), or the default when absent (``None``
        for an optional key). Raises ``ConfigError`` "{where}'{name}' must be {expect}, got {value!r}"
        (a missing required key: "is missing"). Without a check the value is returned as given."""
        if table.get(name) is None:        # absent (a Python caller's None is absent too)
            if self.default is REQUIRED and self.check is not None:
                raise ConfigError(f"{where}'{name}' is missing: it must be {self.check.expect}")
            return copy.deepcopy(None if self.default is REQUIRED else self.default)
        value = table[name]
        if self.check is None:
            return value
        if not self.check.accepts(value):
            note = next((text for refused, text in self.notes if refused == value), "")
            raise ConfigError(f"{where}'{name}' must be {self.check.expect}, got {value!r}{note}")
        if self.check.convert is None:
            return value
        try:
            return self.check.convert(value)
        except ConfigError as e:
            raise ConfigError(f"{where}'{name}': {e}") from e


def read_keys(table: Mapping[str, Any], keys: Mapping[str, Key], where: str) -> dict[str, Any]:
    """Every key of ``keys`` read from ``table`` through its declaration (``Key.read``), in declaration order.
    Raises ``ConfigError`` naming ``where``, the key and the value."""
    return {name: key.read(table, name, where) for name, key in keys.items()}


def refuse_unknown(table: Mapping[str, Any], keys: Mapping[str, Key], what: str, hint: str = "") -> None:
    """Raise ``ConfigError`` naming the keys of ``table`` that ``keys`` does not declare, and the valid ones
    (``what`` leads, e.g. "[interface] has unknown keys"; ``hint`` follows)."""
    unknown = set(table) - set(keys)
    if unknown:
        raise ConfigError(f"{what} {sorted(unknown)}; allowed: {sorted(keys)}{hint}")


def restricted(table: Mapping[str, Any], keys: Mapping[str, Key], who: str) -> list[str]:
    """The keys given in ``table`` that only ``who`` may set (``Key.who``)."""
    return [name for name, key in keys.items() if key.who == who and name in table]
