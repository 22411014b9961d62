"""Talk to ``hf-parallel serve`` with the official openai client: one answer, then one streamed.

    torchrun --nproc-per-node 2 -m hf_parallel serve --port 8000 &     # the embedded SmolLM2, TP=2
    python examples/serve_client.py                                    # BASE_URL, API_KEY, MODEL to change

``MODEL`` is the served name: the checkpoint directory's name, or ``--served-model-name``.
"""

import os

import openai

client = openai.OpenAI(base_url=os.environ.get("BASE_URL", "http://127.0.0.1:8000/v1"),
                       api_key=os.environ.get("API_KEY", "unused"))  # fmt: skip
model = os.environ.get("MODEL") or client.models.list().data[0].id
question = [{"role": "user", "content": os.environ.get("PROMPT", "What is tensor parallelism? One sentence.")}]
max_tokens = int(os.environ.get("NEW_TOKENS", "32"))

answer = client.chat.completions.create(model=model, messages=question, max_tokens=max_tokens, temperature=0)
print(answer.choices[0].message.content, flush=True)
stream = client.chat.completions.create(model=model, messages=question, max_tokens=max_tokens, temperature=0,
                                        stream=True)  # fmt: skip
print("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices), flush=True)
