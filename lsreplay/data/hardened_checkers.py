"""reasoning-gym's checkers as the child process of lsreplay.data.checkers runs them: the
names they evaluate text with stand for bounded readers (`harden`). Imports nothing of
lsreplay's but the expressions' bounds, so that the child starts fast.
"""

from __future__ import annotations

import functools
import importlib
import json

from lsreplay.data.expressions import arithmetic, check_symbolic, literal


@functools.lru_cache(maxsize=None)
def checker(task: str, args_json: str):
    """reasoning-gym's dataset of `task`, for its checker. size=1 keeps construction cheap
    (some generators precompute per-row state); the seed does not affect checking. Four
    checkers (decimal_arithmetic, puzzle24, polynomial_equations, time_intervals) read their
    config, hence args_json."""
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=1, seed=0, **json.loads(args_json))


def score_in_child(task: str, args_json: str, answer: str, entry: dict) -> float:
    """The checker's score of `answer` against `entry`, its evaluating names hardened."""
    harden()
    return float(checker(task, args_json).score_answer(answer=answer, entry=entry))


@functools.cache
def harden() -> None:
    """Put bounded readers where reasoning-gym's checkers call eval and parse_expr (a module's
    globals come before the builtins): a Python literal for the eval that reads a list, sized
    arithmetic for bitwise_arithmetic's, a checked expression for sympy's parser. Called in
    the child process only: this process's reasoning-gym stays as it is."""
    import sympy
    from sympy.parsing.sympy_parser import parse_expr

    def checked_parse_expr(text, local_dict=None, *args, **kwargs):
        check_symbolic(str(text), given=frozenset(local_dict or {}))
        return parse_expr(text, local_dict, *args, **kwargs)

    sympy.parse_expr = checked_parse_expr  # simple_integration, intermediate_integration, polynomial_multiplication
    for module, name, reader in (
            ("reasoning_gym.algorithmic.string_insertion", "eval", literal),
            ("reasoning_gym.algorithmic.spiral_matrix", "eval", literal),
            ("reasoning_gym.algorithmic.binary_matrix", "eval", literal),
            ("reasoning_gym.algorithmic.number_sorting", "eval", literal),
            ("reasoning_gym.games.n_queens", "eval", literal),
            ("reasoning_gym.arithmetic.bitwise_arithmetic", "eval", lambda text: arithmetic(text, shifts=True)),
            ("reasoning_gym.games.countdown", "parse_expr", checked_parse_expr),
            ("reasoning_gym.games.puzzle24", "parse_expr", checked_parse_expr)):
        setattr(importlib.import_module(module), name, reader)
