"""Expressions others wrote (model text, a tool call's arguments), measured before computed.

Python's integers grow without bound, and one `**` or `<<` on them runs inside the
interpreter, holding it: `((10**100)**100)**100` takes 0.17 s, one more level minutes, and no
timeout on a thread can stop it. So every exact number an expression would make is sized
before it is made, and an operation whose result would pass MAX_BITS is refused (TooLarge),
whatever the numbers are. Nothing here calls eval: an expression is read with `ast.parse` and
computed node by node (`arithmetic`), read as a literal (`literal`), or checked for what
sympy's parser may be given (`check_symbolic`, whose exact numbers are fractions, as sympy's
rationals are).
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

# The largest exact number an expression may make, in bits (2**10000 has about 3,000 digits).
MAX_BITS = 10_000
# The longest expression read at all (an answer or a tool call is rarely longer than a line).
MAX_CHARS = 10_000
# The largest exponent of a power whose base is symbolic (x**n): expanding (x + 1)**n makes n + 1 terms.
MAX_SYMBOLIC_EXPONENT = 100

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
           ast.LShift: operator.lshift, ast.RShift: operator.rshift}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_SHIFTS = (ast.LShift, ast.RShift)


class TooLarge(ValueError):
    """An expression that would make a number beyond MAX_BITS, or is longer than MAX_CHARS."""


def parse(text: str) -> ast.expr:
    """The expression `text` holds; SyntaxError if it is none, TooLarge if it is too long."""
    if len(text) > MAX_CHARS:
        raise TooLarge(f"an expression of {len(text):,} characters (at most {MAX_CHARS:,})")
    return ast.parse(text.strip(), mode="eval").body


def _number(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool)


def arithmetic(text: str, shifts: bool = False):
    """The value of an arithmetic expression as Python computes it: int and float numbers,
    + - * / // % ** and parentheses (and << >> with `shifts`), every integer result sized
    before it is computed. ValueError for anything else; TooLarge past MAX_BITS."""
    return _arithmetic(parse(text), shifts)


def _arithmetic(node: ast.expr, shifts: bool):
    if _number(node):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_arithmetic(node.operand, shifts))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY and (shifts or type(node.op) not in _SHIFTS):
        left, right = _arithmetic(node.left, shifts), _arithmetic(node.right, shifts)
        _check_size(node.op, left, right, exact=False)
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {ast.unparse(node)[:80]}")


def _bits(value) -> int:
    """The size of an exact number in bits (a fraction's numerator's and denominator's); -1
    for a float, whose size is bounded."""
    if isinstance(value, Fraction):
        return value.numerator.bit_length() + value.denominator.bit_length()
    return value.bit_length() if isinstance(value, int) else -1


def _check_size(op: ast.operator, left, right, exact: bool) -> None:
    """TooLarge if `left op right` would make an exact number of more than MAX_BITS. A power
    with a negative exponent shrinks in Python (a float) and grows in sympy (`exact`, a
    rational); a float result overflows at once (OverflowError) instead of growing."""
    size, other = _bits(left), _bits(right)
    if size < 0 or other < 0:
        return
    if isinstance(op, ast.Pow) and isinstance(right, (int, Fraction)) and right == int(right) and size > 1 \
            and (exact or right > 0) and abs(left) != 1:
        bits, what = abs(int(right)) * (size - 1), f"a power of {int(right):,} on a {size}-bit number"
    elif isinstance(op, ast.LShift) and right > 0:
        bits, what = size + right, f"a shift by {right:,} of a {size}-bit number"
    elif isinstance(op, ast.Mult) or (isinstance(op, ast.Div) and exact):  # Python's int / int is a float
        bits, what = size + other, f"a {'product' if isinstance(op, ast.Mult) else 'quotient'}"
    elif isinstance(op, (ast.Add, ast.Sub)):
        a, b = Fraction(left), Fraction(right)  # a/b + c/d = (ad + cb) / bd
        bits = max(a.numerator.bit_length() + b.denominator.bit_length(),
                   b.numerator.bit_length() + a.denominator.bit_length()) + 1 \
            + a.denominator.bit_length() + b.denominator.bit_length()
        what = "a sum"
    else:
        return
    if bits > MAX_BITS:
        raise TooLarge(f"{what} would have about {bits:,} bits (at most {MAX_BITS:,})")


def literal(text: str):
    """`text` read as a Python literal (numbers, strings, lists, tuples, dicts, sets): what a
    reasoning-gym checker's eval(answer) is there to read, and nothing it could compute."""
    return ast.literal_eval(parse(text))


# The functions sympy's parser may be given in an answer: elementary ones, which make nothing
# large of a number. No call of anything else: the parser's namespace holds sympify,
# lambdify, preview, factorial, and every builtin function (eval, open, __import__).
SYMPY_FUNCTIONS = frozenset({
    "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "acot", "asec", "acsc", "sinh", "cosh", "tanh",
    "coth", "asinh", "acosh", "atanh", "exp", "log", "ln", "sqrt", "Abs", "sign"})


def check_symbolic(text: str, given: frozenset[str] = frozenset()) -> None:
    """ValueError unless `text` is an expression sympy's parser may be given: numbers, the
    operators + - * / ** (and unary ones), SYMPY_FUNCTIONS called on such expressions, and
    plain names (sympy makes a symbol of one it does not know; `given`, the checker's own
    symbols, may be any). Calls of anything else, attributes, subscripts, strings, lambdas
    and names starting with _ are refused. Every exact number it would make is sized
    (TooLarge), and a symbolic base's exponent is at most MAX_SYMBOLIC_EXPONENT."""
    _symbolic(parse(text), given)


def _symbolic(node: ast.expr, given: frozenset[str]):
    """The node's exact value (a Fraction) where it is a rational constant, a float where a
    number sympy holds to a fixed precision, None where it is symbolic; ValueError for what
    sympy must not be given."""
    if _number(node):
        return Fraction(node.value) if isinstance(node.value, int) else node.value
    if isinstance(node, ast.Name):
        if node.id in given or not node.id.startswith("_"):
            return None
        raise ValueError(f"the name {node.id!r} is not allowed in an answer")
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _symbolic(node.operand, given)
        return None if value is None else _UNARY[type(node.op)](value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow)):
        left, right = _symbolic(node.left, given), _symbolic(node.right, given)
        if isinstance(node.op, ast.Pow) and left is None and right is not None and abs(right) > MAX_SYMBOLIC_EXPONENT:
            raise TooLarge(f"a symbolic power of {float(right):.3g} (at most {MAX_SYMBOLIC_EXPONENT})")
        if left is None or right is None:
            return None
        _check_size(node.op, left, right, exact=True)
        if isinstance(left, Fraction) and isinstance(right, Fraction):
            return _exact(node.op, left, right)
        try:  # a float: sympy holds it to a fixed precision, whatever its size
            return float(_BINARY[type(node.op)](float(left), float(right)))
        except (OverflowError, ZeroDivisionError):
            return None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in SYMPY_FUNCTIONS \
            and not node.keywords and 1 <= len(node.args) <= 2:
        for argument in node.args:
            _symbolic(argument, given)
        return None
    raise ValueError(f"not allowed in an answer: {ast.unparse(node)[:80]}")


def _exact(op: ast.operator, left: Fraction, right: Fraction) -> Fraction | None:
    """left op right as sympy's rationals make it; None where sympy keeps it symbolic (a root
    such as 2**(1/2), a division by zero)."""
    if isinstance(op, ast.Pow) and right.denominator != 1:
        return None
    try:
        return left ** int(right) if isinstance(op, ast.Pow) else _BINARY[type(op)](left, right)
    except ZeroDivisionError:
        return None
