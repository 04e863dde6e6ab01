"""The five stages of one RL step, and the held-out evaluation, as plain functions of
(run, step) -> manifest.

Each reads its inputs from the run's store, writes its outputs there, and returns a
small JSON manifest (keys, sha256, counts, timings). A stage that already finished for
this step returns its manifest without redoing the work. Prefect tasks wrap these;
nothing here imports Prefect.
"""

from lsreplay.stages.drafter import distill_drafter
from lsreplay.stages.evaluate import evaluate_policy, evaluated
from lsreplay.stages.policy import train_policy
from lsreplay.stages.prefixes import cache_prefixes
from lsreplay.stages.prompts import sample_prompts
from lsreplay.stages.trees import collect_trees, generate_tree_shard, generate_trees, shard_name

__all__ = ["cache_prefixes", "collect_trees", "distill_drafter", "evaluate_policy", "evaluated",
           "generate_tree_shard", "generate_trees", "sample_prompts", "shard_name", "train_policy"]
