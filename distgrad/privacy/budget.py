"""The differential-privacy budget of a label owner's defenses, as docs/privacy.md states its assumptions.

* ``label_dp = { epsilon = e }``: randomized response once on each training label is e-label-DP, exactly,
  whatever the run does with the labels afterwards (post-processing).
* ``clip_noise = { max_norm = C, sigma = s }`` on the label owner: one example's label changes only its own
  gradient row of a step, by at most 2C (both rows have norm <= C), and the row gets N(0, (sC)^2) noise per
  element: a Gaussian mechanism of noise multiplier s / 2 each time the row is sent. Composed (Renyi DP, Google's
  ``dp-accounting``) over the most times any one training row is sent in the run, without amplification by
  sampling (the batches are a seeded shuffle, not Poisson samples), it gives (epsilon, delta).

``dp-accounting`` is the optional extra ``distgrad[privacy]``; without it, the budget says how to get it.
"""

from __future__ import annotations

from typing import Any

from distgrad.privacy.defenses import ClipNoise
from distgrad.privacy.labeldp import LabelDP


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


def label_budget(label_dp: LabelDP | None, clip: ClipNoise | None, releases: int) -> dict[str, Any]:
    """The label owner's budget for its summary: ``{"label_dp": {"epsilon": e}}`` for randomized response (with
    ``stages`` for RR-with-prior: ``LabelDP.budget``) and
    ``{"clip_noise": {"epsilon", "delta", "releases", "noise_multiplier"}}`` for ``clip``
    sent ``releases`` times per row at most (or ``"error"`` when dp-accounting is missing)."""
    budget: dict[str, Any] = {}
    if label_dp is not None:
        budget["label_dp"] = label_dp.budget()
    if clip is not None:
        entry: dict[str, Any] = {"delta": clip.delta, "releases": releases, "noise_multiplier": clip.sigma / 2.0}
        try:
            entry["epsilon"] = gaussian_label_dp(clip.sigma, releases, clip.delta)
        except ImportError as e:
            entry["error"] = str(e)
        budget["clip_noise"] = entry
    return budget
