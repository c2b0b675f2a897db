"""The bound on a lint/diff space: how many inputs it may hold, and what is left out past it.

The literal-aware space (`kvpolicy.engine.analysis.space`) is a product where
rules read fields together: every size variant a rule reads with the backend,
dtype, groups or options is paired with all of them, and every connector variant
with every shared part. A hostile rule directory (20 sizes compared with the
dtype and groups, 40 ``connector.extra`` keys in one condition, 10 connector
files and their MultiConnector pairs) reaches millions of inputs. So the space
holds at most ``max_inputs`` (`DEFAULT_MAX_INPUTS`, ``--max-space``):

1. Before any input is built, its size is estimated from the dimensions: for
   each size variant, the shared parts it pairs with times the connectors it
   pairs with (an upper bound: inputs the release refuses are counted).
2. Over the bound, variants are left out, least telling first: those that set
   two or more fields together (tier 2: sizes read together, extras read together,
   MultiConnector pairs), then those that set one (tier 1: one literal's
   boundary value, a connector said to prefer cross-layer blocks or not). Within
   a tier the costliest variant (size or connector) goes first, so the fewest
   go. Tier 0 (the default sizes, every connector as configured plainly)
   always stays.
3. If tier 0 alone is over the bound, inputs are built in order up to the bound
   and the rest are not (`Cut.stopped`).

Before all that, no list of variants is built longer than the bound could keep
(`kvpolicy.engine.analysis.space`: ``max(1000, max_inputs // 50)`` per list); the
variants past it are counted as left out, unbuilt.

The work is inputs x rules, not inputs alone: each input's decision evaluates every
rule of the analysed rule sets (lint: the rule set and its baseline; diff: both
sides), about 0.4 us a rule on top of about 90 us an input. So the bound is on
both (`inputs_for_rules`): ``max_inputs`` inputs of up to `WORK_RULES_PER_INPUT`
rules each; a rule set with more rules gets proportionally fewer inputs (1,000
rules: a fifth of the inputs), and the cut says so.

A cut space is reported (`Cut.describe`): lint's findings then hold for the
explored inputs only.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_MAX_INPUTS", "MAX_SPACE_LIMIT", "WORK_RULES_PER_INPUT", "Cut", "SizeCost", "inputs_for_rules",
           "plan_cut", "tier_of_override"]

# INVARIANT: above every shipped profile's space (the largest: vllm-0.27's 256,854 inputs, then 0.25/0.26's 239,538);
# tests/engine/analysis/test_space_budget.py fails when a profile outgrows it. Lint costs about 100 us and 2 KiB
# of peak memory per input on a hostile rule set, so this is about 30 s and 600 MB on the 2-core CI machine.
DEFAULT_MAX_INPUTS = 300_000
# The most ``max_inputs`` may be (--max-space): a bound, not a way to turn the bound off (about 3 hours of lint).
MAX_SPACE_LIMIT = 100_000_000


# The rules per input ``max_inputs`` is sized for: above every shipped profile's rule set with its baseline and
# a site layer of some dozens of rules (vllm-0.27's 256,854 inputs x 37 rules x 2). With the default bound,
# at most 60 million rule evaluations: 9,980 rules (the loader's limit is 10,000) get 6,012 inputs.
WORK_RULES_PER_INPUT = 200


def inputs_for_rules(max_inputs: int, rules: int) -> int:
    """The most inputs a space analysed with ``rules`` rules may hold: ``max_inputs`` up to
    `WORK_RULES_PER_INPUT` rules, else so many that inputs x rules stays within
    ``max_inputs`` x `WORK_RULES_PER_INPUT` (at least one)."""
    return max(1, min(max_inputs, max_inputs * WORK_RULES_PER_INPUT // max(rules, 1)))


def tier_of_override(over: dict[str, Any]) -> int:
    """0: nothing set; 1: one field set; 2: two or more set together."""
    return min(len(over), 2)


@dataclass(frozen=True)
class SizeCost:
    """One size variant's share of the estimate: the shared parts it pairs with, which connectors
    (indices; None: all), and how many of those parts each connector pairs with (``weights[c]``: a
    connector that only some of vLLM's option combinations allow counts in those only)."""

    cores: int
    allowed: frozenset[int] | None
    tier: int
    weights: tuple[int, ...]


@dataclass(frozen=True)
class Cut:
    """How a space was bounded: the bound, the estimated full size, and what was left out."""

    max_inputs: int
    estimated: int
    size_variants_left_out: int
    size_variants: int
    connectors_left_out: int
    connectors: int
    stopped: bool = False  # tier 0 alone was over the bound: inputs were built up to it, no further
    max_space: int = 0  # the bound asked (--max-space); max_inputs is less where the rules are many
    rules: int = 0  # the rules the space's inputs are decided with (`inputs_for_rules`)

    def describe(self) -> str:
        parts = []
        if self.size_variants_left_out:
            parts.append(f"{self.size_variants_left_out} of {self.size_variants} size variants")
        if self.connectors_left_out:
            parts.append(f"{self.connectors_left_out} of {self.connectors} connector variants")
        text = f"cut to at most {self.max_inputs} inputs (--max-space) from about {self.estimated}"
        if self.max_space > self.max_inputs:
            text = (f"cut to at most {self.max_inputs} inputs from about {self.estimated}: {self.rules} rules to "
                    f"decide each input with, and --max-space {self.max_space} allows {self.max_space} inputs of up to "
                    f"{WORK_RULES_PER_INPUT} rules ({self.max_space * WORK_RULES_PER_INPUT} rule evaluations)")
        if parts:
            text += ": left out " + " and ".join(parts) + " (fields set together first, then single literals)"
        if self.stopped:
            text += ("; the default sizes with each plain connector alone exceed the bound, so inputs were built "
                     "in order up to it and the rest left out")
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"max_inputs": self.max_inputs, "estimated_inputs": self.estimated,
                "size_variants": self.size_variants, "size_variants_left_out": self.size_variants_left_out,
                "connectors": self.connectors, "connectors_left_out": self.connectors_left_out,
                "stopped_at_bound": self.stopped, "max_space": self.max_space or self.max_inputs,
                "rules": self.rules}


