"""Command-line front ends: ``distgrad`` (run, demo, experiments, stage, align, ...) and ``distgrad-stage``.

Thin by design: parse, build a validated configuration, call the Python API,
map errors to exit codes:

====  ==========================================================
0     success
1     a stage failed (computation error, a NaN/Inf loss or gradient on any stage, a stage of the launcher failed)
2     usage or configuration error (bad flag, experiment, endpoint, --init)
3     the peer did not answer in time, or fell silent mid-run
4     the peer refused us (error reply: mismatched experiment, bad step...)
5     a data owner's input_guard stopped the run (its activations could be inverted beyond its max_r2)
130   stopped by SIGINT (Ctrl-C); 143 stopped by SIGTERM
====  ==========================================================
"""

from __future__ import annotations

import os

from distgrad.threads import pin_blas_threads

# BLAS pools are sized when numpy loads: pin them before anything imports it
# (an explicit setting in the environment wins).
pin_blas_threads()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import logging  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypedDict  # noqa: E402

from distgrad.errors import (ConfigError, DistgradError, InputGuardStop, Interrupted, PeerRejected, PeerTimeout,  # noqa: E402
                     ProtocolError)

if TYPE_CHECKING:  # imported lazily at run time, after the BLAS pools are pinned
    import zmq

    from distgrad.config.experiment import Experiment
    from distgrad.run.options import StageOptions
    from distgrad.wire.keys import CurveClient, CurveServer

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_TIMEOUT, EXIT_REJECTED = 0, 1, 2, 3, 4
EXIT_GUARD = 5           # a data owner's input_guard stopped the run
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


def _exit_code(error: BaseException) -> int:
    """The exit code of a command that raised ``error`` (the table above)."""
    if isinstance(error, Interrupted):
        return 128 + error.signum
    if isinstance(error, ConfigError):
        return EXIT_USAGE
    if isinstance(error, InputGuardStop):
        return EXIT_GUARD
    if isinstance(error, PeerTimeout):
        return EXIT_TIMEOUT
    if isinstance(error, (PeerRejected, ProtocolError)):
        return EXIT_REJECTED
    return EXIT_FAILED


def _common_flags(p: argparse.ArgumentParser, experiment_required: bool) -> None:
    """The flags every stage process takes, as ``distgrad stage`` and ``distgrad run`` (which hands them on): the
    experiment's settings, the trace, the waits (seconds), checkpoints and the log level."""
    if experiment_required:
        p.add_argument("--experiment", required=True, metavar="NAME_OR_PATH",
                       help="built-in experiment name or path to an experiment TOML file")
    p.add_argument("--init", metavar="NAME=VALUE[,NAME=VALUE]",
                   help="override initial parameter values; a value fills the whole parameter")
    p.add_argument("--steps", type=int, metavar="N", help="training steps (default: the experiment's)")
    p.add_argument("--seed", type=int, metavar="N", help="seed for initialisation and data (default: the experiment's)")
    p.add_argument("--summary", type=Path, metavar="PATH", help="write the run summary JSON here")
    p.add_argument("--trace", type=Path, metavar="PATH",
                   help="write one JSON line per step here: every parameter and its gradient as JSON, about "
                        "42 bytes per parameter per step (mlp-classify: 8.7 MB a step); narrow it with "
                        "--trace-params and --trace-every")
    p.add_argument("--trace-params", metavar="NAME[,NAME]",
                   help="trace only these parameters (and their gradients; activation_grad is the gradient "
                        "that crossed the wire)")
    p.add_argument("--trace-every", type=int, default=1, metavar="K",
                   help="trace only every K-th step, and the last (default 1: every step)")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="driving stage: how long to wait for one reply before reconnecting and resending (default 5)")
    p.add_argument("--liveness", type=float, metavar="SECONDS",
                   help="a peer silent this long is reported lost (default 10); also the ZMTP heartbeat timeout")
    p.add_argument("--peer-deadline", type=float, metavar="SECONDS",
                   help="how long to wait for a lost peer to come back before exiting 3 (default 60)")
    p.add_argument("--spin-us", type=float, metavar="MICROSECONDS",
                   help="at the start of each wait for a message, check for it without sleeping for this "
                        "long (0 to 10000) before blocking: a faster answer to small messages for a busy core "
                        "while waiting (default 0, off; see docs/performance.md)")
    p.add_argument("--checkpoint-dir", type=Path, metavar="DIR", help="save checkpoints here (and on SIGTERM)")
    p.add_argument("--checkpoint-every", type=int, metavar="K", help="save a checkpoint every K steps")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --checkpoint-dir (a fresh start if there is none)")
    _log_level_flag(p)


def _watch_flags(p: argparse.ArgumentParser) -> None:
    """How a run is watched: metrics, TensorBoard, held-out evaluations, the privacy meter, progress."""
    p.add_argument("--metrics", type=Path, metavar="PATH",
                   help="one JSON line per step: the driving stage's loss, learning rate, wall time, bytes, compute "
                        "and wait times; a serving or middle stage's own step, loss, learning rate and wall time "
                        "(distgrad run: the driving stage's in PATH, each other stage's in PATH.STAGE, e.g. "
                        "metrics.g.jsonl)")
    p.add_argument("--tensorboard", type=Path, metavar="DIR",
                   help="write TensorBoard event files here: loss, learning rate, held-out loss, accuracy and metrics, "
                        "steps/s and bytes per step (a serving stage: its loss and learning rate; distgrad run: "
                        "each other stage's in DIR/STAGE; needs pip install 'distgrad[tensorboard]')")
    p.add_argument("--eval-every", type=int, metavar="K",
                   help="driving stage: evaluate the held-out rows through every stage after every K-th step, "
                        "into the progress line, the metrics and the summary's evaluations (default: the "
                        "experiment's eval_every; 0: only after the last step)")
    p.add_argument("--privacy-meter", action="store_true",
                   help="meter, live, what crosses the cut could give away (label recovery and AUCs at the label "
                        "owner, distance correlation at the data owner) into the log, the metrics and the summary, "
                        "as a stage's privacy_meter = true does; sends and changes nothing (docs/privacy.md). "
                        "'distgrad run': every stage that can meter; 'distgrad stage': this one, or exit 2")
    p.add_argument("--progress", choices=["auto", "bar", "lines", "off"], default="auto",
                   help="driving stage: 'bar' draws a bar; 'lines' writes only machine-readable 'progress {json}' "
                        "lines (for a launcher); 'off' logs an INFO line every tenth of the run; 'auto' (default) "
                        "is 'bar' in a terminal, else 'off'")


def _pipeline_flags(p: argparse.ArgumentParser) -> None:
    """The driving stage's pipeline: micro-batches, schedule, micro-batches in flight, staleness."""
    p.add_argument("--micro-batches", type=int, metavar="M",
                   help="split each batch into M micro-batches, one update per batch (default: the experiment's "
                        "micro_batches, else 1)")
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b",
                   help="micro-batches in flight: all (gpipe) or --in-flight of them (1f1b, the default); same "
                        "result either way")
    p.add_argument("--in-flight", type=int, metavar="N",
                   help="1f1b: micro-batches in flight at once, 1 to M (default 2, or M if fewer); the driving "
                        "stage holds at most N micro-batches' forward caches; same result whatever N; lockstep only "
                        "(with --staleness S > 0 every micro-batch of a step is sent at once)")
    p.add_argument("--staleness", type=_staleness, metavar="S|auto",
                   help="asynchronous pipelining: S steps in flight; the first stage's forward of step t uses its "
                        "parameters after step t-1-S (default: the experiment's staleness, else 0: lockstep). A "
                        "different, deterministic computation: equal to --in-process with the same S. 'auto' "
                        "(stages in processes): step 1 in lockstep measures the link, then S is the smallest with "
                        "(S+1) x the step time at the bound (the slower of compute and the link's rate) >= round "
                        "trip + transfer time, at most 64 (docs/pipelining.md: --staleness auto); "
                        "the summary's 'staleness' says which, and --staleness S repeats the run exactly")


