#include "fusefs/readme.hpp"

namespace salus::fusefs {

const std::string& readme_text() {
  static const std::string text = R"(Salus: GPU sharing at iteration granularity.

Quick start (a session lives as long as this shell's fd 3):
  exec 3<>/salus/clone; read -r id <&3        # new session; its files are in sessions/$id/
  echo 'need persistent=64M ephemeral=256M' >&3
  echo 'alloc w 64M' >&3
  printf 'begin\nalloc tmp 128M\nfill tmp 1.0\nspin 1000\nend x100\n' >&3
  cat /salus/sessions/$id/wait                # blocks until done: "done 100"
  cat /salus/sessions/$id/status /salus/sessions/$id/log
  exec 3>&-                                   # ends the session, frees everything

Named sessions: mkdir /salus/sessions/NAME ... rmdir /salus/sessions/NAME
Commands go to sessions/ID/ctl (or the clone fd), one per line:
  need persistent=SIZE ephemeral=SIZE [iters=N] [priority=N] [gpu=N|any] [name=S]
  alloc NAME SIZE | free NAME | begin ... end [xN] | run N | sync | priority N | reset
  fill BUF VALUE [dtype=f32|i32|u8] [off=] [len=] | copy DST[+OFF] SRC[+OFF] LEN
  spin USEC [util=F] | gemm M N K A B C
A failed command fails write(); the reason is in sessions/ID/log.
State: gpus/N/{info,memory,lanes,queue}, stats, metrics, policy. Admin: ctl, policy.
See salus(5) for every file and error.
)";
  return text;
}

}  // namespace salus::fusefs
