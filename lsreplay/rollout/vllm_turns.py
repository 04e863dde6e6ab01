"""Episodes' replies sampled by a vLLM engine (rollout.engine=vllm), in one session of the
device's engine (VLLMEngine.episode_session): each turn request goes to the engine as soon
as the scheduler hands it over (lsreplay.rollout.episodes), and each reply comes back as
soon as it ends. A request is the episode's whole sequence; vLLM's prefix cache holds it up
to the last full cache block the turn before computed (the environment's answer is new).
Exact in distribution, not reproducible: vLLM draws from one engine-wide generator."""

from __future__ import annotations

from collections.abc import Callable

from lsreplay.rollout.episodes import TurnReply, TurnRequest

# The engine's counters, by the names the trees stage records them under.
COUNTERS = {"steps": "decode_steps", "prompt_tokens": "prompt_positions", "cached_tokens": "cached_positions",
            "generated_tokens": "generated_positions"}


class VLLMTurns:
    """Turn requests sampled in one session of `engine` (a context manager: the session)."""

    def __init__(self, engine, max_new_tokens: int, temperature: float, top_p: float, top_k: int, eos: list[int],
                 progress: Callable[[int], None] | None = None):
        self.engine, self.max_new_tokens, self.eos, self.progress = engine, max_new_tokens, eos, progress
        self.sampling = (temperature, top_p, top_k)
        self.session, self._open = None, None

    def __enter__(self) -> VLLMTurns:
        self._open = self.engine.episode_session(self.max_new_tokens, *self.sampling, self.eos)
        self.session = self._open.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._open.__exit__(*exc)

    @property
    def figures(self) -> dict:
        return {name: self.session.figures.get(key, 0) for key, name in COUNTERS.items()}

    def submit(self, requests: list[TurnRequest]) -> None:
        self.session.add([{"key": r.id, "prompt": r.tokens, "branching": r.fan_outs, "segment_tokens": r.segments}
                          for r in requests])

    def poll(self, wait: float) -> list[TurnReply]:
        replies = [TurnReply(leaf["key"], tuple(leaf["path"]), leaf["tokens"], leaf["logprobs"], leaf["finished"],
                             leaf["last"], None, leaf["computed"]) for leaf in self.session.poll(wait)]
        if self.progress is not None and replies:
            self.progress(sum(len(r.tokens) for r in replies))
        return replies
