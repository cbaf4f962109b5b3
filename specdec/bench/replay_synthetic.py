"""Replay streams made in code, model-free and deterministic (a fixed seed): text shaped like
the traffic suffix decoding serves, over made-up token ids, small enough for a test.

- `records`: a fixed instruction, then a record's fields in a random order; the answer is
  JSON-shaped, the fields in a fixed order, each value copied from the prompt, optional
  fields sometimes left out (the structure comes from earlier answers, the values from the
  prompt);
- `edits`: a function of repeated identifiers; the answer is the function with one
  identifier renamed (long copies from the prompt, broken where the new name appears);
- `agent`: a growing tool loop; each answer is one of a few call shapes with arguments
  taken from the latest tool result.
"""

from __future__ import annotations

import random

from specdec.bench.replay_stream import StreamRequest

SEED = 20261205
NUM_REQUESTS = 24

# Token ids by role, apart so that the streams' texts do not collide by accident.
OPEN, CLOSE, COLON, COMMA, QUOTE, END = 1, 2, 3, 4, 5, 6
HEADER = list(range(10, 30))           # the chat template and the instruction
FIELD_NAMES = list(range(40, 48))      # records' keys
WORDS = list(range(100, 400))          # values, identifiers, free text
TOOL_NAMES = list(range(50, 54))
ARG_NAMES = list(range(60, 66))


def _records(rng: random.Random) -> list[StreamRequest]:
    stream = []
    for _ in range(NUM_REQUESTS):
        fields = [(name, rng.sample(WORDS, rng.randint(1, 4))) for name in FIELD_NAMES
                  if name < 44 or rng.random() < 0.5]  # four fields always, four sometimes
        shown = fields[:]
        rng.shuffle(shown)
        prompt = HEADER + [token for name, value in shown for token in (name, COLON, *value)]
        answer = [OPEN]
        for index, (name, value) in enumerate(fields):
            answer += [QUOTE, name, QUOTE, COLON, QUOTE, *value, QUOTE]
            answer += [COMMA] if index + 1 < len(fields) else []
        stream.append(StreamRequest(prompt, answer + [CLOSE, END]))
    return stream


def _edits(rng: random.Random) -> list[StreamRequest]:
    stream = []
    for _ in range(NUM_REQUESTS):
        names = rng.sample(WORDS, 6)
        body = [rng.choice(names) if rng.random() < 0.5 else rng.choice(WORDS) for _ in range(48)]
        old, new = names[0], rng.choice([word for word in WORDS if word not in names])
        prompt = HEADER[:12] + [old, COLON, new, COLON] + body
        answer = [new if token == old else token for token in body]
        stream.append(StreamRequest(prompt, answer + [END]))
    return stream


def _agent(rng: random.Random) -> list[StreamRequest]:
    stream = []
    transcript = list(HEADER)
    for _ in range(NUM_REQUESTS):
        result = rng.sample(WORDS, rng.randint(3, 8))
        transcript = (transcript + [OPEN, *result, CLOSE])[-400:]
        tool = rng.choice(TOOL_NAMES)
        args = rng.sample(ARG_NAMES, 2 if tool < 52 else 1)
        call = [OPEN, QUOTE, tool, QUOTE, COMMA]
        for arg in args:
            call += [QUOTE, arg, QUOTE, COLON, QUOTE, *rng.sample(result, 2), QUOTE]
        answer = call + [CLOSE, END]
        stream.append(StreamRequest(HEADER[:8] + transcript, answer))
        transcript = transcript + answer
    return stream


def synthetic_streams(seed: int = SEED) -> dict[str, list[StreamRequest]]:
    return {f"synthetic-{name}": make(random.Random(f"{seed}-{name}"))
            for name, make in (("records", _records), ("edits", _edits), ("agent", _agent))}
