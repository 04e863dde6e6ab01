"""A reward for tests on random models (reward.function=varied_rewards:code_parity): the
parity of the sum of the answer's character codes differs between their rollouts, so a
group's advantages are not all 0 and a step moves the weights, whatever the sampler drew."""


def code_parity(prompt: dict, completion: str) -> float:
    return float(sum(map(ord, completion)) % 2)