def _staleness(text: str) -> int | str:
    """``--staleness``: a whole number (checked later with the experiment) or ``auto``."""
    from distgrad.config.experiment import AUTO_STALENESS

    if text == AUTO_STALENESS:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer S >= 0 or '{AUTO_STALENESS}', got {text!r}") from None


def _codec_flags(p: argparse.ArgumentParser) -> None:
    """The wire codecs of activations and gradients (every stage must say the same)."""
    p.add_argument("--activation-codec", metavar="NAME",
                   help="how activations cross the wire: none, float16, bfloat16, int8, topk:K or topk:K+ef "
                        "(default: the experiment's activation_codec, else none); every stage must say the same")
    p.add_argument("--gradient-codec", metavar="NAME",
                   help="how activation gradients cross the wire back up: the same codecs (default: the "
                        "experiment's gradient_codec, else none); every stage must say the same")


def _curve_flags(p: argparse.ArgumentParser) -> None:
    """The CURVE key files of a stage or party (read by ``_curve``)."""
    p.add_argument("--curve-secret", type=Path, metavar="FILE",
                   help="encrypt and authenticate with CURVE using this stage's secret key file (distgrad keygen)")
    p.add_argument("--allow", type=Path, metavar="DIR",
                   help="serving or middle stage with CURVE: accept only clients whose public keys (*.key) are in DIR")
    p.add_argument("--server-key", type=Path, metavar="FILE",
                   help="driving or middle stage with CURVE: the public key file of the stage below")


def build_stage_parser(prog: str = "distgrad-stage") -> argparse.ArgumentParser:
    """The parser of one stage daemon (``distgrad-stage``, or ``distgrad stage`` with ``prog`` so named)."""
    p = argparse.ArgumentParser(prog=prog, description=(
        "Run one stage of an experiment as a daemon. The last stage serves (--bind); the first "
        "drives the training loop (--connect); a middle stage does both. Exit codes: 0 ok, 1 stage failed, 2 usage, "
        "3 peer timeout, 4 peer refused, 5 the data owner's input_guard stopped the run, 130/143 stopped by "
        "SIGINT/SIGTERM."))
    p.add_argument("stage", help="stage name in the experiment (f or g for the built-ins)")
    _common_flags(p, experiment_required=True)
    _pipeline_flags(p)
    _codec_flags(p)
    _watch_flags(p)
    p.add_argument("--bind", metavar="ENDPOINT", help="serve the stage above on this endpoint (tcp://HOST:PORT, tcp://HOST:*, ipc://PATH)")
    p.add_argument("--connect", metavar="ENDPOINT", help="connect to the stage below, serving here")
    _curve_flags(p)
    p.add_argument("--party-keys", type=Path, metavar="DIR",
                   help="a feature party of an experiment with secure_aggregation (with --curve-secret): DIR "
                        "holds NAME.key, the public key, of every other feature party")
    p.add_argument("--client", type=int, metavar="K",
                   help="first stage of an experiment with [clients]: this is data owner K (0, 1, ...)")
    p.add_argument("--keep-serving", action="store_true", help="after a run ends, wait for the next one")
    p.add_argument("--save", type=Path, metavar="PATH",
                   help="when the run completes, write this stage's parameters here (npz for a numpy stage, a "
                        "torch state_dict for a torch stage)")
    p.add_argument("--load", type=Path, metavar="PATH",
                   help="start from the parameters in this file (one --save wrote) instead of the initial values")
    p.add_argument("--ready-file", type=Path, metavar="PATH", help="write the bound endpoint here once listening")
    return p


def build_parser() -> argparse.ArgumentParser:
    """The ``distgrad`` parser: one subcommand per front end, each one's arguments added by its own function.

    ``distgrad stage ...`` is parsed by ``build_stage_parser`` (``main`` hands it the rest of the line); the
    ``stage`` subcommand here only lists it in the help.
    """
    p = argparse.ArgumentParser(prog="distgrad", description="Train one model g(f(x)) across a process boundary.")
    sub = p.add_subparsers(dest="command", required=True)
    _run_arguments(sub.add_parser("run", help="run an experiment: every stage as its own local process"))
    _demo_arguments(sub.add_parser("demo", help="train the seed's reverse-accumulation model over two processes"))
    sub.add_parser("experiments", help="list the built-in experiments")
    _init_arguments(sub.add_parser("init", help="write ready stage files from a CSV (or one CSV per party): each "
                                   "party's folder OUT/NAME/ with NAME.toml and its own columns, NAME.csv",
                                   description=INIT_DESCRIPTION))
    _split_arguments(sub.add_parser("split", help="write each party's folder from a combined experiment: its stage "
                                    "file OUTDIR/STAGE/STAGE.toml and its own data, OUTDIR/STAGE/STAGE.npz"))
    _keygen_arguments(sub.add_parser("keygen", help="write a CURVE key pair DIR/NAME.key and DIR/NAME.key_secret "
                                     "(mode 0600)"))
    _plot_arguments(sub.add_parser("plot", help="draw loss and throughput from a --metrics file into a PNG (needs "
                                   "matplotlib)"))
    _audit_arguments(sub.add_parser("audit", help="attack a run's recorded view of the cut as the other party "
                                    "would: what its --trace says crossed, against the experiment's own labels "
                                    "and inputs"))
    _ping_arguments(sub.add_parser("ping", help="health check: ask a serving stage for its state (exit 0 if it "
                                   "answers)"))
    _predict_arguments(sub.add_parser("predict", help="forward only through live stages: the data owner sends the "
                                      "rows' activations, the label owner writes the predictions on its side"))
    _align_arguments(sub.add_parser("align", help="before training: align the parties' rows by an ID column, "
                                    "privately (each party learns only the IDs all parties hold)",
                                    description=ALIGN_DESCRIPTION))
    stage = sub.add_parser("stage", help="same as distgrad-stage", add_help=False)
    stage.add_argument("args", nargs=argparse.REMAINDER)
    return p


def _log_level_flag(p: argparse.ArgumentParser) -> None:
    """``--log-level``, which every command that runs something takes."""
    p.add_argument("--log-level", default="INFO", choices=LOG_LEVELS)


def _transport_flag(p: argparse.ArgumentParser) -> None:
    """``--transport`` of the commands that launch local stage processes (run, demo)."""
    p.add_argument("--transport", choices=["tcp", "ipc"], default="tcp")


def _run_arguments(run: argparse.ArgumentParser) -> None:
    """``distgrad run``: the stage flags every process gets, plus how the launcher starts and wires them."""
    run.add_argument("experiment", metavar="NAME_OR_PATH", nargs="+",
                     help="a built-in name or experiment file, or every party's stage file (f.toml g.toml)")
    _common_flags(run, experiment_required=False)
    _pipeline_flags(run)
    _codec_flags(run)
    _watch_flags(run)
    _transport_flag(run)
    run.add_argument("--secure", action="store_true",
                     help="encrypt and authenticate the stages' traffic with fresh CURVE keys")
    run.add_argument("--save", type=Path, metavar="DIR",
                     help="when the run completes, write each stage's parameters to DIR/STAGE.npz (numpy) or "
                          "DIR/STAGE.pt (torch state_dict)")
    run.add_argument("--load", type=Path, metavar="DIR",
                     help="start each stage from DIR/STAGE.npz or DIR/STAGE.pt (what --save wrote)")
    run.add_argument("--in-process", action="store_true",
                     help="run all stages in this one process (the reference the wire must match)")


