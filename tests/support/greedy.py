"""Greedy decoding token by token, for tests that compare two caches step by step."""
from __future__ import annotations

import numpy as np


def greedy_continuation(llm, n: int = 12):
    """(tokens, logits): the greedy tokens after what `llm`'s cache holds, and the logits each was drawn from."""
    tokens, logits = [], []
    for _ in range(n):
        logits.append(llm.last_logits().copy())
        tokens.append(int(np.argmax(logits[-1])))
        llm.eval([tokens[-1]])
    return tokens, np.stack(logits)


def greedy_trace(llm, prompt_tokens, n: int):
    """(generated tokens, logits after each fed token): reset, feed `prompt_tokens`, then `n` greedy tokens (the
    logits after the last one included)."""
    llm.reset()
    llm.eval(prompt_tokens)
    tokens, logits = greedy_continuation(llm, n)
    return tokens, np.concatenate([logits, llm.last_logits()[None]])
