#!/usr/bin/env python3
"""Lists the C++ functions longer than a limit (docs/style.md: "Functions stay
under about 100 lines"), so that a new one is caught by a test, not by a
reviewer months later.

    tools/long-functions.py [--max N] [--allowlist FILE] [--all] [PATHS...]

A function's length is counted like universal-ctags does: from the line of its
name to the line of its closing brace. Lambdas, and functions defined inside a
function body, count towards the function around them. Only named function
definitions at namespace or class scope are reported; the parser is a brace
matcher that skips comments, strings, character and raw-string literals, which
is enough for this tree (it is not a C++ parser: a macro that hides braces can
fool it).

With --allowlist, a function on the list may be long: each entry is
`path::name  reason` (the reason is required). The exit status is 1 when a
function over the limit is not on the list, or when an entry names a function
that is no longer over it (so the list only shrinks). Without --allowlist it
lists every function over the limit and exits 0.
"""

import argparse
import os
import re
import sys

SOURCE_DIRS = ["arena", "sched", "vgpu", "fusefs", "tools", "client", "k8s", "slurm", "fuzz"]
EXTENSIONS = (".cpp", ".hpp", ".h", ".cc", ".cu", ".c")
# What may stand between a parameter list's ')' and the body's '{'.
BODY_QUALIFIERS = {"const", "override", "final", "noexcept", "mutable", "try", "volatile"}