def plan_cut(sizes: Sequence[SizeCost], conn_tiers: Sequence[int], max_inputs: int
             ) -> tuple[list[bool], list[bool], int, int]:
    """Which size variants and connectors to keep so that the estimate fits ``max_inputs``.

    Returns (keep each size variant, keep each connector, the full estimate, the kept estimate).
    Within tier 2, then tier 1, drops the variant (size or connector) that costs the most inputs
    at that point (ties: the one listed last), so the fewest variants go; never tier 0. Costs are
    kept in sums (size variants that pair with every connector share one), so dropping one
    variant costs time in the connectors it names, not in the whole list.
    """
    n_conns = len(conn_tiers)
    keep_size = [True] * len(sizes)
    keep_conn = [True] * n_conns
    vectors = {id(s.weights): s.weights for s in sizes}
    weight_sum = {k: sum(w) for k, w in vectors.items()}  # over the kept connectors
    cores_sum = dict.fromkeys(vectors, 0)  # kept size variants that pair with every connector
    named_weight = [0] * len(sizes)  # a size variant naming its connectors: their weight, kept ones
    named_cost = [0] * n_conns  # what such size variants add to each connector
    naming: list[list[int]] = [[] for _ in range(n_conns)]  # connector -> the size variants naming it
    for j, s in enumerate(sizes):
        if s.allowed is None:
            cores_sum[id(s.weights)] += s.cores
            continue
        for c in s.allowed:
            named_weight[j] += s.weights[c]
            named_cost[c] += s.cores * s.weights[c]
            naming[c].append(j)

    def size_cost(j: int) -> int:
        s = sizes[j]
        return s.cores * (weight_sum[id(s.weights)] if s.allowed is None else named_weight[j])

    def conn_cost(c: int) -> int:
        return named_cost[c] + sum(vectors[k][c] * cores_sum[k] for k in vectors)

    full = total = sum(size_cost(j) for j in range(len(sizes)))
    for tier in (2, 1):
        if total <= max_inputs:
            break
        # a max-heap of (cost, position) with stale entries pushed back: costs only ever go down
        heap = [(-size_cost(j), -j, True, j) for j in range(len(sizes)) if sizes[j].tier == tier]
        heap += [(-conn_cost(c), -(len(sizes) + c), False, c) for c in range(n_conns) if conn_tiers[c] == tier]
        heapq.heapify(heap)
        while total > max_inputs and heap:
            cost, order, is_size, i = heapq.heappop(heap)
            now = size_cost(i) if is_size else conn_cost(i)
            if -cost != now:
                heapq.heappush(heap, (-now, order, is_size, i))
                continue
            total -= now
            if is_size:
                keep_size[i] = False
                s = sizes[i]
                if s.allowed is None:
                    cores_sum[id(s.weights)] -= s.cores
                else:
                    for c in s.allowed:
                        named_cost[c] -= s.cores * s.weights[c]
            else:
                keep_conn[i] = False
                for k, w in vectors.items():
                    weight_sum[k] -= w[i]
                for j in naming[i]:
                    if keep_size[j]:
                        named_weight[j] -= sizes[j].weights[i]
    return keep_size, keep_conn, full, total
