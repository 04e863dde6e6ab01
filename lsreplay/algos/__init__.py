"""RL losses over rollout trees, reduced to per-token logprob weights for replay.

A loss here is a function of the per-token logprobs of every completion. Its gradient
with respect to the parameters is sum over tokens of dL/dlogp * grad logp, so the
weights replay needs are dL/dlogp, taken by autograd from the same loss function at
the logprobs of the caching pass. The per-rollout reference differentiates the very
same function through the model, which is what the equivalence tests compare.
"""

from lsreplay.algos.weights import loss_and_weights

__all__ = ["loss_and_weights"]
