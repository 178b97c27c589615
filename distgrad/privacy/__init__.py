"""Privacy of the parties: pure numpy measures of what crosses the cut gives away, and the meter that takes them.

``leaks`` holds the attacks and measures (nearest-anchor label recovery, the pair-cosine AUC, Li et al.'s
norm and direction AUCs, NoPeek's distance correlation) with their chance levels, shared by the live meter
and the offline audit; ``meter`` gathers a window of what a stage sends and scores it with them. The layer
is model math's neighbour: it imports only ``distgrad.errors`` and numpy.
"""
