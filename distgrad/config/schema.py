"""The keys of experiment and stage files, each declared once: its type and range, who may set it, its
default and its meaning.

A declaration (``Key``, ``distgrad.config.keys``) drives everything about its key: the parser (``distgrad.config.parse``) accepts exactly
the keys of these tables (``keys.refuse_unknown``), reads each through its declaration (``keys.read_keys``: the value's
check, the default of an absent key, the error naming the key, what it must be and the value given), and the
format reference (docs/stage-files.md, written by ``distgrad.config.reference``) is generated from the same
tables, so the three cannot drift apart. What a key's value means next to *other* keys (a 'scheduler' needs a
torch stage, 'activation' holds one table per cut) is the parser's, which names the rule it checks; a key
whose form depends on other keys has no ``check`` and names what checks it (``checked_by``).
"""

from __future__ import annotations

from distgrad.config.experiment import AUTO_STALENESS, CLIENT_MODES, FRAMEWORKS, REDUCTIONS, WIRE_DTYPES
from distgrad.config.keys import (BOTTOM, CODEC, COLUMNS, DEVICE, EARLY_STOPPING, FLAG, INPUT_GUARD, LAYERS, MODULE,
                                  NAME, NAMES, OPTIMIZER, REQUIRED, ROW_SHAPE, SCHEDULER, SCORE, SHAPE,
                                  STAGE_NAMES, STAGE_TABLES, TABLE, TEXT, Key, one_of, whole)
from distgrad.model.aggregate import AGGREGATES


# Who may set a key of a stage table (the table's parties when a key says nothing).
LAST = "the last stage only"
ENDS = "the first or the last stage"
LABEL_OWNER = "the label owner (the last stage)"
DATA_OWNERS = "a data owner (the first stage, a client, a feature party)"
COLUMN_OWNERS = "a data owner, or the label owner with 'bottom'"
OWNERS = "a data owner (the first stage, a client, a feature party) or the label owner"
LOSS_OWNER = "the last stage, which must give it"
MODULES_BEFORE_LAST = "a 'module' stage before the last"
_SCORES = "it holds the labels and scores the held-out rows"
_DEFENSES = "distgrad.privacy.defenses.parse_defenses; distgrad.config.defended.check_defenses (who)"



_AUTO_NOTE = (" ('auto' is the driving stage's flag, --staleness auto: it measures one run's link, while a file "
              "names the computation; the S it chose is in that run's summary)")


