# Post-processes pandoc's man output so that tables fit an 80-column terminal
# without groff warnings (run by docs/meson.build on every page).
#
# pandoc gives every table column widths that add up to 70n, whatever the
# number of columns; with tbl's 3n between columns and the 7n section indent,
# tables of two or more columns were wider than the line. Each column keeps
# its share (set by the dashes of the Markdown separator row: `|-----|--|`),
# scaled so that columns plus gaps take `target` (70) ens. Table cells are
# set ragged-right (`.ad l`): a justified narrow cell holding a long word
# cannot be adjusted, which groff warns about. A table inside a list item
# (`.RS N`) loses that indent and the item's own (3n) from its width.
/^\.RS( |$)/ { depth++; rs[depth] = ($2 == "" ? 7 : $2) + 3; indent += rs[depth] }
/^\.RE( |$)/ { if (depth > 0) { indent -= rs[depth]; depth-- } }
/^(lw\([0-9.]+n\) ?)+\.$/ {
  n = split($0, parts, " ")
  total = 0
  for (i = 1; i <= n; i++) {
    w[i] = parts[i]
    gsub(/[^0-9.]/, "", w[i])
    total += w[i]
  }
  avail = target - indent - 3 * (n - 1)
  out = ""
  for (i = 1; i <= n; i++) out = out sprintf("%slw(%.1fn)", (i > 1 ? " " : ""), w[i] * avail / total)
  print out "."
  next
}
/^\.TS$/ { print ".ad l"; table = 1 }
/^\.TE$/ { table = 0 }
# A name longer than its column (salus_gpu_memory_controller_utilization_ratio)
# may break after an underscore (groff's zero-width break point) rather than
# overflow the table.
table && /^\\f\[V\][a-z0-9_]+\\f\[R\]$/ { gsub(/_/, "_\\:") }
{ print }
/^\.TE$/ { print ".ad b" }
