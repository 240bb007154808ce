"""A tool-using agent written with the plain `openai` client and nothing from jetroll: it answers a word problem,
calling a `calculator` tool through `tool_calls` when the model asks for one. `configs/agent.yaml` trains it.

Any OpenAI-compatible endpoint serves it; jetroll points `client` at the episode's gateway session. The agent's
return value is its reward: 1.0 when its final answer states the problem's answer.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from typing import Any

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression of integers with + - * and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
TOOLS = [CALCULATOR]
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
MAX_TURNS = 3


def calculate(expression: str) -> str:
    """An expression of integers with + - * and parentheses, evaluated; anything else is an error message."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only integers, + - * and parentheses")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as exc:
        return f"error: {exc}"


def call_tool(name: str, arguments: str) -> str:
    try:
        expression = json.loads(arguments)["expression"]
    except (ValueError, KeyError, TypeError):
        return "error: arguments must be {\"expression\": \"...\"}"
    return calculate(str(expression)) if name == "calculator" else f"error: no tool {name}"


async def run(problem: Any, client: Any) -> float:
    """`problem` has `prompt` (the question) and `answer`; `client` is an `openai.AsyncOpenAI`."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": problem.prompt}]
    for _ in range(MAX_TURNS):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": call_tool(call.function.name, call.function.arguments)})
    final = messages[-1].get("content") or "" if messages[-1]["role"] == "assistant" else ""
    return 1.0 if re.fullmatch(rf"The answer is {re.escape(problem.answer)}\.", final.strip()) else 0.0
