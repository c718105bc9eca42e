"""What a batch step costs, on the target's calibrated verify curve (core/verify_cost.verify_costs: T(b)/T(1), the
time of one b-row decode in one-row steps). The batch prices each slot's drafted rows by what they add to the whole
step (BatchEngine._price_rows) and decides whether padding the step to one pass pays (BatchEngine._padding_pays)."""

from __future__ import annotations


def pass_cost(curve: dict[int, float], b: int) -> float:
    """T(b)/T(1) on a calibrated curve, extended beyond its largest b along its last slope."""
    if b in curve:
        return curve[b]
    top = max(curve)
    slope = (curve[top] - curve[top - 1]) if top - 1 in curve else 1.0
    return curve[top] + max(slope, 0.0) * (b - top)


def batch_ratios(curve: dict[int, float], n: int, unified: bool, may_pad: bool, upto: int) -> dict[int, float]:
    """b -> what a slot's verify of b rows costs in its plain-step shares, when it shares each step with n - 1
    one-row slots (see BatchEngine._price_rows): 1 + (C(b) - C(1)) / (C(1) / n)."""
    n = max(1, int(n))
    if n == 1:
        return {b: pass_cost(curve, b) for b in range(1, upto + 1)}
    base = pass_cost(curve, n)
    out = {}
    for b in range(1, upto + 1):
        if unified:
            c = pass_cost(curve, n + b - 1)
        else:
            c = base + (pass_cost(curve, b - 1) if b > 1 else 0.0)
            if may_pad and b > 1:
                c = min(c, pass_cost(curve, n * b))
        out[b] = 1.0 + (c - base) / (base / n)
    return out