# Keys shared by a combined experiment's top level and a stage file's [interface].
SHARED_KEYS: dict[str, Key] = {
    "steps": Key(whole(1), default=100, help=
              "training steps (one batch each); give 'steps' or 'epochs', not both. '--steps' overrides it"),
    "epochs": Key(whole(1), help=
               "train this many passes over the training rows instead: steps = epochs x (training rows // batch); "
               "the rows of each epoch are a fresh seeded shuffle every party computes alike, and the last "
               "partial batch of an epoch is left out"),
    "seed": Key(whole(0), default=0, help=
             "seed of the sample order (the train/held-out split and each epoch's shuffle) and of the initial "
             "values (unless a stage gives its own 'seed'); '--seed' overrides it"),
    "labels": Key(one_of(("last", "first"), "'last' or 'first'"), default="last", help=
               "who holds the labels: the last stage (nothing but activations and gradients cross the wire), or "
               "the first, which sends each batch's targets downstream with its activations"),
    "reduction": Key(one_of(REDUCTIONS), shown="the loss's", help=
                  "how the last stage's loss reduces a batch's rows, which decides how micro-batch gradients "
                  "combine (summed, times 1/M for 'mean'); the label owner checks it against its loss"),
    "micro_batches": Key(whole(1), default=1, help=
                      "micro-batches per step (the batch must divide evenly); '--micro-batches' overrides it"),
    "staleness": Key(whole(0), default=0, notes=((AUTO_STALENESS, _AUTO_NOTE),), help=
                  "asynchronous pipelining, by name: the first stage's forward of step t uses its parameters after "
                  "its updates of steps 1..t-1-S, and it applies its update of step t once the forward of step t+S "
                  "has been sent (S steps in flight; 0: lockstep). Deterministic: equal to --in-process with the "
                  "same S. Two stages and chains; not with [clients] or 'aggregate'. '--staleness' overrides it "
                  "('--staleness auto', a flag only, chooses S from the link: docs/pipelining.md)"),
    "eval_every": Key(whole(0), default=0, help=
                   "every K steps, evaluate the held-out rows forward-only through every stage: loss, accuracy and "
                   "the last stage's 'metrics' go to the progress line, the metrics file, the plot and TensorBoard "
                   "(0: only at the end)"),
    "allow_nonfinite": Key(FLAG, default=False, help=
                        "accept NaN/Inf tensors on the wire and train through them (default: a non-finite loss or "
                        "gradient ends the run before anything of that step is applied)"),
    "send_rows": Key(FLAG, default=False, help=
                  "every training forward also carries its micro-batch's row numbers (an int64 tensor 'rows', in "
                  "the parties' common numbering of the [data] rows), and the label owner trains on the targets "
                  "(and, active, its own columns) of exactly those rows: the data owner's loader decides which rows "
                  "a step takes. The label owner refuses a row out of range, held out, another client's or twice in "
                  "a step; vertical parties must send the same rows. Batched rows only; not with labels = "
                  "\"first\", nor with the label owner's 'marvell' or privacy meter"),
    "clients": Key(TABLE, help=
                "several data owners share the serving stage: count, mode, average_every (see [clients])"),
    "aggregate": Key(one_of(AGGREGATES), help=
                  "vertical split learning: every stage but the last is a feature party holding its own columns of "
                  "the same rows (see 'columns'), and the last stage, which holds the labels, combines the parties' "
                  "embeddings of a step before its own model: side by side in party order (concat), or their sum "
                  "or mean; each party gets back exactly the gradient of its own embedding"),
    "secure_aggregation": Key(FLAG, default=False, help=
                           "with aggregate = \"sum\" or \"mean\" and two or more feature parties: each party adds "
                           "pairwise masks (from X25519 keys it shares with every other party) to its embedding in "
                           "fixed point (2**-32 units), so the label owner sees only the parties' sum, exactly. "
                           "Each party runs with CURVE (--curve-secret) and --party-keys DIR holding every other "
                           "party's NAME.key. Not with concat, a label owner's 'bottom', an activation_codec, "
                           "allow_nonfinite, the cut library or predictions (docs/privacy.md)"),
    "activation_codec": Key(CODEC, default="none", help=
                         "how activations cross the wire: none (float32), float16, bfloat16, int8 (per row, with a "
                         "float32 scale), topk:K (per row the K largest magnitudes) or topk:K+ef (with error feedback: "
                         "the sender carries what it dropped into its next step); the sender computes with its own "
                         "unrounded values. '--activation-codec' overrides it"),
    "gradient_codec": Key(CODEC, default="none", help=
                       "how activation gradients cross the wire back up: the same codecs as 'activation_codec'. "
                       "'--gradient-codec' overrides it"),
}

# A file's free text: at the top level of either form (a stage file's [interface] has none).
_DESCRIPTION = Key(TEXT, default="", help="free text, shown by 'distgrad experiments'")

# A combined experiment: every stage in one file.
TOP_KEYS: dict[str, Key] = {
    "name": Key(NAME, default=REQUIRED, help="the experiment's name (required)"),
    **SHARED_KEYS,
    "description": _DESCRIPTION,
    "data": Key(TABLE, default=REQUIRED, help="the data every stage reads its own part of (required): see [data]"),
    "stages": Key(STAGE_TABLES, default=REQUIRED, help="one [[stages]] table per stage, in order (required)"),
}

