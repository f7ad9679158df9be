"""Timing helpers shared by the benchmarks."""
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


def report(title, rows, baseline):
    """rows: [(name, seconds, extra)]; prints times and each row's speed relative to ours."""
    print(f"\n{title}")
    ours = dict((r[0], r[1]) for r in rows)[baseline]
    for name, seconds, extra in rows:
        ratio = seconds / ours
        print(f"  {name:<34} {seconds * 1e3:9.2f} ms  {extra:<18} {ratio:6.2f}x the time of {baseline}")
