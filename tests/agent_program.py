"""An agent as a program (env.agent_command): the session's URL and key in its environment
(OPENAI_BASE_URL, OPENAI_API_KEY), the row as JSON on stdin; one chat call through the plain
`openai` client; the reward, the share of printable characters, as the last printed line."""

import json
import sys

import openai

row = json.loads(sys.stdin.readline())
client = openai.OpenAI(max_retries=0)
done = client.chat.completions.create(model="policy", max_tokens=4,
                                      messages=[{"role": "user", "content": row["prompt"]}])
text = done.choices[0].message.content or ""
print("log lines before the reward are ignored")
print(json.dumps({"reward": sum(32 <= ord(c) < 127 for c in text) / max(len(text), 1)}))
