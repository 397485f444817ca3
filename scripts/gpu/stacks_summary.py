"""Summarize SCORER_STACK_SAMPLES' collapsed stacks: per thread, its samples, the share whose stack
ends in a Python-level wait, and its most frequent innermost frames (the last three of a stack: a
leaf that blocks in C, such as gRPC's poll, reads as busy here and is recognisable by its name).
    python3 scripts/gpu/stacks_summary.py stacks.txt [top]"""

import sys
from collections import Counter, defaultdict

# thread.py:_worker as a leaf: an executor thread blocked in its work queue's get (C)
WAITS = (
    "threading.py:wait",
    "selectors.py:select",
    "queue.py:get",
    "thread.py:_worker",
    "threading.py:_wait_for_tstate_lock",
)


def main(path: str, top: int = 12) -> None:
    totals, idle = Counter(), Counter()
    leaves: dict[str, Counter] = defaultdict(Counter)
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        stack, n = line.rsplit(" ", 1)
        parts, n = stack.split(";"), int(n)
        totals[parts[0]] += n
        if parts[-1].endswith(WAITS):
            idle[parts[0]] += n
        else:
            leaves[parts[0]][" < ".join(reversed(parts[-3:]))] += n
    for thread, n in totals.most_common():
        print(f"== {thread}: {n} samples, {100 * idle[thread] / n:.0f}% in a wait")
        for leaf, k in leaves[thread].most_common(top):
            print(f"  {100 * k / n:5.1f}%  {leaf}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