# A stage file: one party's stage.
STAGE_FILE_KEYS: dict[str, Key] = {
    "description": _DESCRIPTION,
    "interface": Key(TABLE, default=REQUIRED, help="what every party's file must say alike (required): see [interface]"),
    "stage": Key(TABLE, default=REQUIRED, help="this party's stage (required): see [stage]"),
    "data": Key(TABLE, help=
             "this party's own data: the data owner's features, the label owner's labels (see [data]); a "
             "middle stage has none"),
}

INTERFACE_KEYS: dict[str, Key] = {
    "name": Key(NAME, default=REQUIRED, help="the run's name; every party must give the same (required)"),
    "stages": Key(STAGE_NAMES, default=REQUIRED, help="every stage's name, in order from the data owner to the label owner "
                                         "(required, at least two)"),
    "batch": Key(whole(1), help=
              "rows per step; absent for unbatched data (the seed's ramp). Each party's [data] must batch alike"),
    "activation": Key(None, kind="table, or array of tables", default=REQUIRED, checked_by="_parse_cuts: one per cut", help=
                   "what crosses each cut (required): { shape = [per-row shape], dtype = \"float32\" }, one table "
                   "per cut from the top (a single table for two stages; with 'aggregate', one per feature party, "
                   "in party order); the tensor of a step is (batch, *shape)"),
    "target": Key(None, kind="table", checked_by="_parse_target: with labels = \"first\" only", help=
               "with labels = \"first\" (required then): the per-row shape and dtype of the targets that travel with "
               "the activations, e.g. { shape = [], dtype = \"int64\" } for class ids"),
    **SHARED_KEYS,
}

TARGET_DTYPES = ("int64", "float32")     # class ids, or values shaped like the prediction

# Each table of [interface] 'activation': what crosses one cut.
ACTIVATION_KEYS: dict[str, Key] = {
    "shape": Key(SHAPE, default=REQUIRED, help="the per-row shape; the tensor of a step is (batch, *shape)"),
    "dtype": Key(one_of(WIRE_DTYPES), default="float32", help="the element type on the wire"),
}

# [interface] 'target', with labels = "first": the targets that travel with the activations.
TARGET_KEYS: dict[str, Key] = {
    "shape": Key(ROW_SHAPE, default=REQUIRED, help="the per-row shape of the targets: [] for class ids"),
    "dtype": Key(one_of(TARGET_DTYPES), default=REQUIRED,
                 help="\"int64\" class ids, or \"float32\" values shaped like the last stage's output"),
}

# [clients]: several data owners share the serving stage.
CLIENT_KEYS: dict[str, Key] = {
    "count": Key(whole(1, 64), default=1, help="data owners, each with its own rows, served in turn by the serving "
                                                "stage (several: exactly two stages)"),
    "mode": Key(one_of(CLIENT_MODES), default="separate",
                help="'separate': each data owner trains its own first stage; 'splitfed': their first stages' "
                     "parameters are averaged every 'average_every' steps (count >= 2)"),
    "average_every": Key(whole(0), default=0,
                         help="splitfed: average the first stages' parameters every K steps (K > 0 with "
                              "mode = \"splitfed\" only; a run of fewer than K steps averages none, "
                              "which a warning says)"),
}

