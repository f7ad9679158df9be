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


# -- results as data ------------------------------------------------------------------------------
# The goal benchmarks record their measurement of each goal as a row of a CSV (--csv, --run); the
# tables of README.md and docs/performance.md are generated from it (tools/bench_tables.py).

GOAL_FIELDS = ("goal", "run", "ours", "other", "unit", "ratio")


def add_record_arguments(parser):
    parser.add_argument("--csv", default=None,
                        help="record each goal's result in this CSV (benchmarks/results/goals.csv; "
                             "tools/bench_tables.py makes the README's table of it)")
    parser.add_argument("--run", default="quiet",
                        help="name of this run in the CSV (e.g. quiet, loaded): a row of the same "
                             "goal and run is replaced")


def record_goal(args, goal, ours, other, unit, ratio):
    """One goal's result (ours and the other contender in `unit`, the goal's ratio) into
    args.csv, replacing the row of the same goal and run; nothing without --csv."""
    import csv  # pylint: disable=import-outside-toplevel

    if not getattr(args, "csv", None):
        return
    rows = []
    if os.path.exists(args.csv):
        with open(args.csv, newline="", encoding="utf-8") as f:
            rows = [r for r in csv.DictReader(f) if (r["goal"], r["run"]) != (goal, args.run)]
    rows.append(dict(goal=goal, run=args.run, ours=f"{ours:.4g}", other=f"{other:.4g}", unit=unit,
                     ratio=f"{ratio:.4g}"))
    with open(args.csv, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=GOAL_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
