"""Answers cut at the generation limit (DAPO's overlong handling).

An answer that reached `rollout.max_new_tokens` without ending was cut, not finished: its
reward judges a truncation. Two remedies, `algo.overlong`:

- ``mask``: leave cut answers out of the policy loss (DAPO's overlong filtering); their
  tokens and their samples count in no aggregation (grpo.clipped_policy_loss's mask).
- ``penalty``: DAPO's soft overlong punishment, a reward minus a penalty that grows
  linearly over the last `buffer` tokens before the limit, reaching `factor` at it:
  0 for length <= L - buffer, factor x (length - (L - buffer)) / buffer after.
"""

from __future__ import annotations


def length_penalty(length: int, max_tokens: int, buffer: int, factor: float = 1.0) -> float:
    """The penalty of an answer of `length` tokens under a limit of `max_tokens`."""
    over = length - (max_tokens - buffer)
    return factor * min(over, buffer) / buffer if over > 0 else 0.0
