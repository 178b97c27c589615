"""``distgrad stage`` for a data owner whose loader walks its rows in another order (``send_rows`` tests).

    python tests/reordered_stage.py -- f --experiment ...

Every epoch's training rows are taken in the reverse of the order the seed gives (``reverse_epochs``), so
the stage picks other rows for each step than the label owner's own sample order would; everything else is
``distgrad stage ARGS`` (``distgrad.cli.stage_main``), unchanged. With ``send_rows`` the label owner must
then train on this stage's rows.
"""

from __future__ import annotations

import sys

from distgrad.config.data import RowBatches


def reverse_epochs() -> None:
    """Make every ``RowBatches`` walk each epoch's rows in the reverse of its seeded order."""
    seeded = RowBatches.epoch_order

    def reversed_order(self: RowBatches, epoch: int):
        return seeded(self, epoch)[::-1].copy()

    RowBatches.epoch_order = reversed_order      # type: ignore[method-assign]


def main(argv: list[str]) -> int:
    from distgrad import cli

    reverse_epochs()
    return cli.stage_main(argv[1:] if argv[:1] == ["--"] else argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
