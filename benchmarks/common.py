"""Timing helpers shared by the benchmarks."""
import os
import statistics
import time


def timeit(fn, repeat=5, warmup=2):
    """Median wall time of fn() in seconds (fn must block until its result is ready)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timed_together(contenders, repeat=5, warmup=1):
    """{name: median seconds} of [(name, fn)]: every contender warmed up (and compiled), then
    timed in turns, round after round, so that a change in the machine's load hits all alike."""
    for _, fn in contenders:
        for _ in range(warmup):
            fn()
    times = {name: [] for name, _ in contenders}
    for _ in range(repeat):
        for name, fn in contenders:
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def cores():
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0))


def report(title, rows, baseline):
    """rows: [(name, seconds, extra)]; prints times and each row's speed relative to ours."""
    print(f"\n{title}")
    ours = dict((r[0], r[1]) for r in rows)[baseline]
    for name, seconds, extra in rows:
        ratio = seconds / ours
        print(f"  {name:<34} {seconds * 1e3:9.2f} ms  {extra:<18} {ratio:6.2f}x the time of {baseline}")