def strip(text):
    """Blanks comments and literals, keeping every newline, so that line
    numbers and braces can be read off the result."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "R" and text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^()\\ ]{0,16})\(', text[i:])
            if not m:
                out.append(c)
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i + m.end())
            end = n if end < 0 else end + len(m.group(1)) + 2
            out.append('""' + re.sub(r"[^\n]", " ", text[i + 2:end]))
            i = end
        elif c in "\"'":
            # A ' between digits is a C++14 digit separator, not a literal.
            if c == "'" and i > 0 and text[i - 1].isalnum() and i + 1 < n and text[i + 1].isalnum():
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(c + " " * (min(j, n) - i - 1) + c)
            i = j + 1
        elif c == "#" and (i == 0 or text[text.rfind("\n", 0, i) + 1:i].strip() == ""):
            # A preprocessor line (with its continuations) holds no braces we count.
            j = i
            while True:
                k = text.find("\n", j)
                if k < 0:
                    k = n
                    break
                if text[k - 1] != "\\":
                    break
                j = k + 1
            out.append(re.sub(r"[^\n]", " ", text[i:k]))
            i = k
        else:
            out.append(c)
            i += 1
    return "".join(out)


def function_name(header):
    """The qualified name in a function header, or None if it is not one."""
    h = " ".join(header.split())
    if not h or "(" not in h:
        return None
    first = h.split()[0]
    if first in ("class", "struct", "union", "enum", "namespace", "extern", "typedef", "using"):
        return None
    # The name stands before the first '(' that is not inside template brackets.
    depth = 0
    for k, ch in enumerate(h):
        if ch == "<":
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif ch == "(" and depth == 0:
            before = h[:k].rstrip()
            if "=" in before.replace("operator=", "").replace("==", "").replace("<=", "").replace(">=", "").replace("!=", ""):
                return None  # an initializer, e.g. `auto x = [] {...}();`
            m = re.search(r"((?:[A-Za-z_~][\w]*(?:<[^()]*>)?::)*(?:operator\s*\S+|~?[A-Za-z_]\w*))$", before)
            if not m:
                return None
            name = m.group(1)
            if name in ("if", "for", "while", "switch", "return", "catch", "sizeof", "decltype"):
                return None
            return name
    return None


def body_starts(header):
    """Whether a '{' after `header` opens a function body (rather than a brace
    initializer in a constructor's member-initializer list, say)."""
    h = header.rstrip()
    if h.endswith(")"):
        return True
    words = re.findall(r"[\w]+|->|\S", h)
    if not words:
        return False
    if words[-1] in BODY_QUALIFIERS:
        return True
    # A trailing return type: `auto f() -> T {`.
    last_paren = h.rfind(")")
    return last_paren >= 0 and "->" in h[last_paren:] and ":" not in h[last_paren:].replace("::", "")


def functions(path):
    """(name, first line, last line) of every function defined in `path`."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = strip(f.read())
    found = []
    header_start = 0  # where the statement being read began
    stack = []  # 'scope' (namespace, class, extern) or 'other' braces outside functions
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in ";":
            header_start = i + 1
        elif c == "}":
            if stack:
                kind = stack.pop()
                if kind == "scope":
                    header_start = i + 1
            else:
                header_start = i + 1
        elif c == "{":
            header = text[header_start:i]
            name = function_name(header) if body_starts(header) else None
            if name:
                # The body: skip to its matching brace.
                depth, j = 1, i + 1
                while j < n and depth:
                    if text[j] == "{":
                        depth += 1
                    elif text[j] == "}":
                        depth -= 1
                    j += 1
                name_at = header_start + header.find(name.split("::")[0]) if name else header_start
                first = text.count("\n", 0, max(name_at, header_start)) + 1
                last = text.count("\n", 0, j - 1) + 1
                found.append((name, first, last))
                i = j
                header_start = j
                continue
            h = " ".join(header.split())
            if re.match(r"^(template\s*<.*>\s*)?(class|struct|union|namespace|extern|enum)\b", h) or h == "":
                stack.append("scope")
                header_start = i + 1
            else:
                stack.append("other")
        i += 1
    return found


def sources(paths):
    for p in paths:
        if os.path.isfile(p):
            yield p
            continue
        for root, dirs, files in os.walk(p):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "build")
            for f in sorted(files):
                if f.endswith(EXTENSIONS):
                    yield os.path.join(root, f)


def read_allowlist(path):
    entries = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split(None, 1)
            if len(parts) < 2 or "::" not in parts[0]:
                sys.exit(f"{path}:{number}: expected 'path::function  reason', got: {line}")
            entries[parts[0]] = parts[1]
    return entries


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max", type=int, default=100, help="longest allowed function, in lines")
    ap.add_argument("--allowlist", help="file of 'path::function  reason' lines")
    ap.add_argument("--root", default=".", help="the source tree (default: .)")
    ap.add_argument("--all", action="store_true", help="print every function with its length")
    ap.add_argument("paths", nargs="*", help=f"files or folders (default: {' '.join(SOURCE_DIRS)})")
    args = ap.parse_args()
    os.chdir(args.root)
    paths = args.paths or [d for d in SOURCE_DIRS if os.path.isdir(d)]
    long = []
    for path in sources(paths):
        for name, first, last in functions(path):
            length = last - first + 1
            if args.all:
                print(f"{length:5d} {path}:{first} {name}")
            if length > args.max:
                long.append((length, path, first, name))
    long.sort(reverse=True)
    allowed = read_allowlist(args.allowlist) if args.allowlist else None
    bad = 0
    for length, path, first, name in long:
        key = f"{path}::{name}"
        if allowed is not None and key in allowed:
            print(f"{length:5d} {path}:{first} {name} (allowed: {allowed[key]})")
            continue
        print(f"{length:5d} {path}:{first} {name}")
        bad += 1
    if allowed is None:
        return 0
    still = {f"{p}::{nm}" for _, p, _, nm in long}
    stale = [k for k in allowed if k not in still]
    for k in stale:
        print(f"{args.allowlist}: {k} is no longer over {args.max} lines; remove it from the list")
    if bad:
        print(f"{bad} function(s) over {args.max} lines: split them along their seams "
              f"(docs/style.md), or add 'path::function  reason' to {args.allowlist}")
    return 1 if bad or stale else 0


if __name__ == "__main__":
    sys.exit(main())
