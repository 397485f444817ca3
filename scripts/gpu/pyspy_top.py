"""Self and total time per function (and per thread) from py-spy's raw collapsed stacks:
``python3 scripts/gpu/pyspy_top.py FILE [N]`` prints the top N of each as a table."""

import sys
from collections import Counter


def main(path: str, n: int = 40) -> None:
    own, total, threads = Counter(), Counter(), Counter()
    samples = 0
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack:
            continue
        count = int(count)
        frames = stack.split(";")
        samples += count
        threads[frames[0]] += count
        own[frames[-1]] += count
        for f in set(frames[1:]):
            total[f] += count
    print(f"{samples} samples")
    for title, table in (("thread", threads), ("self", own), ("total", total)):
        print(f"\n| {title} | share |\n|---|---:|")
        for name, c in table.most_common(n):
            print(f"| {name[:150]} | {c / samples:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