_STAGE_COMMON: dict[str, Key] = {
    "name": Key(NAME, default=REQUIRED, help="the stage's name (required)"),
    "model": Key(LAYERS, help=
              "the stage's layers, in order (see Layers); give 'model' or 'module', one of them"),
    "module": Key(MODULE, help=
               "a function returning a torch.nn.Module, imported from the folder of this file first, then "
               "sys.path (and so are the modules its code imports: each stage file's folder its own); the stage "
               "is then computed by torch (framework \"torch\")"),
    "module_args": Key(TABLE, default={}, help="keyword arguments for the 'module' factory"),
    "optimizer": Key(OPTIMIZER, default={}, shown='{ type = "adam" }', help=
                  "how the stage learns: a numpy optimiser (see Optimisers) for a 'model'; for a 'module', a "
                  "torch.optim class and its keyword arguments, e.g. { type = \"SGD\", lr = 0.1, momentum = 0.9 } "
                  "(\"adam\" and \"sgd\" are the numpy optimisers' tables, with their float32 values; other lower-case names, "
                  "\"rmsprop\", are torch.optim's; a 'model' takes \"Adam\" and \"SGD\" as well); any of them "
                  "may hold a 'schedule' (see Learning-rate schedules), whose float32 rate a torch stage sets on "
                  "every param group before each update"),
    "scheduler": Key(SCHEDULER, help=
                  "a torch stage (a 'module', or framework \"torch\"): a torch.optim.lr_scheduler class by name "
                  "and its keyword arguments, e.g. { type = \"StepLR\", step_size = 10, gamma = 0.5 }, stepped once "
                  "after each update (a training step) and checkpointed with the stage; not with the optimizer's "
                  "'schedule'. { type = \"ReduceLROnPlateau\", ... } (torch's options: mode, factor, patience, "
                  "threshold, threshold_mode, cooldown, min_lr, eps), on a numpy stage too (the same rule in "
                  "numpy), is stepped instead once after each evaluation during the run (eval_every, and the last "
                  "step's), with that evaluation's loss (the validation rows' with validation_fraction), by every "
                  "party that has it, before its next update; it needs held-out rows, eval_every > 0, staleness 0 "
                  "and no [clients]; a warning says so where it could not lower the rate before the last step (patience + 2 "
                  "evaluations before it). OneCycleLR's total_steps (or epochs x steps_per_epoch) must cover the stage's updates of "
                  "the run. Refused: LambdaLR and MultiplicativeLR (a function), SequentialLR and "
                  "ChainedScheduler (other schedulers)"),
    "loss": Key(None, kind="string or table", who=LOSS_OWNER, checked_by="the loss registries", help=
             "required on the last stage, and only there: its loss (see Losses); for a 'module', also a torch.nn "
             "loss class with its keyword arguments, e.g. { type = \"CrossEntropyLoss\" }: CrossEntropyLoss or "
             "NLLLoss (int64 class ids), MSELoss, L1Loss, SmoothL1Loss, HuberLoss, BCELoss or BCEWithLogitsLoss "
             "(float32 targets shaped like the output); reduction \"mean\" or \"sum\""),
    "metrics": Key(NAMES, default=[], who=LAST, why=_SCORES, help=
                "the last stage only: scores of each held-out evaluation besides the loss (and the accuracy a "
                "loss of class ids reports anyway), reported as test_NAME like test_accuracy: for a loss of class "
                "ids \"accuracy\", \"auc\", \"f1\", \"precision\", \"recall\" (two classes: of class 1; "
                "more: the unweighted mean over classes, auc one-vs-rest), for a loss whose targets are shaped "
                "like its output \"mse\", \"mae\" (scikit-learn's definitions; see docs/watching.md)"),
    "keep_best": Key(SCORE, who=LAST, why=_SCORES, help=
                  "the last stage only: a reported held-out score (\"test_loss\", \"test_accuracy\" or "
                  "test_NAME of 'metrics'); every party keeps its stage's parameters of the evaluation where it "
                  "was best (the lowest loss, mse or mae, the highest of the others; the earlier on a tie), which "
                  "'--save' writes instead of the last; the summary's best_step says which step. With [data]'s "
                  "validation_fraction it judges the validation rows' figure (validation_NAME names the same). Refused "
                  "where no evaluation comes before the last step (eval_every 0, or at least the steps)"),
    "early_stopping": Key(EARLY_STOPPING, who=LAST, why=_SCORES, help=
                       "the last stage only: { metric = \"test_loss\", patience = K } ends the run on every party "
                       "after the evaluation that is the K-th in a row not to improve on the best of that score "
                       "(as 'keep_best' judges); the summary's stopped_early says the step. Needs eval_every > 0 and "
                       "K + 1 evaluations before the last step to stop it (a warning says so where a run is shorter); "
                       "not with [clients]"),
    "framework": Key(one_of(FRAMEWORKS), shown='"numpy" ("torch" with a module)', help=
                  "what computes the stage; \"torch\" with a 'model' builds the same layers in PyTorch"),
    "columns": Key(COLUMNS, shown="absent (every column)", who=COLUMN_OWNERS, help=
                "the feature columns this stage takes from its data's features (indices into their last axis, in "
                "this order): a feature party's own columns in a vertical experiment ('aggregate')"),
    "bottom": Key(BOTTOM, who=LAST, why="the label owner's own bottom model in a vertical experiment", help=
               "the last stage of a vertical experiment ('aggregate'): the label owner's own "
               "bottom model over its own feature 'columns' of its [data] (which then holds its columns and the "
               "labels); its output joins the parties' embeddings as one more party, after them, before 'model'; "
               "it learns from the gradient of its own embedding and its parameters are saved with the stage's. "
               "Layer tables (see Layers) for every kind of stage: a torch stage (framework \"torch\" or a "
               "'module') builds them in torch, before its layers or module"),
    "privacy_meter": Key(FLAG, default=False, who=OWNERS, help=
                      "private to this party: meter, live, what the other party could learn from what this stage "
                      "sends across the cut (the label owner: label recovery and AUCs from the gradient rows; the "
                      "data owner: the distance correlation of inputs and activations) over windows of "
                      "'eval_every' steps (else 50); sends and changes nothing (docs/privacy.md). Only a data owner (the "
                      "first stage, each client's copy of it, a feature party: each meters its own rows) and the "
                      "label owner (with [clients] or 'aggregate': one meter per client or party, the summary's "
                      "'label_meters'). '--privacy-meter' sets it"),
    "input_guard": Key(INPUT_GUARD, shown="absent", who=DATA_OWNERS, help=
                    "a data owner (the first stage, each client, each feature party: its own rows and guard), "
                    "private to it: { max_r2 = R, after = K } (K default 50): "
                    "before each micro-batch's activations are sent, the R^2 of its inputs reconstructed by the "
                    "best ridge decoder of its latest activation rows (fitted on their public fifth, the rows whose "
                    "number is a multiple of 5, scored on the others: the data owner's ridge meter) is measured; after step K, above R the run stops (exit 5) before they are sent, "
                    "nothing of that step applied or checkpointed (docs/privacy.md: how to choose R from an "
                    "honest pilot run). In a vertical run the label owner and the other parties are told why and stop "
                    "too; with [clients] that client is dropped and the others go on. A warning says so where it will "
                    "judge no step: K at or past the run's last step (50 too when K is not given), or fewer rows "
                    "sent in the whole run than the decoder needs (at least 128)"),
    "device": Key(DEVICE, default="cpu", help=
               "where a torch stage computes: its module and optimizer state live there; tensors cross the wire "
               "from host memory (copied to a GPU through pinned memory)"),
    # Defenses on what crosses the cut (distgrad.privacy, docs/privacy.md): this party's own settings.
    "clip_noise": Key(None, kind="table", who=ENDS, checked_by=_DEFENSES, help=
                   "{ max_norm = C, sigma = s } (and optionally delta = d, default 1e-5): each row this stage sends "
                   "is scaled to norm at most C, then N(0, (s*C)^2) noise is added per element, after its own "
                   "computation and before the codec, drawn from a secret fresh for each run (kept in the stage's "
                   "checkpoints); the label owner's on the activation gradients it sends up (its own parameter "
                   "gradients stay exact; its summary reports the label-DP (epsilon, delta) of its worst row, "
                   "counting every step a row is in; none, saying why, where one label reaches other rows: with "
                   "marvell, a class-id mean weighted by the labels, a module's batch norm), a data owner's on the "
                   "activations it sends down (no DP guarantee stated). The label owner's target form "
                   "{ max_norm = C, epsilon = E } (refused where no epsilon can be stated) chooses s for "
                   "the run's planned releases (each row once per epoch of its steps) and refuses the step that "
                   "would release a row more often. A data owner's acts on its evaluations' and predictions' "
                   "activations too (counted in its budget entry); the label owner's on training gradients only. "
                   "Not on a middle stage"),
    "max_norm": Key(None, kind="boolean", shown="false", who=LABEL_OWNER, checked_by=_DEFENSES, help=
                 "the label owner: Li et al.'s max-norm heuristic on the activation gradients it sends up: each "
                 "row gets Gaussian noise that brings its expected squared norm to the batch's largest (no DP "
                 "guarantee; refused in micro-batches of one row, where it would add nothing)"),
    "label_dp": Key(None, kind="table", who=LABEL_OWNER, checked_by=_DEFENSES, help=
                 "the label owner: { epsilon = e }: k-ary randomized response on each of its training class labels, "
                 "once a run (epsilon-label-DP, exactly), drawn from a secret fresh for each run (kept in the "
                 "stage's checkpoints; never the seed); held-out labels stay true. prior = \"stages\" with stages = K "
                 "(default 2; stages >= 2 alone says the same) and optionally epochs_per_stage = E (default: the experiment's "
                 "steps / K): randomized response with a prior (Ghazi et al. 2021) in K stages: the "
                 "training rows split into K equal parts, part t joins after (t-1)*E epochs' worth of updates and "
                 "each of its labels is drawn when the row is first trained on, among the classes the model (trained "
                 "so far on randomized labels only) finds likeliest for it. loss = \"corrected\" (the default for "
                 "a softmax cross-entropy) trains on the probability of the randomized label given the known flip "
                 "rates; \"plain\" on the randomized label as if true (docs/privacy.md)"),
    "nopeek": Key(None, kind="table", who=DATA_OWNERS, checked_by=_DEFENSES, help=
               "a data owner: { weight = w }: NoPeek's term w * dCor(input rows, activation rows) (distance "
               "correlation of each micro-batch, Vepakomma et al. 2020) added to its own objective: its gradient "
               "is added to the activation gradient it receives before its backward (no DP guarantee; refused in "
               "micro-batches of one or two rows, where it has no gradient)"),
    "marvell": Key(None, kind="table", who=LABEL_OWNER, checked_by=_DEFENSES, help=
                "the label owner of a two-class task (class ids 0 and 1, or a binary cross-entropy's one 0/1 target "
                "per row): { bound = P }: Marvell (Li et al., "
                "ICLR 2022): Gaussian noise on the activation gradients it sends up, per micro-batch, with "
                "class-dependent covariances of the least power that bounds the sum of the KL divergences between "
                "the two classes' rows by P (smaller: more noise; no DP guarantee). Not with [clients], nor in "
                "micro-batches of one row (one class: no noise)"),
    "dp_sgd": Key(None, kind="table", who=LABEL_OWNER, checked_by=_DEFENSES, help=
               "the label owner, with its clip_noise: { max_norm = C }: its own update by DP-SGD: each training "
               "example's parameter gradient (the example forwarded alone) scaled to norm at most C, summed, "
               "and N(0, (s*C)^2) noise added, s being clip_noise's sigma (given or chosen for the target); "
               "counted in the same per-row budget, which is then end to end (docs/privacy.md): its replies "
               "withhold the training loss (the data owner records none). numpy layers, "
               "or a torch stage (layer list or module: per-example gradients by torch.func), without batch norm "
               "or dropout; not with [clients], marvell or a bottom model of its own"),
}

