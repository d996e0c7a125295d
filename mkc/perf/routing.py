"""How many routed experts the slowest rank runs per MoE layer, under uniform routing.

A rank runs the distinct experts of its group that any row picked. The step waits for the
slowest group among the ranks that all-reduce the routed experts' output together, so the
step-time model needs the expected *maximum* over those groups, not the mean one group sees
(`mkc.cost.expected_local_experts`, which the HBM floor uses).

Model (the same uniform routing the floor assumes): E experts in G groups of n consecutive
experts; each of B rows picks a uniformly random set of k distinct experts, independently.

Exact computation, in two steps:

1. U, the set of experts any row picked. Row by row, |U| is a Markov chain: from |U| = u a
   new row's k picks hold j experts outside U with probability
   C(E - u, j) C(u, k - j) / C(E, k) (hypergeometric), so P(|U| = u) after B rows follows by
   B steps of a chain on u <= min(E, B k).
2. The law of U is unchanged by any permutation of the experts, so given |U| = u, U is a
   uniformly random u-subset of the E experts: the groups' counts are multivariate
   hypergeometric. The number of u-subsets in which each of the c covered groups holds at
   most m experts is the coefficient of x^u in
       (sum_{j <= m} C(n, j) x^j)^c (1 + x)^{n (G - c)},
   so P(max <= m | u) is that over C(E, u), and E[max] = sum_u P(u) sum_{m >= 0} P(max > m | u).

Probabilities are exact fractions (polynomials as Python ints, multiplied by Kronecker
substitution); the sum over m stops once P(max > m) < 2^-64, so E[max] is exact to float
precision. The result is cached per (E, k, G, c, B); Kimi K3 (E 896, k 16, G 8) at batch 8
takes about 0.3 s, once per process.
"""
from __future__ import annotations

from fractions import Fraction
from functools import lru_cache
from math import comb

from mkc import ir

# Stop once P(max > m) is below this: the neglected tail moves E[max] by less than
# n * TAIL, far below float precision.
TAIL = Fraction(1, 2 ** 64)


@lru_cache(maxsize=None)
def union_size_distribution(experts: int, top_k: int, batch: int) -> tuple[Fraction, ...]:
    """P(|U| = u) for u = 0 .. min(E, B k): U the experts `batch` rows pick, k each."""
    E, k = experts, top_k
    total = comb(E, k)
    dist = [Fraction(1)]                     # zero rows: U is empty
    for _ in range(batch):
        nxt = [Fraction(0)] * min(E + 1, len(dist) + k)
        for u, p in enumerate(dist):
            if not p:
                continue
            for j in range(0, min(k, E - u) + 1):
                ways = comb(E - u, j) * comb(u, k - j)
                if ways:
                    nxt[u + j] += p * Fraction(ways, total)
        dist = nxt
    return tuple(dist)


def _poly_mul(a: list[int], b: list[int], deg: int, width: int) -> list[int]:
    """a * b truncated to degree `deg`, for coefficients below 2 ** (8 * width): by Kronecker
    substitution, one big-integer product of the coefficients packed `width` bytes apart."""
    def pack(p: list[int]) -> int:
        return int.from_bytes(b"".join(c.to_bytes(width, "little") for c in p[: deg + 1]),
                              "little")

    n = min(len(a) + len(b) - 1, deg + 1)
    raw = (pack(a) * pack(b)).to_bytes(width * (len(a) + len(b)), "little")
    return [int.from_bytes(raw[i * width:(i + 1) * width], "little") for i in range(n)]


def _poly_pow(a: list[int], e: int, deg: int, width: int) -> list[int]:
    out = [1]
    while e:
        if e & 1:
            out = _poly_mul(out, a, deg, width)
        e >>= 1
        if e:
            a = _poly_mul(a, a, deg, width)
    return out


@lru_cache(maxsize=None)
def max_distribution(experts: int, top_k: int, groups: int, covered: int, batch: int
                     ) -> tuple[Fraction, ...]:
    """P(max over `covered` of the `groups` groups of their picked experts = m), m = 0 .. n."""
    E, G, c = experts, groups, covered
    if E % G or not 1 <= c <= G:
        raise ValueError(f"{E} experts do not split into {G} groups covering {c}")
    n = E // G
    pu = union_size_distribution(E, top_k, batch)
    umax = len(pu) - 1
    rest = [comb(n * (G - c), j) for j in range(min(n * (G - c), umax) + 1)]
    # a kept coefficient (degree u <= umax) counts u-subsets of at most E experts
    width = comb(E, min(umax, E // 2)).bit_length() // 8 + 1
    cdf = []                                 # cdf[m] = P(max <= m)
    for m in range(n + 1):
        if m >= min(n, umax):                # no group can hold more: max <= m surely
            cdf.append(Fraction(1))
            break
        if c == G and m * G < top_k:         # one row alone picks more than G * m
            cdf.append(Fraction(0))
            continue
        per_group = [comb(n, j) for j in range(min(m, n) + 1)]
        poly = _poly_mul(_poly_pow(per_group, c, umax, width), rest, umax, width)
        poly += [0] * (umax + 1 - len(poly))
        cdf.append(sum((p * Fraction(poly[u], comb(E, u)) for u, p in enumerate(pu) if p),
                       Fraction(0)))
        if 1 - cdf[-1] < TAIL:               # the rest of the law is below float precision
            cdf[-1] = Fraction(1)
            break
    return tuple(cdf[0:1] + [b - a for a, b in zip(cdf, cdf[1:])])


def expected_max(experts: int, top_k: int, groups: int, covered: int, batch: int) -> float:
    """E[max picked experts over `covered` of `groups` equal groups], `batch` rows of top_k."""
    dist = max_distribution(experts, top_k, groups, covered, batch)
    return float(sum(m * p for m, p in enumerate(dist)))


def expected_mean(experts: int, top_k: int, groups: int, batch: int) -> float:
    """E[picked experts of one group]: n (1 - (1 - k / E)^B), what the HBM floor uses."""
    n = experts // groups
    return n * (1 - (1 - top_k / experts) ** batch)


def reduce_peers(s: ir.ScheduleIR, rank: int = 0) -> set[int]:
    """The ranks that all-reduce the routed experts' output with `rank` (itself included):
    the stages of the all-reduce after the op that runs the experts. Just `rank` when no
    all-reduce follows it."""
    for k in s.kinds.values():
        if k.fetch is None:
            continue
        ar = next((a for a in k.allreduces if a.after_op == k.fetch.consumer), None)
        if ar is None:
            return {rank}
        peers = {rank}
        for size, stride in ar.stages:
            peers = {r - (r // stride % size) * stride + i * stride
                     for r in peers for i in range(size)}
        return peers
    return {rank}


def expert_groups(s: ir.ScheduleIR) -> tuple[int, int]:
    """(groups of the model's experts, groups among the reduce peers of rank 0)."""
    local = s.per_rank["local_experts"]
    groups = s.experts_total // local
    tp = s.per_rank.get("expert_tp", 1)
    covered = len({r // tp for r in reduce_peers(s)})
    return groups, covered


def slowest_group_experts(s: ir.ScheduleIR, batch: int) -> float | None:
    """Expected routed experts the slowest of the reduce peers' groups runs per MoE layer at
    `batch` under uniform routing; None for a model without routed experts."""
    if not s.experts:
        return None
    groups, covered = expert_groups(s)
    return expected_max(s.experts_total, s.top_k, groups, covered, batch)
