"""salus_automark: iteration boundaries for unmodified PyTorch programs.

salus-run starts Python with SALUS_AUTOMARK=1 and this directory on PYTHONPATH;
its sitecustomize calls enable(), which waits for `import torch` (an import hook
that looks at one module name and never imports torch itself) and then
registers, through PyTorch's public hooks:

- training: a boundary after every optimizer step. torch >= 2.0 has a global
  optimizer-step post hook (torch.optim.optimizer.register_optimizer_step_post_hook);
  PyTorch 1.13 has none, so Optimizer._hook_for_profile, which 1.13 runs for every
  optimizer it builds, is extended to wrap that optimizer class's step the same
  way the profiler does. Nested steps (a subclass calling super().step()) count
  once.
- inference: a boundary after the outermost module forward (global forward
  pre/post hooks, depth counted per thread), only while no optimizer step has
  ever been seen, so training is not counted twice. A forward run with autograd
  off (no_grad, inference_mode) is a boundary at once. One run with autograd on
  might be a training forward whose step is still to come, so its boundary is
  held and taken when the next outermost forward starts without an optimizer
  step in between (the last such forward of a program is not counted). Once an
  optimizer step is seen, the forward hooks are removed: a training loop pays
  for them only until its first step.

The marker is libsalus-shim.so's salus_step(), found with ctypes in the process
(the shim is LD_PRELOADed by salus-run). Without it, enable() warns once and
installs nothing.

With SALUS_SHARED_LANE=alloc or segments (salus-run --shared-lane=alloc), each boundary
first hands PyTorch's cached GPU memory back: once CUDA is initialised,
torch.cuda.synchronize() and then torch.cuda.empty_cache(). The caching
allocator keeps freed blocks cached, so without it nothing allocated in an
iteration would go back to the shared lane: the shim would promote every
segment to the program's own memory at the boundary. After empty_cache only
the segments that hold live tensors (weights, optimizer state) are promoted,
once each. Harmless where CUDA never started (a CPU torch).
"""

import ctypes
import importlib.abc
import os
import sys
import threading

__all__ = ["enable", "install", "shim_marker", "report_oom"]


