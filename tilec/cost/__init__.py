"""The cost model: time and peak bytes of one training step of a segmented plan.

``constants``: the measured memory constants; ``facts``: what is known of every node on a
target; ``liveness``: the simulation of the tensors alive in a segment's run; ``estimator``:
the costs of segment choices and the step's peaks; ``arrays``: tile lengths as arrays;
``balance``: tile weights for sharing tiles among ranks.
"""
