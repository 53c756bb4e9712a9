"""A notebook server's part, for test_salus_run.py: starts a real IPython
kernel (jupyter_client and ipykernel, as Jupyter does), runs torch_job.py's
main as a cell in it, restarts the kernel, and runs the cell again. Prints
each cell's output (torch_job's report of its session) as it came, and
exits 1 if a cell failed.

    notebook_driver.py TORCH_JOB_ARGS...   (the second cell adds
                                            --wait-key iterations_done=2N)
"""
import os
import sys

from jupyter_client.manager import start_new_kernel

HERE = os.path.dirname(os.path.abspath(__file__))


def cell(argv):
    return (f"import sys\nsys.path.insert(0, {HERE!r})\n"
            f"sys.argv = {['torch_job.py', *argv]!r}\n"
            "import torch_job\ntorch_job.main()\n")


def run(kc, code):
    """Runs `code` in the kernel; prints its output; True if it succeeded."""
    failed = []

    def hook(msg):
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            print(content["text"], end="", file=sys.stdout if content["name"] == "stdout"
                  else sys.stderr)
        elif kind == "error":
            failed.append("\n".join(content["traceback"]))

    reply = kc.execute_interactive(code, output_hook=hook, timeout=120)
    for tb in failed:
        print(tb, file=sys.stderr)
    return reply["content"]["status"] == "ok" and not failed


def main():
    argv = sys.argv[1:]
    km, kc = start_new_kernel(kernel_name="python3")  # ipykernel, on this python
    try:
        ok = run(kc, cell(argv))
        km.restart_kernel(now=False)  # a shutdown request, as the notebook's Restart
        kc.wait_for_ready(timeout=60)
        ok = ok and run(kc, cell([*argv, "--wait-key", f"iterations_done={2 * int(argv[1])}"]))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