def _demo_arguments(demo: argparse.ArgumentParser) -> None:
    """``distgrad demo``: the seed's model, with only a step count, transport and log level to choose."""
    demo.add_argument("--steps", type=int, metavar="N")
    _transport_flag(demo)
    _log_level_flag(demo)


def _split_arguments(split: argparse.ArgumentParser) -> None:
    """``distgrad split EXPERIMENT OUTDIR``."""
    split.add_argument("experiment", metavar="NAME_OR_PATH")
    split.add_argument("outdir", type=Path, metavar="OUTDIR")
    split.add_argument("--force", action="store_true", help="overwrite files already in OUTDIR")


INIT_DESCRIPTION = (
    "Inspect a CSV (a header line, then the rows) and write each party's stage file beside its own columns "
    "of the rows, ready to train: text columns one-hot, number columns standardised, missing cells filled "
    "with the column's median (each choice said in a comment of the file), a text label (or a few whole "
    "numbers) classified by class name, else regressed, and a default model sized to the data. Two parties "
    "(f the features, g the label) by default; vertical parties with --parties or one CSV per party (joined "
    "on their common ID column). Prints the commands to train, predict and align. Exit codes: 0 ok, 2 a "
    "bad table or argument (nothing written).")


def _init_arguments(init: argparse.ArgumentParser) -> None:
    """``distgrad init TABLE.csv [MORE.csv ...] --label NAME --out DIR``."""
    init.add_argument("tables", type=Path, nargs="+", metavar="TABLE.csv",
                      help="the table, or one CSV per party (each named by its file's name; the one holding the "
                           "label is the label owner's, and its other columns are its own features)")
    init.add_argument("--label", required=True, metavar="COLUMN", help="the header name of the column to predict")
    init.add_argument("--out", type=Path, required=True, metavar="DIR",
                      help="write each party's folder here (DIR/NAME/NAME.toml, DIR/NAME/NAME.csv); refused if DIR "
                           "holds files, unless --force")
    init.add_argument("--parties", nargs="+", metavar="NAME:COL,COL",
                      help="vertical parties of the one table: each party's name and the columns it holds (the "
                           "label owner is g; 'g:COL,...' gives it columns of its own); columns no party names are "
                           "left out")
    init.add_argument("--id-column", metavar="COLUMN",
                      help="the rows' ID column (default: a column named id, row_id, rowid or key, or an unnamed "
                           "first column, with distinct values; with one CSV per party, the one column they all "
                           "hold; else init numbers the rows)")
    init.add_argument("--task", choices=["auto", "classification", "regression"], default="auto",
                      help="auto (default): a text label, or at most 20 distinct whole numbers, is a "
                           "classification, else a regression")
    init.add_argument("--seed", type=int, default=0, metavar="N", help="the run's seed (default 0)")
    init.add_argument("--framework", choices=["numpy", "torch"], default="numpy",
                      help="build every stage's layers in numpy (default) or PyTorch (framework = \"torch\")")
    init.add_argument("--force", action="store_true", help="write into a DIR that already holds files, "
                      "overwriting the files init writes")
    _log_level_flag(init)


def _keygen_arguments(keygen: argparse.ArgumentParser) -> None:
    """``distgrad keygen DIR NAME``."""
    keygen.add_argument("directory", type=Path)
    keygen.add_argument("name")


def _plot_arguments(plot: argparse.ArgumentParser) -> None:
    """``distgrad plot METRICS [--out PNG]``."""
    plot.add_argument("metrics", type=Path)
    plot.add_argument("--out", type=Path, default=Path("loss.png"))


def _audit_arguments(audit: argparse.ArgumentParser) -> None:
    """``distgrad audit EXPERIMENT TRACE``: which steps to attack, how, and what the run was given."""
    audit.add_argument("experiment", metavar="NAME_OR_PATH",
                       help="the run's experiment: a built-in name, an experiment file, or the auditing party's "
                            "stage file (its data supplies the true labels or the raw inputs)")
    audit.add_argument("trace", type=Path, metavar="TRACE", help="the run's --trace file")
    audit.add_argument("--seed", type=int, help="the run's seed, when it was given one (default: the experiment's)")
    audit.add_argument("--steps", metavar="FIRST:LAST", default="1:",
                       help="audit only the traced steps FIRST to LAST (either may be left out; default: all)")
    audit.add_argument("--public-fraction", type=float, default=0.5, metavar="F",
                       help="the share of rows the input decoder is fitted on (default 0.5); it is tested on the rest")
    audit.add_argument("--mlp", action="store_true", help="fit a small MLP decoder too, beside the linear one")
    audit.add_argument("--json", type=Path, metavar="PATH", help="also write the figures to this JSON file")
    audit.add_argument("--micro-batches", type=int, metavar="M",
                       help="the run's --micro-batches, when it was given them (default: the experiment's): "
                            "checked against the batch; every figure is of whole batches, as the live meter's")
    audit.add_argument("--run-steps", type=int, metavar="N",
                       help="the run's --steps, when it was given them (default: the experiment's): a traced step "
                            "past the run's last is refused")
    audit.add_argument("--window", type=int, metavar="W",
                       help="score the figures the live meter reports on the steps the meter scores in windows of W "
                            "steps from FIRST (default: the --steps range as one window when LAST is given, else "
                            "the experiment's meter window), so that a meter window audited alone gives its figures")
    audit.add_argument("--max-trace-bytes", type=int, metavar="BYTES",
                       help="the largest trace file read (default 512 MiB); a larger one is refused")


def _ping_arguments(ping: argparse.ArgumentParser) -> None:
    """``distgrad ping ENDPOINT``: a bounded wait, and the keys to reach a CURVE stage."""
    ping.add_argument("endpoint")
    ping.add_argument("--timeout", type=float, default=2.0, metavar="SECONDS")
    ping.add_argument("--curve-secret", type=Path, metavar="FILE")
    ping.add_argument("--server-key", type=Path, metavar="FILE")


def _predict_arguments(predict: argparse.ArgumentParser) -> None:
    """``distgrad predict``: which stage, its parameters, where it sits in the chain and its rows' in and out."""
    predict.add_argument("experiment", metavar="NAME_OR_PATH", help="this party's stage file (or an experiment)")
    predict.add_argument("--stage", help="which stage this process is (default: the one its stage file defines)")
    predict.add_argument("--load", type=Path, metavar="PATH", required=True,
                         help="the trained parameters of this stage (what --save wrote)")
    predict.add_argument("--connect", metavar="ENDPOINT", help="data owner or middle stage: the stage below")
    predict.add_argument("--client", type=int, metavar="K",
                         help="data owner of an experiment with [clients]: this is client K (0, 1, ...), whose "
                              "--load file (f@K.npz) it predicts with")
    predict.add_argument("--bind", metavar="ENDPOINT", help="label owner or middle stage: serve the stage above")
    predict.add_argument("--input", type=Path, metavar="FILE",
                         help="data owner: the rows to predict (.npy, or .csv read as its csv [data] reads its "
                              "file: header, features by name, id_column); default: its held-out rows. A label "
                              "owner with its own 'bottom': its own columns of those rows, matched by ID (else by "
                              "position)")
    predict.add_argument("--id-column", metavar="NAME_OR_INDEX",
                         help="data owner (or active label owner): the --input CSV's ID column (a header name or "
                              "a 0-based index; default: its [data]'s id_column); its IDs are kept in the label "
                              "owner's output")
    predict.add_argument("--header", action=argparse.BooleanOptionalAction, default=None,
                         help="the --input CSV's first line names its columns (--header) or is a row of data "
                              "(--no-header); default: as its csv [data] declares, else a header only when every "
                              "field of the line is a name (none a number)")
    predict.add_argument("--output", type=Path, metavar="FILE",
                         help="label owner: write the predictions here (.csv whose first column is the rows' IDs or "
                              "numbers, or .npy)")
    predict.add_argument("--output-scores", action="store_true",
                         help="label owner: write each row's scores beside its prediction (class probabilities "
                              "for a classifying loss, else the raw outputs): CSV columns score_0..score_K-1, or "
                              "NAME.scores.npy beside an .npy --output")
    predict.add_argument("--force", action="store_true",
                         help="label owner: overwrite an --output file (and its .scores.npy) already there")
    predict.add_argument("--ready-file", type=Path, metavar="PATH", help="write the bound endpoint here")
    _curve_flags(predict)
    for flag, what in (("--timeout", "how long to wait for one reply before resending (default 5)"),
                       ("--liveness", "a peer silent this long is lost (default 10)"),
                       ("--peer-deadline", "how long to wait for a peer before exiting 3 (default 60)")):
        predict.add_argument(flag, type=float, metavar="SECONDS", help=what)
    _log_level_flag(predict)


