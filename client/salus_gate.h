/* salus_gate.h: the gate of an attached session, shared by salusd and
 * libsalus-shim.so (and readable from Python with ctypes).
 *
 * An *attached* session is a program that keeps its own CUDA context (PyTorch,
 * any CUDA program) and is scheduled by salusd only at iteration boundaries.
 * The gate is one page of shared memory plus a doorbell; no FUSE round trip
 * happens per iteration.
 *
 * Set-up (once per process, by the shim):
 *   1. the program makes a sealed memfd of sizeof(struct salus_gate)
 *      (memfd_create MFD_CLOEXEC|MFD_ALLOW_SEALING, ftruncate, then
 *      F_SEAL_SHRINK|F_SEAL_GROW|F_SEAL_SEAL) and fills in the header;
 *   2. it makes an eventfd (EFD_CLOEXEC|EFD_NONBLOCK): the doorbell to salusd;
 *   3. it writes `attach gate=FD bell=FD` to its session's ctl. salusd takes
 *      both fds out of the *writing* process with pidfd_getfd (so they work
 *      from any container: no shared /dev/shm or socket path is needed), checks
 *      the seals, the size and the header, and keeps a pidfd of the process:
 *      when it exits, the session ends.
 *
 * Iterations are numbered from 1. Iteration k runs from the grant of k to the
 * program's k-th boundary (salus_step()). Iteration 1 is gated like the rest:
 * the program writes the header with `requested` = 1 and, once the attach
 * write has succeeded, waits for `granted` >= 1 before its first work (so salusd
 * must grant 1 to start it). Every attach is a fresh gate, numbered from 1
 * again (a program that re-attaches after a salusd restart starts over). At
 * boundary k the program:
 *   - records an end event for k and sets `requested` = k + 1;
 *   - rings the doorbell if `granted` < k + 1, and waits on `grant_word`
 *     (FUTEX_WAIT, shared) until `granted` >= k + 1.
 * When iteration k's work has finished on the GPU (its event completed), the
 * program adds its device time to `gpu_ns_total`, sets `completed` = k and
 * rings the doorbell. salusd treats a grant as a dispatch and a completion as
 * the end of that iteration, exactly as for hosted work: the same
 * GpuScheduler decides, and a lane's pipeline depth bounds
 * `granted - completed`.
 *
 * Yield: salusd sets `yield_requested` to make an unmarked program (marking !=
 * EXPLICIT) come to a boundary (SALUS_MARK_SLICE) at its next launch, and
 * clears it before it grants that boundary's next iteration; a request left
 * set makes every launch a boundary.
 *
 * Liveness: salusd bumps `heartbeat` at least every 100 ms while it serves the
 * gate. A program that sees no change for SALUS_GATE_DEAD_MS, or `state` ==
 * SALUS_GATE_DETACHED, runs ungated (it never exits because of salusd) and
 * tries to attach again later.
 *
 * Hand-over: a session has one attached process. A launcher that attached
 * before its job started (salus-run's PyTorch automark attaches a process when
 * it imports torch, so torchrun's or mp.spawn's parent does) hands the session
 * to the process that does the GPU work: an attach from a process whose gate
 * says `uses_gpu` = 1 takes the session over from the attached one when that
 * one's gate says `uses_gpu` = 0 and the newcomer descends from it (its parent,
 * or the parent's parent, ...). salusd ends the old gate as at a detach, but
 * sets `state` = SALUS_GATE_HANDED_OVER: the old process runs on ungated and
 * never tries to attach again. The program sets `uses_gpu` once it has
 * allocated device memory: before its attach write when it had, and in the live
 * gate when it does so later (a program that attached at `import torch` and
 * then built its model on the GPU keeps the session). Initialising CUDA is not
 * enough: launchers call torch.cuda.is_available(), which initialises it.
 * (Version 3. A version 2 gate cannot say, so salusd never hands over from
 * one: a program of an older shim keeps its session.)
 *
 * Memory: `budget_bytes` is what the session may hold on the GPU (persistent +
 * ephemeral of its `need`; UINT64_MAX: no limit). The shim charges every
 * allocation to `charged_bytes` before it reaches the driver and refuses one
 * that would pass the budget.
 *
 * Swap (version 2): salusd may ask a program that is waiting at the gate (no
 * iteration in flight) to move its memory off the GPU: it writes
 * `swap_request` = SALUS_SWAP_REQ_OUT, increments `swap_seq` and wakes
 * `grant_word`. The program carries it out while it waits (never on a launch):
 * it synchronizes, copies every movable allocation to pinned host memory (or a
 * spill file), and only when every copy is safe releases the device memory,
 * keeping each virtual address reserved. It then writes its figures and
 * `swap_result`, sets `swap_done_seq` = `swap_seq` and rings. A failure (host
 * memory, spill disk) leaves everything on the GPU and says why in
 * `swap_result` and `note`. SALUS_SWAP_REQ_IN brings the memory back to the
 * same addresses; a grant while swapped brings it back before the program
 * runs, whatever salusd asked. `budget_bytes`/`charged_bytes` do not change:
 * the session's need is the same wherever its memory is.
 *
 * Shared lane (opt-in, SALUS_SHARED_LANE=1): the program also makes a Unix
 * socket pair (SOCK_SEQPACKET) and writes `attach gate=FD bell=FD lane=FD`,
 * naming salusd's end; salusd takes it with pidfd_getfd like the gate. Sessions
 * of the lane then share one physical allocation for their ephemeral memory.
 * salusd sends its fd (a POSIX-fd VMM handle) with one struct salus_lane_msg
 * by SCM_RIGHTS before it first sets `lane_grant` to that memory's generation
 * (a new generation: a new message). While `lane_grant` equals the generation,
 * the program may map the memory and serve its ephemeral allocations from it;
 * it says so in `lane_held`. When salusd sets `lane_grant` to 0, the program,
 * at its next wait at the gate, synchronizes its context, unmaps the memory,
 * sets `lane_held` = 0 and rings: only then (or once the pidfd says the process
 * exited) does salusd give the lane to another session, clearing it first
 * (cuMemsetD8 + synchronize in salusd's context) when that session's uid
 * differs. These fields live in what version 2 reserved: a program that never
 * names lane= sees 0 there and nothing changes for it.
 *
 * All counters are naturally aligned and accessed with atomic operations
 * (C11 atomics / std::atomic_ref, or __atomic builtins); fields are owned by
 * one side, as marked. Layout is fixed: grow it only by appending and raising
 * SALUS_GATE_VERSION.
 */
