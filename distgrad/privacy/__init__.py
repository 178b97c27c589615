"""Privacy of the parties: what crosses the cut, measured and defended (pure numpy math, below the wire).

``defenses`` holds the defenses a party applies to what it sends (row clipping and Gaussian noise, Li et al.'s
max-norm noise, Marvell's class-dependent noise for two classes, randomized response on labels,
NoPeek's distance-correlation gradient) as pure functions of
their inputs and a seeded generator; ``budget`` the differential-privacy accounting of the label owner's
``clip_noise``; ``leaks`` the attacks and measures of what the rows that cross give away (nearest-anchor label
recovery, the pair-cosine AUC, Li et al.'s norm and direction AUCs, distance correlation) with their chance
levels, shared by the live meter and the offline audit; ``meter`` the window of what a stage sends that the
live meter scores with them, and the strongest attacks over the whole run; ``guard`` a data owner's check of
how well its activations can be inverted (``input_guard``); ``audit`` the offline audit's attacks (k-means clustering of gradient rows,
decoders from activations back to inputs) beside them. docs/privacy.md says what each party can learn from the other with and without
the defenses.
"""