ALIGN_DESCRIPTION = (
    "Private ID alignment of vertical parties: every party ends up with its own rows of the IDs that all "
    "parties hold, in one agreed order, and learns no other party's IDs outside that set (docs/security.md). "
    "One party binds (--bind, --parties N), the others connect. Exit codes: 0 ok, 1 no common ID (or fewer "
    "than --min-common), 2 usage or bad input, 3 a peer fell silent, 4 a peer refused us or sent a bad message "
    "(or the parties' aligned IDs differ), 130/143 stopped.")


def _align_arguments(align: argparse.ArgumentParser) -> None:
    """``distgrad align INPUT.csv``: this party's table, its place (coordinator or party), keys and deadlines."""
    align.add_argument("input", type=Path, metavar="INPUT.csv", help="this party's CSV file, with a header row")
    align.add_argument("--id-column", required=True, metavar="NAME", help="the header name of the ID column")
    align.add_argument("--out", type=Path, required=True, metavar="ALIGNED.csv",
                       help="write this party's rows of the common IDs here, in the agreed order (same header and "
                            "columns), once the alignment succeeded")
    align.add_argument("--bind", metavar="ENDPOINT", help="the coordinator: serve the other parties here")
    align.add_argument("--connect", metavar="ENDPOINT", help="another party: the coordinator's endpoint")
    align.add_argument("--parties", type=int, metavar="N",
                       help="how many parties align, the coordinator included (needed with --bind; checked when "
                            "given with --connect)")
    align.add_argument("--name", metavar="PARTY", help="this party's name in log lines and errors (default: "
                       "'coordinator' for the coordinator, party-PID for the others)")
    align.add_argument("--ready-file", type=Path, metavar="PATH", help="coordinator: write the bound endpoint here")
    _curve_flags(align)
    align.add_argument("--party-keys", type=Path, metavar="DIR",
                       help="a party with CURVE: the other parties' public keys (*.key); their digests must then "
                            "be tagged by those keys, so the coordinator cannot relay one a party did not send")
    align.add_argument("--min-common", type=int, metavar="N",
                       help="refuse (exit 1, no file) when fewer than N IDs are common (default 10)")
    align.add_argument("--peer-deadline", type=float, metavar="SECONDS",
                       help="give up on a peer silent this long, and (coordinator) on parties that have not all "
                            "joined by then; exit 3 (default 60)")
    align.add_argument("--liveness", type=float, metavar="SECONDS",
                       help="ZMTP heartbeat timeout of the connections (default 10)")
    _log_level_flag(align)


def _setup_logging(level: str) -> None:
    """Log lines with time, level and logger name on stderr (stdout carries the results)."""
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)


def _run_stage(args: argparse.Namespace) -> int:
    """``distgrad stage``: check the flags against the stage's role, build its ``StageOptions``, then serve or
    drive until the run ends."""
    from distgrad.run.driver import drive_first_stage
    from distgrad.run.launcher import check_data
    from distgrad.run.options import PARENT_PID_ENV, StopFlag, check_outputs
    from distgrad.run.serving import serve

    exp = _load_experiment(args)
    role = exp.check_role(args.stage, binds=args.bind is not None, connects=args.connect is not None)
    serving = args.bind is not None
    if serving and (args.micro_batches is not None or args.schedule != "1f1b" or args.in_flight is not None
                    or args.eval_every is not None or args.staleness is not None):
        raise ConfigError("--micro-batches, --schedule, --in-flight, --staleness and --eval-every are for the "
                          "driving stage (the others follow its hello)")
    opts = _stage_options(exp, args.stage, args, driving=not serving, client=args.client, summary=args.summary,
                          progress=_progress_mode(args.progress), save_path=args.save, load_path=args.load,
                          privacy_meter=args.privacy_meter)
    if not serving and (args.keep_serving or args.ready_file or args.allow):
        raise ConfigError("--keep-serving, --ready-file and --allow are for a serving stage")
    if args.ready_file is not None:
        check_outputs([("--ready-file", args.ready_file)])     # before binding, not once bound
    if not args.connect and args.server_key:
        raise ConfigError("--server-key is for a stage that connects (--connect)")
    check_data(exp, opts.seed, [args.client], [args.stage])     # a bad data file exits 2 before any peer comes
    ctx = _zmq_context()
    with _security(args, role, ctx) as (upstream, downstream):
        opts.security = upstream if serving else downstream
        opts.downstream_security = downstream
        stop = StopFlag().install()
        parent = os.environ.get(PARENT_PID_ENV, "")
        if parent.isdigit():            # a stage of ``distgrad run`` stops when its launcher dies
            stop.stop_with_parent(int(parent))
        if serving:
            serve(opts, args.bind, stop, args.connect, args.keep_serving, args.ready_file, ctx)
        else:
            drive_first_stage(opts, args.connect, stop, ctx)
    return EXIT_OK


def _load_experiment(args: argparse.Namespace) -> Experiment:
    """The experiment the flags name (``--experiment``, or ``distgrad run``'s files), with the wire codecs of
    ``--activation-codec`` / ``--gradient-codec``; ``ConfigError`` for a bad one."""
    from distgrad.config.parse import load_experiment

    return load_experiment(args.experiment).with_codecs(args.activation_codec, args.gradient_codec)


class _Waits(TypedDict):
    """The bounded waits of a stage, in seconds (``StageOptions``' fields of the same names)."""

    timeout_s: float
    liveness_s: float
    peer_deadline_s: float


def _waits(args: argparse.Namespace) -> _Waits:
    """``timeout_s``, ``liveness_s`` and ``peer_deadline_s`` (seconds) from ``--timeout``, ``--liveness`` and
    ``--peer-deadline``, each the default where the flag is not given."""
    from distgrad.run.options import DEFAULT_LIVENESS_S, DEFAULT_PEER_DEADLINE_S
    from distgrad.wire.transport import DEFAULT_TIMEOUT_S

    return _Waits(timeout_s=DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout,
                  liveness_s=DEFAULT_LIVENESS_S if args.liveness is None else args.liveness,
                  peer_deadline_s=DEFAULT_PEER_DEADLINE_S if args.peer_deadline is None else args.peer_deadline)


def _zmq_context() -> zmq.Context:
    """The process's one ZeroMQ context (zmq is imported here, after the BLAS pools are pinned)."""
    import zmq

    return zmq.Context.instance()


