"""Megatron-Core's expert capacity in numpy, written from its documentation (the MoE README of
megatron/core/transformer/moe and the docstrings of get_capacity / apply_router_token_dropping),
not from this package's code: the independent model the capacity tests compare with.

- "capacity = num_tokens_per_rank * topk * capacity_factor / num_experts", rounded up
  (get_capacity: ceil(num_tokens / num_experts * capacity_factor) with num_tokens = T * topk);
- "the tokens exceed the capacity of expert will be dropped based on their selected
  probabilities" ("probs": the lowest probabilities are dropped) or "tokens at the end of each
  batch will be dropped" ("position"); the dropping is per rank, before any exchange;
- a dropped (token, expert) pair is masked out of the routing map and its probability zeroed: it
  contributes nothing, and the other probabilities are not renormalised;
- padding to capacity only adds rows of probability 0: the output is the same.
Megatron's top-k leaves the order of equal probabilities open; the model keeps the earlier token,
as the package documents.
"""
import math

import numpy as np


def capacity(tokens, top_k, num_experts, factor):
    return math.ceil(tokens * top_k / num_experts * factor)


def keep_mask(probs, expert_idx, num_experts, factor, policy):
    """bool [T, K]: which routed (token, slot) pairs each expert keeps."""
    t, k = expert_idx.shape
    cap = capacity(t, k, num_experts, factor)
    keep = np.zeros((t, k), bool)
    for e in range(num_experts):
        pairs = [(tok, slot) for tok in range(t) for slot in range(k) if expert_idx[tok, slot] == e]
        if policy == "probs":  # highest probability first; equal ones: the earlier token
            pairs.sort(key=lambda p: (-probs[p], p[0]))
        elif policy != "position":
            raise ValueError(policy)
        for pair in pairs[:cap]:
            keep[pair] = True
    return keep


def moe_output(x, probs, expert_idx, keep, expert):
    """sum over kept pairs of probs * expert(e, x[t]) (expert(e, rows) -> rows), float64."""
    out = np.zeros_like(np.asarray(x, np.float64))
    for tok, slot in zip(*np.nonzero(keep)):
        out[tok] += probs[tok, slot] * expert(expert_idx[tok, slot], x[tok:tok + 1])[0]
    return out