COMBINED_STAGE_KEYS: dict[str, Key] = {
    **_STAGE_COMMON,
    "output": Key(SHAPE, who=MODULES_BEFORE_LAST, help=
               "a 'module' stage before the last: its per-row output shape (a stage file's interface says it)"),
}

STAGE_KEYS: dict[str, Key] = {
    **_STAGE_COMMON,
    "seed": Key(whole(0), shown="the interface's seed", help="seed of this stage's initial values, private to its party"),
}

# The reference's tables: (title, keys, what the table is, who sets a key that does not say).
TABLES: list[tuple[str, dict[str, Key], str, str]] = [
    ("Combined experiment: top level", TOP_KEYS, "One file every stage reads (the built-ins).", "the file"),
    ("Combined experiment: [[stages]]", COMBINED_STAGE_KEYS, "One table per stage, in order.", "any stage"),
    ("Stage file: top level", STAGE_FILE_KEYS, "One file per party; no party needs another's.", "the party"),
    ("Stage file: [interface]", INTERFACE_KEYS,
     "What the parties agree on; the handshake compares it field by field and names the one that differs.",
     "every party, alike"),
    ("Stage file: [stage]", STAGE_KEYS, "This party's stage.", "the party"),
    ("[interface] activation", ACTIVATION_KEYS, "One table per cut, from the top: what crosses it.",
     "every party, alike"),
    ("[interface] target", TARGET_KEYS, "With labels = \"first\": the targets that travel with the activations.",
     "every party, alike"),
    ("[clients]", CLIENT_KEYS, "Several data owners of other rows share the serving stage: a table at a combined "
                               "experiment's top level or in [interface].", "every party, alike"),
]