def _stage_options(exp: Experiment, stage: str, args: argparse.Namespace, *, driving: bool, client: int | None,
                   summary: Path | None, privacy_meter: bool, progress: str = "off", save_path: Path | None = None,
                   load_path: Path | None = None) -> StageOptions:
    """The validated ``StageOptions`` of stage ``stage`` from the stage flags (``distgrad stage`` or ``distgrad
    run``, which share them); ``ConfigError`` (exit 2) for a bad value. Only a driving stage takes the
    pipeline flags (micro-batches, schedule, in flight, staleness, evaluations): the others follow its hello.
    """
    from distgrad.config.parse import parse_init_overrides
    from distgrad.run.options import StageOptions
    from distgrad.stage.records import parse_trace_params

    pipeline = (dict(micro_batches=exp.micro_batches if args.micro_batches is None else args.micro_batches,
                     schedule=args.schedule, in_flight=args.in_flight, staleness=args.staleness,
                     eval_every=args.eval_every) if driving
                else dict(micro_batches=exp.micro_batches, schedule="1f1b", in_flight=None, staleness=None,
                          eval_every=None))
    return StageOptions(
        exp, stage, exp.seed if args.seed is None else args.seed, parse_init_overrides(args.init),
        args.steps, summary, args.trace, parse_trace_params(args.trace_params), args.trace_every, **_waits(args),
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every or 0, resume=args.resume,
        **pipeline, metrics_path=args.metrics, tensorboard_dir=args.tensorboard, progress=progress, client=client,
        spin_s=0.0 if args.spin_us is None else args.spin_us * 1e-6, save_path=save_path, load_path=load_path,
        privacy_meter=privacy_meter, party_keys=getattr(args, "party_keys", None))


@contextlib.contextmanager
def _security(args: argparse.Namespace, role: str,
              ctx: zmq.Context) -> Iterator[tuple[CurveServer | None, CurveClient | None]]:
    """``_curve``'s settings for the duration of a command; the server side's authenticator is stopped on the
    way out, whatever happens."""
    from distgrad.wire.keys import CurveServer

    server, client = _curve(args, role, ctx)
    try:
        yield server, client
    finally:
        if isinstance(server, CurveServer):
            server.stop()


def _curve(args: argparse.Namespace, role: str, ctx: zmq.Context) -> tuple[CurveServer | None, CurveClient | None]:
    """CURVE settings from the key flags: (for the socket serving upstream, for the one connecting
    downstream), None where a stage has no such socket or runs in plaintext.

    A middle stage uses its one key pair on both sockets.
    """
    from distgrad.wire.keys import CurveClient, CurveServer

    needed = {"serving": ["--curve-secret", "--allow"], "driving": ["--curve-secret", "--server-key"],
              "middle": ["--curve-secret", "--allow", "--server-key"]}[role]
    given = {"--curve-secret": args.curve_secret, "--allow": getattr(args, "allow", None),
             "--server-key": args.server_key}
    if not any(given[flag] for flag in needed):
        return None, None
    if not all(given[flag] for flag in needed):
        raise ConfigError(f"CURVE needs {' and '.join(needed)} together")
    server = CurveServer(ctx, args.curve_secret, args.allow) if role != "driving" else None
    client = CurveClient(args.curve_secret, args.server_key) if role != "serving" else None
    return server, client


def _run_experiment(args: argparse.Namespace) -> int:
    """``distgrad run``: check every setting before any stage starts, then train in this process or launch
    one process per stage, and print the result. Each warning of the checks is said once, though several
    parts of the command check the run (``each_warning_once``)."""
    from distgrad.config.horizons import each_warning_once

    exp = _load_experiment(args)
    if args.micro_batches is None:
        args.micro_batches = exp.micro_batches
    in_process = args.in_process or len(exp.stage_names) == 1
    with each_warning_once():
        _check_run(exp, args, in_process)
        summary = _train_here(exp, args) if in_process else _launch(exp, args)
    _print_result(summary)
    return EXIT_OK


def _check_run(exp: Experiment, args: argparse.Namespace, in_process: bool) -> None:
    """Every setting of ``distgrad run``, checked here, before any stage starts, so a bad one exits 2 with the
    reason (``ConfigError``); a run in processes also as each stage process would check its own."""
    from distgrad.config.defended import check_meter_flag
    from distgrad.config.experiment import check_run_settings
    from distgrad.config.parse import parse_init_overrides
    from distgrad.run.options import check_in_flight, check_outputs
    from distgrad.run.progress import check_tensorboard
    from distgrad.stage.records import check_trace_filter, parse_trace_params
    from distgrad.wire.transport import check_spin

    check_run_settings(exp, steps=args.steps, seed=args.seed, micro_batches=args.micro_batches,
                       init=parse_init_overrides(args.init), checkpoint_dir=args.checkpoint_dir,
                       checkpoint_every=args.checkpoint_every, resume=args.resume, in_process=in_process,
                       eval_every=args.eval_every, staleness=args.staleness)
    # Checked with --in-process too, although one process has nothing in flight: the same command line
    # must be valid either way, and the result does not depend on it.
    check_in_flight(args.in_flight, args.micro_batches, args.schedule,
                    exp.staleness if args.staleness is None else args.staleness)
    if args.spin_us is not None:
        check_spin(args.spin_us * 1e-6)
    for flag, given in (("--metrics", args.metrics), ("--tensorboard", args.tensorboard)):
        if given is not None and in_process:
            raise ConfigError(f"{flag} is written by the stage processes of a run in processes; --in-process "
                              f"writes none (drop --in-process or {flag}; the summary holds the losses and "
                              f"evaluations)")
    if args.tensorboard is not None:
        check_tensorboard()
    if args.privacy_meter:
        check_meter_flag(exp)
    check_outputs([("--summary", args.summary), ("--trace", args.trace), ("--metrics", args.metrics)],
                  [("an experiment or stage file", path) for path in args.experiment])
    if in_process:
        _say_wire_flags_unused(args)
    else:
        _check_stage_processes(exp, args)
        trace_params = parse_trace_params(args.trace_params)
        check_trace_filter(trace_params, args.trace_every, exp.known_param_names(trace_params, args.seed),
                           args.trace is not None)


def _say_wire_flags_unused(args: argparse.Namespace) -> None:
    """A run in one process has no sockets: the flags of the stages' link, given, are said to do nothing (a
    WARNING naming them), not refused, so that one command line runs either way."""
    unused = [flag for flag, given in (("--transport ipc", args.transport == "ipc"), ("--secure", args.secure),
                                       ("--timeout", args.timeout is not None),
                                       ("--liveness", args.liveness is not None),
                                       ("--peer-deadline", args.peer_deadline is not None),
                                       ("--spin-us", args.spin_us is not None)) if given]
    if unused:
        logging.getLogger("distgrad").warning(
            "%s: a run in one process has no sockets between its stages, so %s nothing here (the run is the "
            "same computation as in processes)", ", ".join(unused), "these do" if len(unused) > 1 else "it does")


def _train_here(exp: Experiment, args: argparse.Namespace) -> dict[str, Any]:
    """``distgrad run --in-process`` (or a one-stage experiment): every stage in this process; its summary."""
    from distgrad.config.parse import parse_init_overrides
    from distgrad.run.inprocess import train_in_process
    from distgrad.run.options import StopFlag
    from distgrad.stage.records import parse_trace_params

    return train_in_process(exp, args.steps, args.seed, parse_init_overrides(args.init),
                            args.summary, args.trace, args.micro_batches,
                            parse_trace_params(args.trace_params), args.trace_every, args.eval_every,
                            save_dir=args.save, load_dir=args.load, staleness=args.staleness,
                            privacy_meter=args.privacy_meter, check_stop=StopFlag().install().check)


def _launch(exp: Experiment, args: argparse.Namespace) -> dict[str, Any]:
    """``distgrad run``: one local process per stage (``run_local``), stopped by SIGINT/SIGTERM; the merged
    summary."""
    from distgrad.run.launcher import run_local
    from distgrad.run.options import StopFlag

    stop = StopFlag().install()
    return run_local(args.experiment[0] if len(args.experiment) == 1 else args.experiment,
                     steps=args.steps, seed=args.seed, init=args.init,
                     summary_path=args.summary, trace_path=args.trace, metrics_path=args.metrics,
                     tensorboard_dir=args.tensorboard, transport=args.transport,
                     timeout_s=args.timeout, log_level=args.log_level, check_stop=stop.check,
                     stage_flags=_passthrough(args), secure=args.secure, driver_flags=_driver_flags(args),
                     progress_bar=_progress_mode(args.progress) == "bar", save_dir=args.save,
                     load_dir=args.load, activation_codec=args.activation_codec,
                     gradient_codec=args.gradient_codec, privacy_meter=args.privacy_meter)


