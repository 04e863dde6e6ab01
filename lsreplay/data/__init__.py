"""Data, prompts, rewards and evaluation: prompt sources (reasoning-gym, datasets as TRL and
verl keep them), a prompt as the model sees it, the training and held-out prompt sets,
offline DPO's preference pairs, rewards (reasoning-gym's checkers, your functions in TRL,
verl or lsreplay style), and the held-out answers, accuracy and intervals."""
