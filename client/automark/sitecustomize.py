"""sitecustomize for salus-run's automatic PyTorch iteration marking.

salus-run puts this directory first on PYTHONPATH, so Python's site module
imports this file instead of the site's own sitecustomize. It therefore first
runs the next sitecustomize found on sys.path (the one it shadows), exactly as
site would, and then, when SALUS_AUTOMARK=1, arms salus_automark. It imports
nothing heavy: torch is hooked only if and when the program imports it.
"""

import os
import sys


def _chain():
    import importlib.machinery
    import importlib.util
    here = os.path.dirname(os.path.realpath(__file__))
    rest = [p for p in sys.path if os.path.realpath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # as site.execsitecustomize reports it
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
              f"{type(err).__name__}: {err}", file=sys.stderr)


_chain()
if os.environ.get("SALUS_AUTOMARK") == "1":
    import salus_automark
    salus_automark.enable()
