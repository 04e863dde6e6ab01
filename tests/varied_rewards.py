"""A reward for tests on random models (reward.function=varied_rewards:code_parity): the
parity of the sum of the answer's character codes differs between their rollouts, so a
group's advantages are not all 0 and a step moves the weights, whatever the sampler drew."""


def code_parity(prompt: dict, completion: str) -> float:
    return float(sum(map(ord, completion)) % 2)


def alike_on_even_prompts(prompt: dict, completion: str) -> float:
    """1 for every answer to a prompt of even row index (a tree whose leaves all score alike:
    no GRPO gradient, no DPO pair), code_parity for the others."""
    return 1.0 if prompt["index"] % 2 == 0 else code_parity(prompt, completion)
