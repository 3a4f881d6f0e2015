"""``overlap_violations``: the overlapped step's rule (an expert all-to-all waited for only after the
other microbatch's compute ran since its start) checked on recorded events."""

from __future__ import annotations


def overlap_violations(events: list[tuple]) -> list[str]:
    """Expert all-to-alls waited for with nothing of the other microbatch run since their start, where
    the rule does not allow it.

    ``events``: ("run", p) when program p takes over, ("done", p), ("start", p[, id]) and ("wait", p[, id])
    for an all-to-all program p started / waits for; outside an overlapped region p is -1 (not checked).
    An all-to-all started while the other program still had work must see that program run (a
    ("run", other) event) before its wait, unless it is waited at once inside a chain, as routing
    counts or as a side buffer: then the program must still have an all-to-all in flight when it
    hands over (``moe_engine.moe.dispatch.HandOver``). One started after the other finished has
    nothing to hide behind."""
    problems, pending = [], {0: [], 1: []}
    done = {0: False, 1: False}
    runs = {0: 0, 1: 0}
    # Per program: exchanges waited at once in the current slice.
    unfollowed: dict[int, list[int]] = {0: [], 1: []}
    for index, (kind, p, *exchange) in enumerate(events):
        if kind == "run":
            other = 1 - p
            if unfollowed[other] and not pending[other] and not done[p]:
                problems.append(f"program {other} waited at once at events {unfollowed[other]} and handed over")
            unfollowed[other] = []
            runs[p] += 1
            continue
        if kind == "done":
            done[p] = True
            continue
        if p < 0:
            continue
        other = 1 - p
        if kind == "start":
            pending[p].append((index, runs[other], done[other], exchange))
        elif kind == "wait":
            # Paired by the exchange's id where recorded (one waited at once may have started after one
            # still in flight), else first in, first out.
            at = next(i for i, entry in enumerate(pending[p]) if entry[3] == exchange) if exchange else 0
            _, runs_then, other_done, _ = pending[p].pop(at)
            if not other_done and runs[other] == runs_then:
                unfollowed[p].append(index)
    if any(pending.values()):
        problems.append(f"all-to-alls never waited for: {pending}")
    return problems
