"""The calculator task (env=calculator) as an agent written against the OpenAI API: the
model writes a tool call, the agent runs the calculator itself and sends the result back,
and the model answers. Train it with `gpurl train env=agent env.agent=calculator_agent:solve
...` (docs/agents.md), or score the held-out problems through `gpurl serve` with
`python examples/calculator_agent.py [N]`."""

import ast
import json
import operator
import re

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """+, -, * and / of numbers, parsed and never evaluated as code."""
    def value(node):
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        raise ValueError("only + - * / of numbers")
    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result)) if float(result).is_integer() else f"{result:g}"


async def solve(client, row, turns: int = 3) -> float:
    """Up to `turns` model turns, each ended at a newline: a tool call is answered with
    <tool_response>result</tool_response>; `Answer: N` ends the task (reward 1 if right).
    Greedy against a server; a training gateway samples with the run's rollout settings."""
    text = row["prompt"]
    for _ in range(turns):
        done = await client.completions.create(model="policy", prompt=text, stop=["\n"],
                                               max_tokens=40, temperature=0.0)
        turn = done.choices[0].text
        text += turn + ("\n" if done.choices[0].finish_reason == "stop" else "")
        call = re.search(r"<tool_call>(.*?)</tool_call>", turn)
        if call is None:
            answer = re.search(r"Answer:\s*(-?[\d.]+)", turn)
            return float(answer is not None and float(answer.group(1)) == float(row["answer"]))
        try:
            result = calculate(json.loads(call.group(1))["arguments"]["expression"])
        except Exception as e:  # a malformed call: the model reads why
            result = f"error: {e}"
        text += f"<tool_response>{result}</tool_response>\n"
    return 0.0


if __name__ == "__main__":  # against `gpurl serve` (OPENAI_BASE_URL, OPENAI_API_KEY set)
    import asyncio
    import sys

    import openai
    from gpurl.cli.compose import validate
    from gpurl.data.tasks import calculator

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    data = validate(["env=calculator"]).data  # the run's held-out problems (data=calculator)
    held_out = calculator(data.num_train + data.num_eval, data.seed, data)[data.num_train:][:n]

    async def score() -> float:
        client = openai.AsyncOpenAI()
        return sum(await asyncio.gather(*(solve(client, row) for row in held_out))) / len(held_out)

    print(f"held-out accuracy over {len(held_out)} problems: {asyncio.run(score()):.2f}")