#ifndef SALUS_GATE_H
#define SALUS_GATE_H

#include <stddef.h>
#include <stdint.h>

#define SALUS_GATE_MAGIC 0x5441474553554C53ULL /* "SLUSGATE" little-endian */
#define SALUS_GATE_VERSION 3u
/* The oldest version salusd still takes: a program whose shim predates an
 * upgrade of salusd re-attaches with it (version 2 has no `uses_gpu`). */
#define SALUS_GATE_VERSION_OLDEST 2u
#define SALUS_GATE_DEAD_MS 2000u
#define SALUS_GATE_NOTE_BYTES 512u

/* state, written by salusd */
#define SALUS_GATE_ATTACHING 0u /* the program filled in the header; salusd has not taken it */
#define SALUS_GATE_ATTACHED 1u  /* salusd serves the gate */
#define SALUS_GATE_DETACHED 2u  /* salusd let go (session ended, salusd stopping): run ungated */
/* a descendant that uses the GPU took the session (hand-over): run ungated, never attach again */
#define SALUS_GATE_HANDED_OVER 3u

/* swap_request, written by salusd (with a new swap_seq) */
#define SALUS_SWAP_REQ_NONE 0u
#define SALUS_SWAP_REQ_OUT 1u /* at this boundary: move the movable memory to the host */
#define SALUS_SWAP_REQ_IN 2u  /* bring it back now (ahead of the grant) */

/* swap_state, written by the program */
#define SALUS_SWAP_RESIDENT 0u /* all of its memory is on the GPU */
#define SALUS_SWAP_OUT_BUSY 1u /* copying out */
#define SALUS_SWAP_SWAPPED 2u  /* its movable memory is on the host (or in a spill file) */
#define SALUS_SWAP_IN_BUSY 3u  /* copying back */

/* marking, written by the program */
#define SALUS_MARK_NONE 0u     /* no boundary seen yet */
#define SALUS_MARK_EXPLICIT 1u /* salus_step() / salus.step() / automatic PyTorch hooks */
#define SALUS_MARK_SLICE 2u    /* fallback: salusd asked an unmarked program to yield */

struct salus_gate {
  /* ---- header: written by the program before attach, read-only after ---- */
  uint64_t magic;    /* SALUS_GATE_MAGIC */
  uint32_t version;  /* SALUS_GATE_VERSION */
  uint32_t size;     /* sizeof(struct salus_gate) */
  int32_t pid;       /* the program's pid in its own namespace (for messages only) */
  uint32_t uses_gpu; /* the program's, at any time: 1 once it has allocated device memory
                        (the hand-over, above; version 3: reserved, 0, in version 2) */

