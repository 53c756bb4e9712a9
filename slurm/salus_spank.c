/* salus_spank.so: a Slurm SPANK plugin that gives each job step a salusd session.
 *
 *   srun --salus=persistent=4G,ephemeral=8G[,iters=N,priority=N,gpu=N|any,kind=K] CMD
 *
 * On the node, as the job's user (slurm_spank_user_init runs with the user's
 * effective uid), it makes the named session MOUNT/sessions/slurm-JOB.STEP with
 * mkdir, declares its needs with a `need` line on its ctl (kind=attached where
 * the shim is preloaded, so that the program's CUDA context is counted from the
 * start, unless --salus says kind=), and exports
 * SALUS_SESSION and SALUS_MOUNT to the tasks (salus(5), salusctl run does the
 * same). When the step ends, also when it is cancelled, slurmstepd calls
 * slurm_spank_exit as root, which removes the session (rmdir frees everything it
 * held). A node without salusd fails the step at once with a clear error rather
 * than leaving it to hang.
 *
 * plugstack.conf:  required /usr/lib/x86_64-linux-gnu/slurm-wlm/salus_spank.so mount=/salus
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <slurm/slurm.h>
#include <slurm/spank.h>

SPANK_PLUGIN(salus, 1);

#define SALUS_ARG_MAX 256
#define SALUS_PATH_MAX 1200

static char salus_mount[1024] = "/salus";
/* libsalus-shim.so: when the file exists, tasks get it in LD_PRELOAD, so CUDA
 * programs attach to the step's session (SALUS_SESSION). */
#ifndef SALUS_SHIM_DEFAULT
#define SALUS_SHIM_DEFAULT "/usr/lib/x86_64-linux-gnu/libsalus-shim.so"
#endif
static char salus_shim[1024] = SALUS_SHIM_DEFAULT;
static char salus_arg[SALUS_ARG_MAX];      /* the --salus value; empty: not asked for */
static char salus_session[SALUS_PATH_MAX]; /* the session made for this step */
/* Why the step cannot have its session. slurm_spank_user_init records it and
 * slurm_spank_task_init fails each task with it: a failed user_init makes
 * slurmd report a launch failure for which srun 22.05 still exits 0, while a
 * task that fails exits 1, so the job fails visibly. */
static char salus_failure[1024];

/* Checks "key=value[,key=value...]" with the keys of `need` and writes the
 * `need` line, without its newline, to `need` (size `cap`); `*have_kind` says
 * whether it names kind=. Returns 0, or -1 with `why` set. */
static int salus_parse(const char* arg, char* need, size_t cap, int* have_kind, char* why,
                       size_t why_cap) {
  char copy[SALUS_ARG_MAX];
  int have_p = 0, have_e = 0;
  *have_kind = 0;
  if (strlen(arg) >= sizeof copy) {
    snprintf(why, why_cap, "--salus: longer than %d characters", SALUS_ARG_MAX - 1);
    return -1;
  }
  strcpy(copy, arg);
  snprintf(need, cap, "need");
  for (char *save = NULL, *kv = strtok_r(copy, ",", &save); kv; kv = strtok_r(NULL, ",", &save)) {
    char* eq = strchr(kv, '=');
    if (!eq || eq == kv || eq[1] == '\0') {
      snprintf(why, why_cap, "--salus: '%s' is not KEY=VALUE", kv);
      return -1;
    }
    *eq = '\0';
    const char* v = eq + 1;
    if (strcmp(kv, "persistent") && strcmp(kv, "ephemeral") && strcmp(kv, "iters") &&
        strcmp(kv, "priority") && strcmp(kv, "gpu") && strcmp(kv, "kind")) {
      snprintf(why, why_cap,
               "--salus: unknown key '%s' (persistent, ephemeral, iters, priority, gpu, kind)", kv);
      return -1;
    }
    if (!strcmp(kv, "kind") && strcmp(v, "attached") && strcmp(v, "hosted")) {
      snprintf(why, why_cap, "--salus: kind=%s: attached or hosted", v);
      return -1;
    }
    for (const char* c = v; *c; ++c) {
      if (!((*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') ||
            *c == '.')) {
        snprintf(why, why_cap, "--salus: bad value '%s' for %s", v, kv);
        return -1;
      }
    }
    have_p |= !strcmp(kv, "persistent");
    have_e |= !strcmp(kv, "ephemeral");
    *have_kind |= !strcmp(kv, "kind");
    size_t used = strlen(need);
    snprintf(need + used, cap - used, " %s=%s", kv, v);
  }
  if (!have_p || !have_e) {
    snprintf(why, why_cap, "--salus: persistent= and ephemeral= are required");
    return -1;
  }
  return 0;
}

static int salus_opt(int val, const char* optarg, int remote) {
  char need[512], why[256];
  int have_kind;
  (void)val;
  if (!optarg || salus_parse(optarg, need, sizeof need, &have_kind, why, sizeof why) != 0) {
    if (!remote) slurm_error("%s", optarg ? why : "--salus needs an argument");
    return -1;
  }
  snprintf(salus_arg, sizeof salus_arg, "%s", optarg);
  return 0;
}

struct spank_option spank_options[] = {
    {"salus", "persistent=SIZE,ephemeral=SIZE[,iters=N,priority=N,gpu=N|any,kind=attached|hosted]",
     "Run each step in a salusd session with these needs (see docs/slurm.md)", 1, 0,
     (spank_opt_cb_f)salus_opt},
    SPANK_OPTIONS_TABLE_END};

int slurm_spank_init(spank_t sp, int ac, char** av) {
  for (int i = 0; i < ac; ++i) {
    if (!strncmp(av[i], "mount=", 6) && av[i][6] == '/') {
      snprintf(salus_mount, sizeof salus_mount, "%s", av[i] + 6);
    } else if (!strncmp(av[i], "shim=", 5) && (av[i][5] == '/' || av[i][5] == '\0')) {
      snprintf(salus_shim, sizeof salus_shim, "%s", av[i] + 5); /* shim= : none */
    } else {
      slurm_error("salus: unknown plugstack.conf argument '%s' (mount=/PATH, shim=/PATH)", av[i]);
      return -1;
    }
  }
  /* sbatch and salloc take the option too; spank_options covers srun. */
  if (spank_context() == S_CTX_ALLOCATOR) return spank_option_register(sp, spank_options);
  return 0;
}

static int salus_write_all(int fd, const char* s) {
  size_t left = strlen(s);
  while (left > 0) {
    ssize_t n = write(fd, s, left);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -1;
    s += n;
    left -= (size_t)n;
  }
  return 0;
}

/* Records why the step has no session, logs it, and lets the launch go on to
 * slurm_spank_task_init, which fails the tasks with it. */
__attribute__((format(printf, 1, 2))) static int salus_fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(salus_failure, sizeof salus_failure, fmt, ap);
  va_end(ap);
  slurm_error("%s", salus_failure);
  return 0;
}