def _driver_flags(args: argparse.Namespace) -> list[str]:
    """The pipeline flags of ``distgrad run`` that go to the driving stage processes only."""
    flags = ["--micro-batches", str(args.micro_batches), "--schedule", args.schedule]
    for flag, value in (("--in-flight", args.in_flight), ("--eval-every", args.eval_every),
                        ("--staleness", args.staleness)):
        if value is not None:
            flags += [flag, str(value)]
    return flags


def _check_stage_processes(exp: Experiment, args: argparse.Namespace) -> None:
    """Check the settings each stage process of ``distgrad run`` would get as that process checks them
    (``StageOptions``), so what a stage would refuse (exit 2) is refused here, with its reason, before any
    stage starts. ``ConfigError`` naming the process."""
    from distgrad.config.defended import metered
    from distgrad.run.launcher import stage_processes

    for label, stage, client, driving in stage_processes(exp):
        try:
            _stage_options(exp, stage, args, driving=driving, client=client, summary=None,
                           privacy_meter=args.privacy_meter and metered(exp, stage, True))
        except ConfigError as e:
            raise ConfigError(f"stage process {label}: {e}") from e


def _progress_mode(choice: str) -> str:
    """``auto`` is a bar when stderr is a terminal, else plain log lines."""
    if choice != "auto":
        return choice
    return "bar" if sys.stderr.isatty() else "off"


def _passthrough(args: argparse.Namespace) -> list[str]:
    """The reliability flags of ``distgrad run``, to hand to every stage as they are.

    Both stages may share one checkpoint directory: file names carry the stage.
    """
    flags = []
    for option in ("liveness", "peer_deadline", "spin_us", "checkpoint_dir", "checkpoint_every", "trace_params"):
        value = getattr(args, option)
        if value is not None:
            flags += [f"--{option.replace('_', '-')}", str(value)]
    if args.trace_every != 1:
        flags += ["--trace-every", str(args.trace_every)]
    if args.resume:
        flags.append("--resume")
    return flags


# Printed when keep_best or early_stopping chose on the held-out rows whose figures are reported as the test ones.
SELECTED_ON_TEST_ROWS = ("note: keep_best / early_stopping chose on the same held-out rows these test figures are "
                         "measured on, so they are optimistic; set validation_fraction in [data] to choose on "
                         "validation rows and score the test rows once, with the kept model")


def _print_result(summary: dict) -> None:
    """The run's headline, each client's line (several clients) or the test scores, the privacy meters' last
    windows, and the parameters."""
    _print_headline(summary)
    _print_held_out(summary)
    if "best_step" in summary:
        print(f"keep_best: the best evaluation was after step {summary['best_step']} (--save writes its parameters)")
    if "stopped_early" in summary:
        print(f"early stopping: the run ended after step {summary['stopped_early']}")
    if ("best_step" in summary or "stopped_early" in summary) and "validation_loss" not in summary:
        print(SELECTED_ON_TEST_ROWS)
    if "privacy" in summary:
        from distgrad.config.defended import budget_text
        print(f"privacy: {budget_text(summary['privacy'])}")
    for stage, params in summary["params"].items():
        for name, value in params.items():
            text = str(value) if len(str(value)) <= 72 else str(value)[:69] + "..."
            print(f"  {stage}.{name} = {text}")
    _print_kept_test(summary)


def _print_kept_test(summary: dict) -> None:
    """With a validation split, the last line: the kept model's test figures and the step it comes from (with
    several clients, one such line per client, each client's kept model)."""
    from distgrad.stage.records import scores_text

    for fields in [summary, *summary.get("clients", [])]:
        if "test_step" not in fields or "test_loss" not in fields:
            continue
        whose = f" of client {fields['client']}" if "client" in fields else ""
        accuracy = f"test accuracy {fields['test_accuracy']:.4f}, " if "test_accuracy" in fields else ""
        others = scores_text({k: v for k, v in fields.items() if k.startswith("test_") and k != "test_accuracy"})
        print(f"kept model{whose}, after step {fields['test_step']} (chosen on {fields.get('validation_count', '?')} "
              f"validation rows): {accuracy}test loss {_number(fields['test_loss'])} on {fields['test_count']} test "
              f"rows{others}")


def _print_headline(summary: dict) -> None:
    """The run's steps, time, mode and final loss (several clients: each client's line), then the privacy
    meters' last windows."""
    from distgrad.run.metering import extremes_text, figures_text
    from distgrad.stage.records import scores_text

    head = f"{summary['experiment']}: {summary['steps']} steps in {summary['elapsed_s']:.3f} s " \
           f"({summary.get('mode', 'two-process')})"
    if "clients" in summary:        # several clients: no loss belongs to the whole run
        print(f"{head}, {len(summary['clients'])} clients")
    else:
        withheld = summary.get("final_loss") is None and isinstance(summary.get("training_loss"), str)
        print(f"{head}, final loss {summary['training_loss'] if withheld else _number(summary['final_loss'])}")
    for client in summary.get("clients", []):
        accuracy = scores_text(client)     # test accuracy and the label owner's other metrics
        loss = "none" if client.get("final_loss") is None else _number(client["final_loss"])
        status = "" if client.get("status", "completed") == "completed" else f" ({client['status']})"
        print(f"  client {client['client']}: final loss {loss}{accuracy}{status}")
    # One data owner: its fields at the top; several (clients, feature parties): by data owner.
    owned = [("", summary)] + [(f" ({owner})", fields) for key in ("input_meters", "label_meters")
                               for owner, fields in summary.get(key, {}).items()]
    for owner, fields in owned:
        for key, party in (("input_leaks", "data owner's inputs"), ("label_leaks", "label owner's labels")):
            if fields.get(key):
                print(f"privacy meter, {party}{owner} after step {fields[key][-1]['step']}: "
                      f"{figures_text(fields[key][-1])}")
            extreme = fields.get(key.replace("_leaks", "_leak_extremes"))
            if extreme:
                print(f"privacy meter, {party}{owner}, worst window and whole run: {extremes_text(extreme)}")
        guard = fields.get("input_guard")
        if guard and "peak_r2" in guard:
            print(f"input_guard{owner}: highest R^2 {guard['peak_r2']:.3f} at step {guard['peak_step']} "
                  f"(max_r2 {guard['max_r2']:g}, judged after step {guard['after']})")


def _print_held_out(summary: dict) -> None:
    """The held-out scores of the model kept: with keep_best the best evaluation's (the one --save writes),
    with the last step's accuracy beside it; else the last step's."""
    from distgrad.stage.records import scores_text

    if "validation_loss" in summary:          # a validation split: the kept model's test line comes last
        fields = summary.get("best_evaluation", summary)
        kept = f" of the kept model, after step {fields['step']}" if "step" in fields else ""
        validation = {k: v for k, v in fields.items() if k.startswith("validation_")}   # the test rows' come last
        print(f"validation loss {_number(fields['validation_loss'])} on {summary['validation_count']} validation "
              f"rows{kept}{scores_text(validation)}")
        return
    best = summary.get("best_evaluation")
    scored = best if best is not None else summary
    of_model = f" of the kept model, after step {best['step']}" if best is not None else ""
    if "test_accuracy" in scored:
        last = (f"; after the last step, {summary['steps']}: {summary['test_accuracy']:.4f}"
                if best is not None and "test_accuracy" in summary else "")
        print(f"test accuracy {scored['test_accuracy']:.4f} on {summary['test_count']} held-out rows "
              f"(test loss {_number(scored['test_loss'])}){of_model}{last}")
    others = scores_text({k: v for k, v in scored.items() if k != "test_accuracy"})
    if others:
        print(f"held-out scores{of_model}: {others[2:]}")


