#!/bin/sh
# Lists the tracked C/C++ files that clang-format (the repo's .clang-format)
# would change, so that formatting drift is seen before review (docs/style.md).
#
#   tools/check-format.sh          list them and their count; exit 1 if any
#   tools/check-format.sh --count  print only the count; exit 0
#
# Format only the files you change (clang-format -i FILE): other branches edit
# the rest. Needs clang-format and git; without them it says so and exits 77
# (meson's "skipped").
set -u
cd "$(dirname "$0")/.." || exit 2
count_only=0
[ "${1:-}" = "--count" ] && count_only=1
CF=${CLANG_FORMAT:-clang-format}
if ! command -v "$CF" >/dev/null 2>&1; then
  echo "check-format: $CF not found (apt-get install clang-format)" >&2
  exit 77
fi
if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "check-format: not a git checkout; nothing to list" >&2
  exit 77
fi
off=0
list=$(git ls-files '*.cpp' '*.hpp' '*.h' '*.cc' '*.c' '*.cu')
for f in $list; do
  [ -f "$f" ] || continue
  if ! "$CF" --dry-run -Werror "$f" >/dev/null 2>&1; then
    off=$((off + 1))
    [ "$count_only" -eq 1 ] || echo "$f"
  fi
done
if [ "$count_only" -eq 1 ]; then
  echo "$off"
  exit 0
fi
if [ "$off" -gt 0 ]; then
  echo "check-format: $off file(s) off .clang-format (clang-format -i FILE)" >&2
  exit 1
fi
exit 0