# What each option of the registries means: the reference shows them next to each kind, layer and optimiser,
# and tests/test_reference.py fails when a registry gains an option without a meaning here.
DATA_OPTIONS: dict[str, str] = {
    "start": "ramp: the first x (x = start + delta * (step - 1), computed in float64, then float32)",
    "delta": "ramp: the change of x per step",
    "size": "ramp: elements per step (unbatched)",
    "seed": "synthetic kinds: the seed of the generated rows (default: the run's seed)",
    "samples": "synthetic kinds: rows generated",
    "features": "synthetic kinds: feature columns; file kinds: the features (an npz member, an npy path, csv "
                "columns by index or header name). In a stage file, absent means this party does not hold them (and "
                "a stage that never reads them, a label owner without its own 'bottom', may not name them)",
    "outputs": "synthetic_regression: target columns",
    "hidden": "synthetic_regression: width of the random teacher tanh(X A) B",
    "batch": "rows a step; must equal the interface's batch in a stage file",
    "noise": "synthetic_regression: standard deviation of the noise added to the targets",
    "classes": "synthetic_classification: classes (Gaussian blobs)",
    "spread": "synthetic_classification: standard deviation of each blob",
    "test_fraction": "file kinds: the share of rows held out for evaluation (the first rows of a seeded shuffle)",
    "validation_fraction": "file kinds: the share of rows set apart as validation rows (the next rows of the same "
                           "shuffle, so the test rows are those of test_fraction alone): the evaluations during "
                           "training (eval_every, the last step) score them and keep_best / early_stopping choose "
                           "on them (their 'test_NAME' judges the validation figure); the test rows cross once, "
                           "after the last step (or the early stop), forwarded by the kept model (keep_best's "
                           "best step on every stage, else the last) and scored once: the summary's test_* figures "
                           "and test_step, and the last printed line. Every party's [data] must give the same; not "
                           "with labels = \"first\" nor in the cut library; 0: no validation rows",
    "feature_scale": "file kinds: features are float32 times this (distgrad predict scales its --input rows alike); "
                     "refused in the cut library unless 1 (a loop of its own reads its own features; a combined "
                     "experiment's is its data owner's end's alone), and unless 1 in a [data] without features "
                     "(a label owner's own: it would scale nothing)",
    "label_dtype": "file kinds: \"int64\" class ids, shape (batch,), or \"float32\" values, shape (batch, 1)",
    "path": "npz and csv: the file (relative to the file that names it); refused for npy (its files are its "
            "features and labels)",
    "labels": "file kinds: the labels (an npz member, an npy path, one csv column). In a stage file, absent means "
              "this party does not hold them (and a stage that is not the label owner may not name them)",
    "header": "csv: the first line names the columns (else every line is a row of data; a field that is no "
              "finite number is refused naming its line and column); header = true is refused for npz and npy",
    "split_seed": "file kinds: the seed of the held-out split and the shuffles (default: the run's seed)",
    "id_column": "csv: the column of the rows' IDs (index or header name), no feature or label; npz: the member "
                 "of the IDs (distgrad split writes 'ids'); the handshake "
                 "compares a digest of the IDs in file order, so parties whose rows differ never train "
                 "together, and distgrad predict keeps the IDs in its output",
    "missing": "file kinds: what a missing cell (empty, NA, NaN, null, ?, ...) of a feature column becomes: "
               "\"error\" (refused, naming its line and column), \"mean\" or \"median\" (of the column's values "
               "in this party's training rows; a categorical cell: an all-zero one-hot row) or \"drop_rows\" (the "
               "row is left out before the split; only where one [data] table holds every part of the rows: a "
               "combined experiment, or a data owner with the labels and labels = \"first\"; refused elsewhere); \"mean\" and \"median\" are refused in a [data] "
               "without features; every mode but \"error\" in the cut library (its loop reads its own rows)",
    "standardize": "file kinds: each number feature column becomes (x - mean) / std, the mean and standard "
                   "deviation of its values in this party's training rows (a constant column: std 1); one-hot "
                   "columns stay 0/1; refused in a [data] without features and in the cut library",
    "categorical": "csv: feature columns (header names or indices) holding categories (any text), each one-hot "
                   "encoded into one column per category of this party's training rows, sorted, in its place; a "
                   "held-out row's category never seen in training is all zeros, a predicted row's is refused; "
                   "refused in the cut library",
    "class_names": "file kinds, the label owner: the label column holds class names (any text, or numbers): "
                   "its distinct values, sorted (by value when all are numbers), are class ids 0, 1, ...; "
                   "distgrad predict writes the names, and --output-scores heads its columns score_NAME (with "
                   "labels = \"first\" the data owner's names travel in its prediction hello to the last stage, "
                   "which writes them); refused in a [data] without labels and in the cut library",
    "feature_names": "npz and npy: the names of the feature columns, in order (distgrad split writes a csv "
                     "header's); distgrad predict matches a CSV --input's header to them by name",
}