def shim_marker():
    """salus_step from the shim loaded in this process, or None."""
    try:
        fn = ctypes.CDLL(None).salus_step
    except (AttributeError, OSError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = []
    return fn


def releasing(mark):
    """`mark` preceded by salus.lane_release() when SALUS_SHARED_LANE=alloc or segments: the
    client module's, which salus.step() runs too (salus-run puts both on
    PYTHONPATH)."""
    if os.environ.get("SALUS_SHARED_LANE") not in ("alloc", "segments"):
        return mark
    try:
        import salus
    except ImportError:
        _warn("salus.py is not on PYTHONPATH (run the program under salus-run); PyTorch's "
              "cached GPU memory is not released to the shared lane at boundaries")
        return mark

    def release_then_mark():
        try:
            salus.lane_release()
        finally:
            mark()

    return release_then_mark


def compiling_test(torch):
    """A function that says whether torch.compile is tracing now (never, before 2.0).

    The forward hooks are global, so Dynamo traces them inside a compiled
    module, and their thread-local depth count would break the graph at every
    module: different kernels than the same program compiled natively, so its
    losses would no longer be bit-identical. Dynamo folds this test to a
    constant, and the hooks return before anything it cannot trace. The
    compiled module's own call (OptimizedModule) runs its hooks eagerly, so the
    outermost forward is still counted."""
    compiler = getattr(torch, "compiler", None)
    test = getattr(compiler, "is_compiling", None)  # torch >= 2.3
    if test is None and "torch._dynamo" in sys.modules:  # 2.0 - 2.2; never imported here
        test = getattr(sys.modules["torch._dynamo"], "is_compiling", None)
    return test or (lambda: False)


class Marker:
    """The hooks' shared state for one process: what has been seen, what to call."""

    def __init__(self, mark, compiling=lambda: False):
        self.mark = mark               # called at every boundary
        self.compiling = compiling     # whether torch.compile is tracing (compiling_test)
        self.optimizer_seen = False
        self.local = threading.local()  # .depth: module forwards open on this thread
        self.pending = False           # a grad-enabled forward ended: a boundary, unless a step follows
        self.handles = []              # forward hooks, removed once training is seen
        self.boundaries = 0

    def boundary(self):
        self.boundaries += 1
        self.mark()

    # ---- training
    def optimizer_step(self, *_):
        self.pending = False
        if not self.optimizer_seen:
            self.optimizer_seen = True
            for h in self.handles:
                h.remove()
            self.handles = []
        self.boundary()

    # ---- inference
    def forward_pre(self, module, args):
        if self.compiling():
            return
        depth = getattr(self.local, "depth", 0)
        self.local.depth = depth + 1
        if depth == 0 and self.pending and not self.optimizer_seen:
            self.pending = False
            self.boundary()

    def forward_post(self, module, args, output):
        if self.compiling():
            return
        depth = getattr(self.local, "depth", 1) - 1
        self.local.depth = max(depth, 0)
        if depth > 0 or self.optimizer_seen:
            return
        if self._grad_enabled():
            self.pending = True
        else:
            self.boundary()

    def _grad_enabled(self):
        torch = sys.modules.get("torch")
        return torch is None or torch.is_grad_enabled()


def _wrap_step(marker, step):
    """step wrapped so that the outermost call on a thread ends with a boundary."""
    import functools

    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        local = marker.local
        local.step_depth = getattr(local, "step_depth", 0) + 1
        try:
            out = step(*args, **kwargs)
        finally:
            local.step_depth -= 1
        if local.step_depth == 0:
            marker.optimizer_step()
        return out

    wrapper._salus_automark = True
    for attr in ("hooked",):  # keep 1.13's profiler flag, so it does not wrap again
        if hasattr(step, attr):
            setattr(wrapper, attr, getattr(step, attr))
    return wrapper


def _install_optimizer_hook(torch, marker):
    import importlib
    opt_mod = importlib.import_module("torch.optim.optimizer")  # 1.13 deletes torch.optim.optimizer
    if hasattr(opt_mod, "register_optimizer_step_post_hook"):
        opt_mod.register_optimizer_step_post_hook(marker.optimizer_step)
        return "register_optimizer_step_post_hook"
    Optimizer = opt_mod.Optimizer
    original = Optimizer._hook_for_profile

    def _hook_for_profile(self):
        original(self)
        cls = self.__class__
        if not getattr(cls.step, "_salus_automark", False):
            cls.step = _wrap_step(marker, cls.step)

    Optimizer._hook_for_profile = _hook_for_profile
    return "Optimizer._hook_for_profile"


def _install_forward_hooks(torch, marker):
    import importlib
    mod = importlib.import_module("torch.nn.modules.module")
    try:  # torch >= 2.1: the post hook runs even when forward raises
        post = mod.register_module_forward_hook(marker.forward_post, always_call=True)
    except TypeError:
        post = mod.register_module_forward_hook(marker.forward_post)
    pre = mod.register_module_forward_pre_hook(marker.forward_pre)
    marker.handles = [pre, post]


def install(torch, mark):
    """Registers the hooks on an imported torch; `mark` is called at each boundary.
    Returns the Marker (its counters are what tests look at)."""
    marker = Marker(mark, compiling_test(torch))
    marker.how = _install_optimizer_hook(torch, marker)
    _install_forward_hooks(torch, marker)
    return marker


class _TorchFinder(importlib.abc.MetaPathFinder):
    """Waits for `import torch`; looks at nothing else and imports nothing."""

    def __init__(self, on_torch):
        self.on_torch = on_torch

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, on_torch = spec.loader, self.on_torch
        exec_module = loader.exec_module

        def exec_then_hook(module):
            exec_module(module)
            on_torch(module)

        loader.exec_module = exec_then_hook
        return spec


_warned = False
marker = None  # the installed Marker, once torch was imported


def _warn(msg):
    global _warned
    if not _warned:
        _warned = True
        print(f"salus automark: {msg}", file=sys.stderr)


def report_oom(exc):
    """Tells salus-run (SALUS_RUN_OOM_FD) that the program died of CUDA OOM."""
    fd = os.environ.get("SALUS_RUN_OOM_FD")
    text = f"{type(exc).__name__}: {exc}"
    if not fd or ("out of memory" not in text.lower() and "OutOfMemory" not in text):
        return
    try:
        os.write(int(fd), b"oom\n")
    except (OSError, ValueError):
        pass


def _excepthook(previous):
    def hook(etype, value, tb):
        report_oom(value)
        previous(etype, value, tb)
    return hook


def _attach_now():
    """Attaches the process to its session before the first iteration.

    The shim attaches lazily, at cuInit or at the first boundary. A program whose
    first optimizer step comes before any CUDA call (a CPU program, or one that
    touches CUDA only inside its loop) would otherwise end its first iteration
    at the boundary that attaches it: work salusd never granted nor counted. One
    boundary now, while torch is being imported and nothing has run, attaches
    it; the setup before it is nobody's iteration."""
    if not os.environ.get("SALUS_SESSION"):
        return
    try:
        lib = ctypes.CDLL(None)
        if not lib.salus_attached():
            lib.salus_step()
    except (AttributeError, OSError):
        pass


def enable(mark=None):
    """Arms automatic marking for when torch is imported. `mark` defaults to the
    shim's salus_step (and then the process attaches when torch is imported);
    without the shim, warns once and does nothing."""
    attach = mark is None
    if mark is None:
        mark = shim_marker()
        if mark is None:
            _warn("libsalus-shim.so is not loaded in this process (run the program under "
                  "salus-run); iterations are not marked")
            return False
    if os.environ.get("SALUS_RUN_OOM_FD"):
        sys.excepthook = _excepthook(sys.excepthook)

    def on_torch(torch):
        global marker
        # Every process of the job marks, but only the one attached to the session
        # reaches salusd: the shim refuses a second process (DataLoader workers
        # started with spawn, torch.compile's compile workers) quietly, and a
        # launcher (torchrun, mp.spawn) hands the session to the child that
        # uses the GPU (client/salus_gate.h, hand-over).
        try:
            marker = install(torch, releasing(mark))
        except Exception as e:  # never break the program's import of torch
            _warn(f"could not register PyTorch hooks ({type(e).__name__}: {e}); "
                  "iterations are not marked")
            return
        if attach:
            _attach_now()

    if "torch" in sys.modules:
        on_torch(sys.modules["torch"])
    else:
        sys.meta_path.insert(0, _TorchFinder(on_torch))
    return True