  /* ---- written by salusd ---- */
  uint32_t state;           /* SALUS_GATE_* */
  uint32_t grant_word;      /* futex word: incremented after every change of granted/state */
  uint64_t granted;         /* iterations the program may start: 1..granted */
  uint64_t heartbeat;       /* incremented at least every 100 ms while attached */
  uint64_t budget_bytes;    /* device memory the session may hold; UINT64_MAX: no limit */
  uint32_t yield_requested; /* an unmarked program should come to a boundary (slice) */
  uint32_t gpu;             /* salusd's index of the session's GPU */
  uint64_t quantum_ns;      /* fallback slice length salusd wants, device time */
  uint32_t swap_request;    /* SALUS_SWAP_REQ_*, valid once swap_seq changed (version 2) */
  uint32_t swap_seq;        /* incremented (after swap_request is written) for each request */
  uint64_t lane_bytes;      /* size of the shared lane memory this session may map (0: none) */
  uint32_t lane_grant;      /* the lane memory's generation the program may map; 0: must not */
  uint32_t reserved2;
  uint64_t reserved1;

  /* ---- written by the program ---- */
  uint64_t requested;               /* highest iteration the program wants to start */
  uint64_t completed;               /* iterations whose GPU work has finished (in order) */
  uint64_t gpu_ns_total;            /* device time of completed iterations, summed */
  uint64_t charged_bytes;           /* device memory charged now */
  uint64_t peak_bytes;              /* the most ever charged */
  uint64_t launches;                /* kernel launches seen (relaxed) */
  uint64_t gate_waits;              /* boundaries that had to wait for a grant */
  uint64_t gate_wait_ns;            /* time spent waiting, summed */
  uint64_t oom_refusals;            /* allocations refused for the budget */
  uint32_t marking;                 /* SALUS_MARK_* */
  uint32_t note_seq;                /* incremented after `note` is rewritten */
  char note[SALUS_GATE_NOTE_BYTES]; /* one line for the session log (NUL-terminated) */
  /* swap (version 2), the program's report; written before swap_done_seq */
  uint32_t swap_done_seq;     /* the swap_seq of the last request carried out (or refused) */
  uint32_t swap_state;        /* SALUS_SWAP_* */
  int32_t swap_result;        /* of that request: 0, or -errno (-ENOMEM: pinned host memory,
                                 -ENOSPC: spill disk full, -EIO: driver, -ENOTSUP: not movable) */
  uint32_t lane_held;         /* the lane generation the program has mapped; 0: unmapped and
                                 synchronized (the yield report of a shared lane) */
  uint64_t resident_bytes;    /* charged bytes now on the GPU */
  uint64_t swapped_bytes;     /* charged bytes now on the host or in the spill file */
  uint64_t swaps_out;         /* swap-outs done */
  uint64_t swaps_in;          /* swap-ins done */
  uint64_t swap_ns;           /* wall time of all swaps, summed */
  uint64_t unswappable_bytes; /* charged bytes the shim cannot move (see libsalus-shim(3)) */
};

#ifdef __cplusplus
static_assert(sizeof(struct salus_gate) % 8 == 0, "salus_gate: 8-byte multiple");
#endif

/* The one message of the lane socket, salusd -> program, carrying the lane
 * memory's fd (SCM_RIGHTS, one fd). */
#define SALUS_LANE_MAGIC 0x454E414C53554C53ULL /* "SLUSLANE" little-endian */
struct salus_lane_msg {
  uint64_t magic;      /* SALUS_LANE_MAGIC */
  uint64_t bytes;      /* size of the memory (a multiple of the VMM granularity) */
  uint32_t generation; /* what `lane_grant` will say while the program may map it */
  uint32_t reserved;
};

/* The C entry points libsalus-shim.so exports (also through ctypes):
 *   int salus_step(void);        an iteration boundary: ends the running iteration and
 *                                returns once the next one is granted. 0, or -errno when the
 *                                program is not attached (it then runs ungated; never fatal).
 *   int salus_attached(void);    1 while salusd serves the gate, else 0.
 *   uint64_t salus_iterations(void);  boundaries passed so far.
 * With SALUS_SHARED_LANE=1 (the shared lane, libsalus-shim(3)):
 *   int salus_lane_alloc(CUdeviceptr *p, size_t n);  ephemeral memory from the lane, valid
 *                                until the program's next boundary. 0, -ENOTCONN (no lane held
 *                                now: not attached, not opted in, or outside an iteration),
 *                                -ENOMEM (the lane is full), -EINVAL.
 *   int salus_lane_free(unsigned long long p);  gives one back before the boundary (0, -EINVAL).
 *   uint64_t salus_lane_bytes(void);  size of the lane memory held now (0: none).
 */
#ifdef __cplusplus
extern "C" {
#endif
int salus_step(void);
int salus_attached(void);
uint64_t salus_iterations(void);
int salus_lane_alloc(unsigned long long* p, size_t n); /* p: a CUdeviceptr */
int salus_lane_free(unsigned long long p);
uint64_t salus_lane_bytes(void);
#ifdef __cplusplus
}
#endif

#endif /* SALUS_GATE_H */
