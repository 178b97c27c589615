"""Privacy of the parties: what crosses the cut, measured and defended (pure numpy math, below the wire).

``defenses`` holds the defenses a party applies to what it sends (row clipping and Gaussian noise, Li et al.'s
max-norm noise, randomized response on labels, NoPeek's distance-correlation gradient) as pure functions of
their inputs and a seeded generator; ``budget`` the differential-privacy accounting of the label owner's
``clip_noise``. docs/privacy.md says what each party can learn from the other with and without them.
"""