def _number(value: Any) -> str:
    """A summary's figure for a line of text: a number, or a non-finite one's text ("nan", "inf")."""
    return f"{value:.6g}" if isinstance(value, (int, float)) else str(value)


def _demo(args: argparse.Namespace) -> int:
    """``distgrad demo``: the seed's model over two processes; exit 1 unless both weights reach +-1 together."""
    from distgrad.run.options import StopFlag
    from distgrad.run.launcher import run_local

    stop = StopFlag().install()
    print("distgrad demo: the seed's reverse accumulation, f and g in two processes over ZeroMQ", flush=True)
    summary = run_local("seed-reverse", steps=args.steps, transport=args.transport, log_level=args.log_level,
                        check_stop=stop.check, progress_bar=sys.stdout.isatty())
    f_w, g_w = summary["params"]["f"]["fW"][0], summary["params"]["g"]["gW"][0]
    print(f"final fW = {f_w:.8f}  gW = {g_w:.8f}  loss = {summary['final_loss']:.8g}  "
          f"({summary['steps']} steps, {summary['elapsed_s']:.2f} s)")
    if (f_w > 0) == (g_w > 0) and abs(abs(f_w) - 1) < 0.05 and abs(abs(g_w) - 1) < 0.05:
        print(f"both weights reached {'+1' if f_w > 0 else '-1'} with the same sign, so g(f(x)) = x, as the seed says")
        return EXIT_OK
    print("the weights did not converge to +-1 together (try more --steps)")
    return EXIT_FAILED


def _list_experiments() -> int:
    """``distgrad experiments``: each built-in's name, stages, steps and description, wrapped to the terminal."""
    from distgrad.config.experiment import builtin_names
    from distgrad.config.parse import load_experiment

    width = max(40, shutil.get_terminal_size((100, 24)).columns - 1)
    for name in builtin_names():
        exp = load_experiment(name)
        print(f"{name}: {len(exp.stage_names)} stage(s), {exp.steps} steps")
        description = " ".join(str(exp.raw.get("description", "")).split())
        for line in textwrap.wrap(description, width=width - 4, break_long_words=False, break_on_hyphens=False):
            print("    " + line)
    return EXIT_OK


def _predict(args: argparse.Namespace) -> int:
    """``distgrad predict``: check the flags against this stage's role, then send the rows (the data owner) or
    serve them (the label owner writes the predictions; a middle stage passes them on)."""
    from distgrad.config.parse import load_experiment
    from distgrad.run.options import StopFlag

    exp = load_experiment(args.experiment)
    stage, role, own = _predict_role(exp, args)
    ctx = _zmq_context()
    with _security(args, role, ctx) as (upstream, downstream):
        opts = _predict_options(exp, stage, role, args, downstream, ctx)
        opts.security = upstream if role != "driving" else downstream
        opts.downstream_security = downstream
        stop = StopFlag().install()
        if role == "driving":
            _send_predictions(exp, stage, opts, args, stop, ctx)
        else:
            _serve_predictions(exp, stage, opts, args, stop, ctx, own)
    return EXIT_OK


def _predict_options(exp: Experiment, stage: str, role: str, args: argparse.Namespace, downstream: Any,
                     ctx: zmq.Context) -> Any:
    """The ``StageOptions`` of a ``distgrad predict`` process. A data owner whose options fail (a damaged or
    missing --load, a --client it cannot be) tells the stage below first (``predict.tell_below``), which
    would otherwise wait out its deadline; the error is raised."""
    from distgrad.run.options import StageOptions
    from distgrad.run.predict import tell_below
    from distgrad.wire.link import LinkSettings

    waits = _waits(args)
    try:
        return StageOptions(exp, stage, exp.seed, load_path=args.load, trains=False, client=args.client, **waits)
    except DistgradError as e:
        if role == "driving":
            link = LinkSettings(stage, waits["timeout_s"], waits["liveness_s"], waits["peer_deadline_s"],
                                relays=exp.relays_below(stage))
            tell_below(link, downstream, stage, args.connect, str(e), ctx)
        raise


def _predict_role(exp: Experiment, args: argparse.Namespace) -> tuple[str, str, bool]:
    """``(stage, role, holds rows)`` of a ``distgrad predict`` process: the stage it is, driving, middle or
    serving, and whether it reads rows of its own (the data owner; a label owner with its own 'bottom').
    ``ConfigError`` for a flag its role does not take."""
    stage = args.stage or (exp.stages[0].name if len(exp.stages) == 1 else None)
    if stage is None:
        raise ConfigError(f"{args.experiment} defines stages {exp.stage_names}: give --stage NAME")
    role = exp.check_role(stage, binds=args.bind is not None, connects=args.connect is not None)
    own = role == "serving" and exp.own_bottom      # an active label owner holds its own columns of the rows
    if role != "driving" and not own and (args.input is not None or args.id_column is not None
                                          or args.header is not None):
        raise ConfigError("--input, --id-column and --header are for the data owner (the first stage), which alone "
                          "holds the rows (and a label owner with its own 'bottom', for its own columns)")
    if (args.id_column is not None or args.header is not None) and args.input is None:
        raise ConfigError(f"{'--id-column' if args.id_column is not None else '--header'} is about the --input "
                          f"CSV: give --input FILE.csv")
    if args.output_scores and role == "driving":
        raise ConfigError("--output-scores is for the label owner (the last stage), which alone computes the "
                          "predictions and their scores")
    if args.force and (role == "driving" or args.output is None):
        raise ConfigError("--force lets the label owner overwrite its --output file; give it with --output (the "
                          "data owner and a middle stage write no file)")
    if role == "driving" and (args.output is not None or args.ready_file is not None):
        flag = "--output" if args.output is not None else "--ready-file"
        raise ConfigError(f"{flag} is for a stage that serves (--bind): the label owner writes the predictions "
                          f"(--output) and a serving stage its endpoint (--ready-file); the data owner (--connect) "
                          f"sends its rows and keeps nothing of the predictions")
    return stage, role, own


def _predict_rows(exp: Experiment, stage: str, seed: int, args: argparse.Namespace) -> Any:
    """The rows this party predicts for: the ``--input`` file (its ID column a name, or a 0-based index given
    in digits), else the stage's held-out rows."""
    from distgrad.run.predict import held_out_rows, read_rows

    if args.input is None:
        return held_out_rows(exp, stage, seed, args.load)
    id_column = args.id_column
    if id_column is not None and id_column.isdigit():
        id_column = int(id_column)
    return read_rows(args.input, exp, stage, id_column, args.header, args.load)


def _send_predictions(exp: Experiment, stage: str, opts: StageOptions, args: argparse.Namespace, stop: Any,
                      ctx: zmq.Context) -> None:
    """The data owner's side of ``distgrad predict``: send its rows' activations to the stage below. On an
    error of ours the stage below is told (it would otherwise wait out its deadline); the error is raised."""
    from distgrad.run.predict import send_abort_notice, send_predictions

    try:
        rows = _predict_rows(exp, stage, opts.seed, args)
    except DistgradError as e:      # tell the stage below, which would otherwise wait out its deadline
        send_abort_notice(opts, args.connect, str(e), ctx)
        raise
    count = send_predictions(opts, args.connect, rows, stop, ctx)      # tells the stage below itself on an error
    print(f"sent {count} rows; the label owner holds their predictions")


