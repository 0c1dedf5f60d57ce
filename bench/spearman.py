#!/usr/bin/env python3
"""Spearman's rank correlation of (predicted, measured) pairs, ties sharing
their mean rank: the ranking check of bench/calibration_accuracy.sh and
bench/pipeline_accuracy.sh. As a program: reads "PREDICTED MEASURED" lines
from FILE and prints rho."""
import sys


def ranks(v):
    order = sorted(range(len(v)), key=lambda i: v[i])
    r = [0.0] * len(v)
    i = 0
    while i < len(order):  # ties share their mean rank
        j = i
        while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2
        i = j + 1
    return r


def spearman(xs, ys):
    p, m = ranks(xs), ranks(ys)
    n = len(p)
    mp, mm = sum(p) / n, sum(m) / n
    cov = sum((a - mp) * (b - mm) for a, b in zip(p, m))
    sd = (sum((a - mp) ** 2 for a in p) * sum((b - mm) ** 2 for b in m)) ** 0.5
    return cov / sd


if __name__ == "__main__":
    pairs = [tuple(map(float, line.split())) for line in open(sys.argv[1]) if line.strip()]
    print(f"{spearman([a for a, _ in pairs], [b for _, b in pairs]):.3f} {len(pairs)}")
