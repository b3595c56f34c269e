"""Agents the tests import by path ("rl_agents:guess_number" with tests/ on PYTHONPATH):
plain `openai` code against the gateway, and agents that misbehave."""

from __future__ import annotations

import asyncio
import threading
import time

# imported here, once: 24 agent threads importing httpx at once for the first time can see
# it half initialized (CPython hands a partly imported module to a thread that would
# otherwise deadlock on the import lock)
import httpx
import openai

from gpurl.envs.builtin import GuessNumber
from rl_envs import PrintableGame

TURNS = 3  # as the tests' env.max_turns


async def play(cls, client, row, turns: int = TURNS) -> float:
    """An `Environment` class played as an agent through the text completions API: the
    prompt, the model's turn, the environment's reply appended, again until it is done or
    `turns` turns are spent. Its reward is the environment's, and its trajectory, token for
    token, the one the environment gives in-process (`env.name=<the class>`)."""
    env = cls(row["prompt"], **{k: v for k, v in row.items() if k != "prompt"})
    text, reward = row["prompt"], 0.0
    for _ in range(turns):
        done = await client.completions.create(model="policy", prompt=text)
        turn, ended = done.choices[0].text, done.choices[0].model_extra.get("stop_reason")
        step = env.step(turn)
        reward += step.reward
        if step.done:
            break
        # the turn's end as the model wrote it (a newline), unless it ran out of tokens
        text += turn + (ended if isinstance(ended, str) else "") + (step.observation or "")
    return reward


async def guess_number(client, row):
    return await play(GuessNumber, client, row)


async def printable(client, row):
    return await play(PrintableGame, client, row)


async def chatty(client, row):
    """Two chat calls, the first answer sent back as the agent received it: one row."""
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "Once more."}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    text = (first.choices[0].message.content or "") + (second.choices[0].message.content or "")
    return {"reward": sum(c.isdigit() for c in text) / max(len(text), 1), "length": len(text)}


async def raises(client, row):
    await client.chat.completions.create(model="policy", messages=[
        {"role": "user", "content": row["prompt"]}], max_tokens=2)
    raise RuntimeError("the agent broke")


async def sleeps_forever(client, row):
    await asyncio.sleep(3600)


async def blocks_its_thread(client, row):
    time.sleep(3600)  # a blocking call inside an async agent: only its own thread waits


async def calls_forever(client, row):
    while True:
        await client.completions.create(model="policy", prompt=row["prompt"], max_tokens=1)


async def returns_text(client, row):
    return "a reward"


async def rewrites(client, row):
    """Two chat calls; the first answer is edited before it is sent back, so the history
    the second call renders is not the one sampled: the trajectory forks."""
    messages = [{"role": "user", "content": row["prompt"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    edited = {"role": "assistant", "content": "(edited) " + (first.choices[0].message.content or "")}
    second = await client.chat.completions.create(
        model="policy", messages=[*messages, edited, {"role": "user", "content": "More."}],
        max_tokens=4)
    return float(bool(second.choices[0].message.content))


# Set by the bad-agents test once its run has ended: the agents that sleep or block their
# thread past their timeout then return, so no thread of theirs outlives the test (a worker
# that kept such threads for the rest of the suite crashed in XLA's compiler in four runs)
RELEASE = threading.Event()


async def misbehaving(client, row):
    """The behaviour the row names (tests/test_agents.py's battery)."""
    chat = {"model": "policy", "messages": [{"role": "user", "content": row["prompt"]}],
            "max_tokens": 3}
    kind = row["behaviour"]
    if kind == "fine":  # its reward, with numbers to log beside it (and what is not logged)
        done = await client.chat.completions.create(**chat)
        text = done.choices[0].message.content or ""
        return {"reward": 0.5 + 0.5 * bool(text), "tries": 1, "chars": len(text),
                "label": "fine", "ok": True, "inf": float("inf")}
    if kind == "raises":
        await client.chat.completions.create(**chat)
        raise RuntimeError("the agent broke")
    if kind == "sleeps":  # past its timeout, until the test has ended its run
        while not RELEASE.is_set():
            await asyncio.sleep(0.05)
    if kind == "blocks":  # a blocking call in an async agent: only its own thread waits
        RELEASE.wait(3600)
    if kind == "calls_forever":
        while True:
            await client.chat.completions.create(**chat)
    if kind == "wrong_key":
        other = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="stolen", max_retries=0)
        await other.chat.completions.create(**chat)
    if kind == "other_session":
        url = str(client.base_url).rstrip("/").rsplit("/", 2)[0] + "/0000000000000000/v1"
        other = openai.AsyncOpenAI(base_url=url, api_key=client.api_key, max_retries=0)
        await other.chat.completions.create(**chat)
    if kind == "malformed":
        async with httpx.AsyncClient() as http:
            r = await http.post(str(client.base_url).rstrip("/") + "/chat/completions",
                                content=b'{"messages": [', headers={
                                    "Authorization": f"Bearer {client.api_key}"})
        raise RuntimeError(f"the server answered {r.status_code}: {r.json()['error']['message']}")
    if kind == "huge_max_tokens":
        done = await client.chat.completions.create(**{**chat, "max_tokens": 10**9})
        return 1.0 if done.usage.completion_tokens > 0 else 0.0
    if kind == "no_reward":
        return "a reward"
    raise ValueError(kind)


# Set by a test to let the agents of rows whose answer ends in 7 make their first call
HOLD = threading.Event()


async def printable_held_on_7(client, row):
    """`printable`, once `HOLD` is set when the row's answer ends in 7: a continuous run's
    groups of those rows are still playing when the others have ended."""
    if str(row.get("answer", "")).endswith("7"):
        await asyncio.get_running_loop().run_in_executor(None, HOLD.wait)
    return await printable(client, row)