LAYER_KEYS: dict[str, str] = {
    "name": "names the parameters (NAME.W, NAME.b, ...) and, for dropout, its mask stream (default: dropoutK, "
            "its position)",
    "size": "scale, layernorm: the length of the last axis",
    "init": "initial values: \"glorot_uniform\", \"truncated_normal\", \"zeros\", a number, or "
            "{ kind = \"truncated_normal\", stddev = 0.1, mean = 0.0 }",
    "bias_init": "initial bias (default \"zeros\")",
    "in": "dense: input columns; conv2d: input channels",
    "out": "dense: output columns; conv2d: output channels",
    "kernel": "conv2d, maxpool2d: window size, an integer or [height, width]",
    "stride": "conv2d: step of the window (default 1); maxpool2d: (default: the kernel)",
    "padding": "conv2d: zeros added on each side (default 0); maxpool2d: 0 only",
    "shape": "reshape: the per-row shape, e.g. [1, 8, 8] (images are NCHW)",
    "rate": "dropout: the share of units dropped while training, in [0, 1); none at evaluation",
    "vocab": "embedding: the number of ids (ids arrive as float32 whole numbers in [0, vocab))",
    "dim": "embedding: the width of each id's vector",
    "eps": "layernorm: added to the variance (default 1e-5)",
}

OPTIMIZER_OPTIONS: dict[str, str] = {
    "lr": "the learning rate (float32), or the first rate of a schedule",
    "beta1": "Adam: decay of the first moment",
    "beta2": "Adam: decay of the second moment",
    "epsilon": "Adam: added to sqrt(v), as TensorFlow 1's kernel does",
    "schedule": "a learning-rate schedule table (see Learning-rate schedules)",
}
