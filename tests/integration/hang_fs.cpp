/* A hostile filesystem for tests: a FUSE mount (libfuse3 low-level API) that
 * never answers some requests, like a dead NFS hard mount or a malicious
 * allow_other FUSE mount would.
 *
 *   hang_fs MOUNTPOINT
 *
 * The root directory lists nothing. A lookup of "file" finds a 64 MiB regular
 * file (mode 0644, owned by root) whose reads are never answered; a lookup of
 * any other name is never answered. The process serves until it is killed; the
 * kernel then fails every request left unanswered with ENOTCONN, which is how
 * a test gets its stuck callers back. */
#define FUSE_USE_VERSION 312
#include <fuse3/fuse_lowlevel.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

constexpr fuse_ino_t kFileIno = 2;
constexpr off_t kFileSize = 64 << 20;

static void fill(fuse_ino_t ino, struct stat* st) {
  memset(st, 0, sizeof *st);
  st->st_ino = ino;
  if (ino == FUSE_ROOT_ID) {
    st->st_mode = S_IFDIR | 0755;
    st->st_nlink = 2;
  } else {
    st->st_mode = S_IFREG | 0644;
    st->st_nlink = 1;
    st->st_size = kFileSize;
  }
}

static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  if (parent != FUSE_ROOT_ID || strcmp(name, "file") != 0) return; /* never answered */
  struct fuse_entry_param e;
  memset(&e, 0, sizeof e);
  e.ino = kFileIno;
  fill(kFileIno, &e.attr);
  fuse_reply_entry(req, &e);
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info* fi) {
  (void)fi;
  struct stat st;
  fill(ino, &st);
  fuse_reply_attr(req, &st, 0);
}

static void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info* fi) {
  if (ino != kFileIno) {
    fuse_reply_err(req, EISDIR);
    return;
  }
  fi->direct_io = 1; /* every read comes here */
  fuse_reply_open(req, fi);
}

static void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                    struct fuse_file_info* fi) {
  (void)req, (void)ino, (void)size, (void)off, (void)fi; /* never answered */
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s MOUNTPOINT\n", argv[0]);
    return 2;
  }
  struct fuse_lowlevel_ops ops;
  memset(&ops, 0, sizeof ops);
  ops.lookup = op_lookup;
  ops.getattr = op_getattr;
  ops.open = op_open;
  ops.read = op_read;
  static char opt[] = "-o";
  static char opts[] = "allow_other,fsname=hang_fs,subtype=hang_fs";
  char* fargv[] = {argv[0], opt, opts, nullptr};
  struct fuse_args args = FUSE_ARGS_INIT(3, fargv);
  struct fuse_session* se = fuse_session_new(&args, &ops, sizeof ops, nullptr);
  if (!se) return 1;
  if (fuse_session_mount(se, argv[1]) != 0) return 1;
  printf("mounted\n");
  fflush(stdout);
  /* One thread is enough: no handler ever blocks, they just do not answer. */
  const int rc = fuse_session_loop(se);
  fuse_session_unmount(se);
  fuse_session_destroy(se);
  return rc ? 1 : 0;
}
