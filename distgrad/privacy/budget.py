"""The differential-privacy budget of a label owner's defenses, as docs/privacy.md states its assumptions.

* ``label_dp = { epsilon = e }``: randomized response once on each training label is e-label-DP, exactly,
  whatever the run does with the labels afterwards (post-processing).
* ``clip_noise = { max_norm = C, sigma = s }`` on the label owner: one example's label changes only its own
  gradient row of a step, by at most 2C (both rows have norm <= C), and the row gets N(0, (sC)^2) noise per
  element: a Gaussian mechanism of noise multiplier s / 2 each time the row is sent. Each row's releases are
  counted as they happen (every step it is in, whoever chose the rows, each peer its gradient goes to:
  ``privacy.releases``) and composed per row (Renyi DP, Google's ``dp-accounting``), without amplification
  by sampling (the batches are a seeded shuffle, not Poisson samples); the worst row's (epsilon, delta) is
  the run's. This is a guarantee on the cut gradients only, *given* the label owner's parameters, which its
  own update trains on the true labels without noise (``GUARANTEE_SCOPE``). With ``dp_sgd`` that update is a
  private release too, and the label owner withholds the training loss from its replies: the guarantee is then
  end to end, of everything the data owner receives (``END_TO_END_SCOPE``).
* The target form ``clip_noise = { max_norm = C, epsilon = E }`` chooses the least sigma whose budget over the
  run's planned releases is at most E (``sigma_for_target``, a bisection as Opacus's
  ``get_noise_multiplier`` does), and the run stops before a row would be released more often.
* An epsilon of ``MEANINGFUL_EPSILON`` or more is reported as no meaningful guarantee.

``dp-accounting`` is the optional extra ``distgrad[privacy]``; without it, the budget says how to get it.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

from distgrad.privacy.defenses import ClipNoise
from distgrad.privacy.labeldp import LabelDP

MEANINGFUL_EPSILON = 10.0     # an epsilon this large or larger bounds nothing an attacker cares about
NO_MEANINGFUL_GUARANTEE = "no meaningful guarantee (epsilon >= 10)"
GUARANTEE_SCOPE = ("per release, on the cut gradients only: given the label owner's parameters, which its own "
                   "update trains on the true labels without noise")
LABEL_DP_SCOPE = ("per release, on the cut gradients only, given the label owner's parameters; its own update trains "
                  "on its randomized labels (label_dp), so end to end the run is label_dp's epsilon-label-DP: "
                  "everything the data owner receives is computed from those labels")
# With it (``Defenses.withholds_loss``) the label owner's backward replies carry no training loss: computed from
# the true labels of the micro-batch, it would be a release no mechanism covers.
END_TO_END_SCOPE = ("end to end: the cut gradients and the label owner's own update (DP-SGD) are the private "
                    "releases, composed per row; everything else the data owner receives is computed from them "
                    "(the training loss is withheld by the label owner: its replies carry none)")
TARGET_TOLERANCE = 0.01       # the chosen sigma's epsilon is within this of the target, below it
SIGMA_CEILING = 1e6           # no sigma above this is searched (a target that needs more is refused)


def gaussian_label_dp(sigma: float, releases: int, delta: float) -> float:
    """The epsilon at ``delta`` of ``releases`` Gaussian mechanisms of sensitivity 2C and noise standard
    deviation ``sigma`` * C, composed (Renyi DP). Infinite for ``sigma`` 0. Raises ``ImportError`` naming the
    extra without ``dp-accounting``."""
    if sigma == 0:
        return float("inf")
    try:
        import dp_accounting
    except ImportError as e:
        raise ImportError("the clip_noise label-DP budget needs Google's dp-accounting: "
                          "pip install 'distgrad[privacy]'") from e
    accountant = dp_accounting.rdp.RdpAccountant()        # its default Renyi orders
    accountant.compose(dp_accounting.GaussianDpEvent(sigma / 2.0), releases)
    return float(accountant.get_epsilon(delta))


@lru_cache(maxsize=256)
def sigma_for_target(epsilon: float, releases: int, delta: float) -> float:
    """The least sigma (noise in units of C, to within ``TARGET_TOLERANCE`` in epsilon) whose budget over
    ``releases`` releases of a row is at most ``epsilon`` at ``delta`` (``gaussian_label_dp``): the upper
    end is doubled until it meets the target, then the interval is halved. 0 releases need no noise.
    Raises ``ValueError`` when no sigma up to ``SIGMA_CEILING`` meets it, ``ImportError`` as
    ``gaussian_label_dp``."""
    if releases <= 0:
        return 0.0
    low, high = 0.0, 10.0
    while gaussian_label_dp(high, releases, delta) > epsilon:
        low, high = high, 2.0 * high
        if high > SIGMA_CEILING:
            raise ValueError(f"clip_noise epsilon {epsilon:g} at delta {delta:g} over {releases} releases needs "
                             f"more noise than sigma {SIGMA_CEILING:g}")
    while True:
        middle = (low + high) / 2.0
        spent = gaussian_label_dp(middle, releases, delta)
        if spent > epsilon:
            low = middle
        else:
            high = middle
            if epsilon - spent <= TARGET_TOLERANCE:
                return high
        if high - low < 1e-9 * high:
            return high


def label_budget(label_dp: LabelDP | None, clip: ClipNoise | None, releases: int,
                 planned: int | None = None, scope: str = GUARANTEE_SCOPE,
                 no_guarantee: str | None = None) -> dict[str, Any]:
    """The label owner's budget for its summary: ``{"label_dp": {"epsilon": e}}`` for randomized response (with
    ``stages`` for RR-with-prior: ``LabelDP.budget``) and
    ``{"clip_noise": {"epsilon", "delta", "releases", "noise_multiplier", "sigma", "scope", "guarantee"}}`` for
    ``clip``
    whose worst row was sent ``releases`` times (or ``"error"`` when dp-accounting is missing); a target form
    adds its ``target_epsilon`` and the ``planned_releases`` its sigma was chosen for. ``scope`` says which
    guarantee the run has (``GUARANTEE_SCOPE``: per release, on the cut gradients only; the label owner's own
    update is not privatised), ``guarantee`` the same, or that an epsilon of ``MEANINGFUL_EPSILON`` or more
    bounds nothing; a ``label_dp`` epsilon that large gets that ``guarantee`` too. ``no_guarantee``: why the
    Gaussian mechanism's premise fails for ``clip`` (one label reaches other rows): its entry then has no
    epsilon and no scope, and that ``guarantee``."""
    budget: dict[str, Any] = {}
    if label_dp is not None:
        budget["label_dp"] = label_dp.budget()
        if not label_dp.epsilon < MEANINGFUL_EPSILON:      # exact, and still no bound an attacker cares about
            budget["label_dp"]["guarantee"] = NO_MEANINGFUL_GUARANTEE
    if clip is not None:
        sigma = clip.noise
        entry: dict[str, Any] = {"delta": clip.delta, "releases": releases, "noise_multiplier": sigma / 2.0,
                                 "sigma": sigma, "scope": scope}
        if clip.epsilon is not None:
            entry.update(target_epsilon=clip.epsilon, planned_releases=planned)
        if no_guarantee is not None:
            del entry["scope"]
            budget["clip_noise"] = {**entry, "guarantee": no_guarantee}
            return budget
        try:
            epsilon = gaussian_label_dp(sigma, releases, clip.delta) if releases else 0.0
            entry["epsilon"] = epsilon
            entry["guarantee"] = (scope if math.isfinite(epsilon) and epsilon < MEANINGFUL_EPSILON
                                  else NO_MEANINGFUL_GUARANTEE)
        except ImportError as e:
            entry["error"] = str(e)
        budget["clip_noise"] = entry
    return budget