/* Whether the tasks get the shim: it is configured and installed. */
static int salus_shim_installed(void) {
  return salus_shim[0] != '\0' && access(salus_shim, R_OK) == 0;
}

/* Puts the shim first in the tasks' LD_PRELOAD when it is installed; a node
 * without it runs the step with the file interface only. */
static int salus_preload_shim(spank_t sp) {
  char old[2048] = "", preload[4096];
  if (!salus_shim_installed()) return 0;
  if (spank_getenv(sp, "LD_PRELOAD", old, sizeof old) != ESPANK_SUCCESS) old[0] = '\0';
  if (old[0])
    snprintf(preload, sizeof preload, "%s %s", salus_shim, old);
  else
    snprintf(preload, sizeof preload, "%s", salus_shim);
  if (spank_setenv(sp, "LD_PRELOAD", preload, 1) != ESPANK_SUCCESS)
    return salus_fail("salus: cannot set LD_PRELOAD for the tasks");
  return 0;
}

/* Remote, as the job's user: the session, its needs, and the tasks' environment. */
int slurm_spank_user_init(spank_t sp, int ac, char** av) {
  uint32_t job = 0, step = 0;
  char need[512], why[256], dir[SALUS_PATH_MAX], ctl[SALUS_PATH_MAX + 8], stepname[32];
  int have_kind;
  (void)ac;
  (void)av;
  if (salus_arg[0] == '\0') return 0;
  if (salus_parse(salus_arg, need, sizeof need, &have_kind, why, sizeof why) != 0) {
    return salus_fail("salus: %s", why);
  }
  /* With the shim, the tasks' CUDA programs attach: say so from the first need,
   * so that placement counts their contexts (salusd --attach-context-reserve). */
  size_t used = strlen(need);
  snprintf(need + used, sizeof need - used, "%s\n",
           !have_kind && salus_shim_installed() ? " kind=attached" : "");
  if (spank_get_item(sp, S_JOB_ID, &job) != ESPANK_SUCCESS ||
      spank_get_item(sp, S_JOB_STEPID, &step) != ESPANK_SUCCESS) {
    return salus_fail("salus: cannot get the job and step ids");
  }
  if (step == SLURM_BATCH_SCRIPT)
    snprintf(stepname, sizeof stepname, "batch");
  else
    snprintf(stepname, sizeof stepname, "%u", step);
  snprintf(dir, sizeof dir, "%s/sessions/slurm-%u.%s", salus_mount, job, stepname);
  if (mkdir(dir, 0700) != 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTCONN)
      return salus_fail(
          "salus: no salusd on this node: mkdir %s: %s (is salusd running, mounted at %s?)", dir,
          strerror(err), salus_mount);
    return salus_fail("salus: mkdir %s: %s", dir, strerror(err));
  }
  snprintf(salus_session, sizeof salus_session, "%s", dir);
  snprintf(ctl, sizeof ctl, "%s/ctl", dir);
  const int fd = open(ctl, O_WRONLY | O_CLOEXEC);
  if (fd < 0 || salus_write_all(fd, need) != 0) {
    const int err = errno;
    need[strcspn(need, "\n")] = '\0';
    if (fd >= 0) close(fd);
    /* slurm_spank_exit removes the session */
    return salus_fail("salus: %s: %s: %s", ctl, strerror(err), need);
  }
  close(fd);
  if (spank_setenv(sp, "SALUS_SESSION", dir, 1) != ESPANK_SUCCESS ||
      spank_setenv(sp, "SALUS_MOUNT", salus_mount, 1) != ESPANK_SUCCESS) {
    return salus_fail("salus: cannot set SALUS_SESSION/SALUS_MOUNT for the tasks");
  }
  return salus_preload_shim(sp);
}

/* Remote, in each task just before exec, as the job's user. */
int slurm_spank_task_init(spank_t sp, int ac, char** av) {
  (void)sp;
  (void)ac;
  (void)av;
  if (salus_failure[0] == '\0') return 0;
  slurm_error("%s", salus_failure);
  return -1;
}

/* Remote, as root, when the step ends however it ends: free the session. */
int slurm_spank_exit(spank_t sp, int ac, char** av) {
  (void)sp;
  (void)ac;
  (void)av;
  if (salus_session[0] == '\0') return 0;
  if (rmdir(salus_session) != 0 && errno != ENOENT && errno != ENOTCONN)
    slurm_error("salus: rmdir %s: %s", salus_session, strerror(errno));
  salus_session[0] = '\0';
  return 0;
}
