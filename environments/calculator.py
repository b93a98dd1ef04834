"""
A calculator, as a function tool for word problems: arithmetic on numbers,
nothing else (an AST walk, never eval).

    python train.py --model M --dataset D --tools environments.calculator.calculate \
        --chat-template assets/chatml_tools.jinja

The reward stays the answer's (final_number_reward: the policy must write the
number itself, not the expression).
"""
import ast
import operator

OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
# a**b is left out: 9**9**9 would hang the tool
LARGEST = 10**18


def evaluate(node):
    """An arithmetic expression's AST -> its value. ValueError on anything else."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        value = OPERATORS[type(node.op)](evaluate(node.left), evaluate(node.right))
    elif isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        value = OPERATORS[type(node.op)](evaluate(node.operand))
    else:
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    if abs(value) > LARGEST:
        raise ValueError("the result is too large")
    return value


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression, for example "123 * 509 + 7".

    Args:
        expression: numbers with + - * / // % and parentheses
    """
    value = evaluate(ast.parse(expression.replace(",", ""), mode="eval").body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)
