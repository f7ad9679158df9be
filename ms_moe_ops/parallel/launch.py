"""Running a script on several processes with MindSpore's launcher (msrun), for tests,
benchmarks and quick experiments: a free port, a short cluster time-out, the worker logs in one
directory, and a hard time-out after which every process of the job is ended. A failure raises
`LaunchError` carrying the last lines of each worker's log. msrun's multi-node form (one launch
per node, each starting its share of the workers) is `local_workers`, `master_addr`,
`master_port` and `node_rank`."""
import glob
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil  # a MindSpore dependency

__all__ = ["LaunchError", "msrun", "free_port", "log_tails", "worker_path"]


class LaunchError(RuntimeError):
    """A launched job failed or timed out; the message ends with each worker log's last lines."""


def free_port():
    """A TCP port nobody listens on right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tails(log_dir, lines=25):
    """The last `lines` lines of every worker log (and of the launcher's own) in log_dir."""
    parts = []
    for path in sorted(glob.glob(os.path.join(log_dir, "*.log"))):
        with open(path, errors="replace") as f:
            tail = f.read().splitlines()[-lines:]
        name = os.path.basename(path)
        parts.append(f"--- {name} (last {len(tail)} lines) ---\n" + "\n".join(tail))
    return "\n".join(parts) if parts else f"(no logs in {log_dir})"


def msrun(script, args=(), workers=2, timeout=300, log_dir=None, cluster_time_out=60, env=None,
          local_workers=None, master_addr="127.0.0.1", master_port=None, node_rank=None):
    """Runs `python script *args` on `workers` processes with msrun and waits for them.

    The workers run on the caller's interpreter (its directory goes first on PATH, where msrun
    finds `python`: a virtual environment works without being activated) and import the same
    ms_moe_ops as the caller (its directory goes first on PYTHONPATH); they run in `log_dir` (a
    new temporary directory by default; MindSpore writes its rank_<n>/ dumps there) and log
    there as worker_<rank>.log; `script` is taken as absolute.
    `timeout` (seconds) bounds the whole job: past it, the launcher, the scheduler and every
    worker are ended by process group. Returns log_dir; raises LaunchError (with the logs' last
    lines) when the job fails or times out.

    Several nodes (msrun's --worker_num, --local_worker_num, --master_addr, --master_port,
    --node_rank): run msrun() once on every node with the same `workers` (all of them),
    `master_addr` (the address of node 0, where the scheduler runs) and `master_port`, and each
    node's `local_workers` (the processes it starts) and `node_rank` (0, 1, ...); the workers of
    node i get the global ranks [i * local_workers, (i + 1) * local_workers). By default one
    launch starts every worker here (local_workers=workers, a free port). Launches on one host
    standing for several nodes (tests) work too: msrun starts a scheduler wherever master_addr
    is an address of the host, and every one but the first finds the port taken and exits, which
    makes msrun report a failure although every worker succeeded; msrun() then judges the launch
    by its workers (_only_scheduler_refused).
    """
    local_workers = workers if local_workers is None else local_workers
    if not 1 <= local_workers <= workers:
        raise ValueError(f"msrun: need 1 <= local_workers <= workers, got local_workers="
                         f"{local_workers}, workers={workers}")
    nodes = local_workers < workers
    if nodes and (master_port is None or node_rank is None):
        raise ValueError(f"msrun: a launch of {local_workers} of {workers} workers (one node of "
                         f"several) needs the master_port and node_rank every node agrees on, got "
                         f"master_port={master_port}, node_rank={node_rank}")
    log_dir = log_dir or tempfile.mkdtemp(prefix="msrun_")
    os.makedirs(log_dir, exist_ok=True)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run_env = dict(os.environ if env is None else env)
    paths = (package_root, run_env.get("PYTHONPATH"))
    run_env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    run_env["PATH"] = worker_path(run_env.get("PATH"))
    run_env.setdefault("GLOG_v", "3")
    cmd = [sys.executable, "-m", "mindspore.parallel.cluster.run", f"--worker_num={workers}",
           f"--local_worker_num={local_workers}", f"--master_addr={master_addr}",
           f"--master_port={master_port or free_port()}",
           *([] if node_rank is None else [f"--node_rank={node_rank}"]), f"--log_dir={log_dir}",
           "--join=True", f"--cluster_time_out={cluster_time_out}", "--tail_worker_log=-1",
           os.path.abspath(script), *map(str, args)]
    with open(os.path.join(log_dir, "msrun.log"), "w") as out:
        launcher = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=run_env,
                                    cwd=log_dir, start_new_session=True)
    try:
        rc = launcher.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end_job(launcher)
        raise LaunchError(f"{os.path.basename(script)}: no result within {timeout} s on {workers} "
                          f"processes (ended them); logs in {log_dir}\n"
                          f"{log_tails(log_dir)}") from None
    finally:
        _end_job(launcher)
    if rc != 0 and not (nodes and _only_scheduler_refused(log_dir)):
        raise LaunchError(f"{os.path.basename(script)} failed on {local_workers} processes (msrun "
                          f"exit code {rc}); logs in {log_dir}\n{log_tails(log_dir)}")
    return log_dir


def _only_scheduler_refused(log_dir):
    """Whether msrun failed only because this launch's scheduler could not take the port, which
    another launch's scheduler holds (launches on one host standing for nodes): its log says so,
    and msrun's says no worker failed."""
    def read(name):
        try:
            with open(os.path.join(log_dir, name), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    launcher, scheduler = read("msrun.log"), read("scheduler.log")
    return ("Failed to create the TCP server" in scheduler
            and re.search(r"Scheduler process \d+ exit with exception", launcher) is not None
            and re.search(r"Worker process \d+ exit with exception", launcher) is None)


def worker_path(path):
    """PATH with the directory of this interpreter (sys.executable) first: msrun starts each
    worker as `python`, looked up on PATH."""
    here = os.path.dirname(os.path.abspath(sys.executable))
    return os.pathsep.join([here] + [p for p in (path or "").split(os.pathsep) if p and p != here])


def _end_job(launcher):
    """Ends the launcher and everything it started. msrun puts each worker in a session of its
    own, so the process groups are found from the launcher's descendants, recorded first."""
    try:
        children = psutil.Process(launcher.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    groups = {launcher.pid}
    for child in children:
        try:
            groups.add(os.getpgid(child.pid))
        except ProcessLookupError:
            pass
    groups.discard(os.getpgrp())  # never the caller's own group
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [g for g in groups if _signal_group(g, sig)]
        if not alive:
            break
        time.sleep(0.5 if sig == signal.SIGTERM else 0)
    try:
        launcher.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _signal_group(pgid, sig):
    """Sends sig to process group pgid; False when the group is gone."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
