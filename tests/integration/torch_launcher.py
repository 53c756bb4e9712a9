"""A launcher for test_salus_run.py, as torchrun and torch.multiprocessing.spawn
are: it imports torch (so salus-run's automark attaches it to the session) and
runs torch_job.py in a child process, whose exit status it returns.
test_salus_run.py runs Debian's real torchrun too; this covers the launchers'
other shapes (CUDA initialised or used by the launcher, two workers in turn,
torch.multiprocessing.spawn).

    torch_launcher.py subprocess|cuinit|gpu|twice|spawn TORCH_JOB_ARGS...

subprocess: the job as a new program (torchrun's agent starts workers so);
cuinit: the same after the launcher initialised CUDA, as
torch.cuda.is_available() does (through the shim: SALUS_SHIM_LIBCUDA);
gpu: the same after the launcher allocated GPU memory itself: it keeps the
session, and the job it runs is refused;
twice: that, then once more (a second stage, or an elastic restart), whose
report waits for both runs' iterations (iterations_done, the session's) (TORCH_JOB_ARGS start with MODE N);
spawn: torch.multiprocessing.spawn of a function that runs the job's main.
"""
import os
import subprocess
import sys

import torch  # noqa: F401  (a launcher imports torch before its workers start)

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "torch_job.py")


def worker(_rank, argv):
    sys.path.insert(0, HERE)
    sys.argv = [JOB, *argv]
    import torch_job
    torch_job.main()


def main():
    how, argv = sys.argv[1], sys.argv[2:]
    if how == "cuinit":
        import ctypes
        assert ctypes.CDLL(None).cuInit(0) == 0
    if how == "gpu":
        sys.path.insert(0, HERE)
        import torch_job
        torch_job.gpu_alloc()
    if how in ("subprocess", "cuinit", "gpu"):
        sys.exit(subprocess.run([sys.executable, JOB, *argv]).returncode)
    if how == "twice":
        first = subprocess.run([sys.executable, JOB, *argv]).returncode
        wait = ["--wait-key", f"iterations_done={2 * int(argv[1])}"]
        sys.exit(first or subprocess.run([sys.executable, JOB, *argv, *wait]).returncode)
    import torch.multiprocessing as mp
    mp.spawn(worker, args=(argv,), nprocs=1)


if __name__ == "__main__":
    main()