def _serve_predictions(exp: Experiment, stage: str, opts: StageOptions, args: argparse.Namespace, stop: Any,
                       ctx: zmq.Context, own: bool) -> None:
    """A label owner's (or middle stage's) side of ``distgrad predict``: serve the stage above until it is
    done; the label owner writes the predictions to ``--output``."""
    from distgrad.run.predict import serve_predictions

    own_rows = _predict_rows(exp, stage, opts.seed, args) if own else None
    count = serve_predictions(opts, args.bind, args.output, stop, args.connect, args.ready_file, ctx,
                              args.output_scores, own_rows, args.force)
    print(f"wrote {count} predictions to {args.output}" if args.output else f"passed on {count} rows")


def _align(args: argparse.Namespace) -> int:
    """``distgrad align``: this party's table read (a bad one exits 2 before anything connects), then aligned."""
    from distgrad.align import (DEFAULT_LIVENESS_S, DEFAULT_MIN_COMMON, DEFAULT_PEER_DEADLINE_S, AlignOptions, align,
                                read_table)
    from distgrad.run.options import StopFlag

    if args.bind is not None and args.server_key:
        raise ConfigError("--server-key is for a party that connects (--connect)")
    if args.connect is not None and args.allow:
        raise ConfigError("--allow is for the coordinator (--bind)")
    opts = AlignOptions(args.input, args.id_column, args.out, bind=args.bind, parties=args.parties,
                        connect=args.connect, name=args.name, ready_file=args.ready_file,
                        peer_deadline_s=DEFAULT_PEER_DEADLINE_S if args.peer_deadline is None else args.peer_deadline,
                        liveness_s=DEFAULT_LIVENESS_S if args.liveness is None else args.liveness,
                        min_common=DEFAULT_MIN_COMMON if args.min_common is None else args.min_common,
                        party_keys=args.party_keys)
    table = read_table(opts.input, opts.id_column)     # a bad file exits 2 before anything connects
    ctx = _zmq_context()
    with _security(args, "serving" if args.bind is not None else "driving", ctx) as (server, client):
        stop = StopFlag().install()
        result = align(opts, table, security=server or client, check_stop=stop.check, ctx=ctx)
    print(f"aligned {result.common} common IDs of this party's {result.rows} rows ({result.parties} parties) "
          f"into {result.out}")
    return EXIT_OK


def _init(args: argparse.Namespace) -> int:
    """``distgrad init``: the tables inspected, each party's folder written, the choices and commands printed."""
    from distgrad.config.scaffold import init_parties

    result = init_parties(args.tables, args.label, args.out, parties=args.parties or (), id_column=args.id_column,
                          task=args.task, seed=args.seed, framework=args.framework,
                          force=args.force)
    for path in result.paths:
        print(f"wrote {path} (and {path.with_suffix('.csv').name} beside it)")
    print("\n".join(f"- {note}" for note in result.notes))
    print("\n".join(result.commands))
    return EXIT_OK


def _split(args: argparse.Namespace) -> int:
    """``distgrad split``: each party's stage file and data, written into OUTDIR."""
    from distgrad.config.parse import load_experiment
    from distgrad.config.split import split_experiment

    exp = load_experiment(args.experiment)
    for path in split_experiment(exp, args.outdir, args.force):
        print(f"wrote {path}")
    return EXIT_OK


def _keygen(args: argparse.Namespace) -> int:
    """``distgrad keygen``: a CURVE key pair, the secret file private (mode 0600)."""
    from distgrad.wire.keys import keygen

    public, secret = keygen(args.directory, args.name)
    print(f"public key {public}\nsecret key {secret} (keep it private; mode 0600)")
    return EXIT_OK


def _plot(args: argparse.Namespace) -> int:
    """``distgrad plot``: a metrics file drawn into a PNG."""
    from distgrad.plot import plot_metrics

    print(f"wrote {plot_metrics(args.metrics, args.out)}")
    return EXIT_OK


def _audit(args: argparse.Namespace) -> int:
    """``distgrad audit``: the step range and output checked, the trace attacked, the figures printed (and written)."""
    from distgrad.run.auditing import DEFAULT_MAX_TRACE_BYTES, audit_text, run_audit
    from distgrad.run.options import check_not_read
    from distgrad.stage.records import write_json

    try:
        first_text, last_text = args.steps.split(":")
        first, last = int(first_text or 1), (int(last_text) if last_text else None)
    except ValueError:
        raise ConfigError(f"--steps must be FIRST:LAST (whole numbers, either may be left out), got {args.steps!r}")
    if args.json is not None and args.json.is_dir():
        raise ConfigError(f"--json {args.json} is a directory: name the file to write")
    check_not_read([("--json", args.json)], [("the trace", args.trace), ("the experiment", args.experiment)])
    max_bytes = DEFAULT_MAX_TRACE_BYTES if args.max_trace_bytes is None else args.max_trace_bytes
    report = run_audit(args.experiment, args.trace, args.seed, first, last, args.public_fraction, args.mlp,
                       args.micro_batches, args.run_steps, max_bytes, args.window)
    print(audit_text(report))
    if args.json is not None:
        try:
            write_json(args.json, report)
        except OSError as e:
            raise ConfigError(f"--json {args.json} cannot be written: {e.strerror or e}") from None
    return EXIT_OK


def _ping(args: argparse.Namespace) -> int:
    """``distgrad ping``: one bounded request; the serving stage's state printed as ``key=value`` pairs."""
    from distgrad.run.options import check_wait
    from distgrad.wire import messages as wire
    from distgrad.wire.transport import Client

    check_wait("--timeout", args.timeout)       # an infinite or NaN one waited for ever on a silent endpoint
    ctx = _zmq_context()
    security = _curve(args, "driving", ctx)[1] if (args.curve_secret or args.server_key) else None
    client = Client(ctx, args.endpoint, security=security)
    try:
        pong = client.request(wire.Message(wire.PING, "", 0), args.timeout)
    finally:
        client.close(linger_ms=0)
    print(" ".join(f"{key}={value}" for key, value in sorted(pong.body.items())))
    return EXIT_OK


def _guarded(fn: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command's handler; a ``DistgradError`` or a signal becomes its exit code and one log line, not a
    traceback."""
    log = logging.getLogger("distgrad")
    try:
        return fn(args)
    except Interrupted as e:
        log.warning("%s; stopped cleanly", e)
        return _exit_code(e)
    except KeyboardInterrupt:
        log.warning("interrupted")
        return 130
    except DistgradError as e:
        log.error("%s", e)
        return _exit_code(e)
    except BrokenPipeError:
        # The reader of our output went away (``distgrad experiments | head``): stop quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except OSError as e:
        # A file that could not be written or read (disk full, a read-only folder) where no writer named
        # it (``OutputWriteError`` does): still one line, with the traceback at --log-level DEBUG.
        log.debug("the failed operation", exc_info=True)
        log.error("%s", e)
        return EXIT_FAILED


def stage_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``distgrad-stage``."""
    args = build_stage_parser().parse_args(argv)
    _setup_logging(args.log_level)
    return _guarded(_run_stage, args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``distgrad``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["stage"]:
        args = build_stage_parser("distgrad stage").parse_args(argv[1:])
        _setup_logging(args.log_level)
        return _guarded(_run_stage, args)
    args = build_parser().parse_args(argv)
    _setup_logging(getattr(args, "log_level", "INFO"))
    return _guarded(COMMANDS[args.command], args)


# Each subcommand's handler: it builds a validated configuration from the flags (``ConfigError``, exit 2, for a bad
# one) and calls the Python API; ``_guarded`` maps what it raises to the exit code.
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": _run_experiment, "demo": _demo, "experiments": lambda args: _list_experiments(), "init": _init, "split": _split,
    "predict": _predict, "align": _align, "keygen": _keygen, "ping": _ping, "plot": _plot, "audit": _audit}


if __name__ == "__main__":
    sys.exit(main())
