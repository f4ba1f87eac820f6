"""The agent demo's tool (examples/agent.yaml): a calculator the model calls with an expression.

hpcrl runs it in a tool worker process, as TRL would call it: its type hints and docstring make the
JSON schema the prompt is rendered with (transformers' get_json_schema), and an exception it raises
reaches the model as an error message, counted in tools/failure_frequency.
"""

from __future__ import annotations

import ast
import operator

# The only operations evaluated: never eval(), which would run whatever the model writes.
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression: numbers, + - * / and parentheses.

    Args:
        expression: The expression, e.g. "23+48".
    """
    value = evaluate(ast.parse(expression.strip(), mode="eval").body)
    return str(int(value)) if float(value).is_integer() else str(round(value, 6))


def evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        return BINARY[type(node.op)](evaluate(node.left), evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](evaluate(node.operand))
    raise ValueError(f"not arithmetic: {ast.unparse(node)}")
