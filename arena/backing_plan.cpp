#include "arena/backing_plan.hpp"

#include <algorithm>

namespace salus::arena {

std::vector<ByteRange> merge_ranges(std::vector<ByteRange> ranges) {
  std::erase_if(ranges, [](const ByteRange& r) { return r.size == 0; });
  std::sort(ranges.begin(), ranges.end(),
            [](const ByteRange& a, const ByteRange& b) { return a.offset < b.offset; });
  std::vector<ByteRange> out;
  for (const ByteRange& r : ranges) {
    if (!out.empty() && r.offset <= out.back().offset + out.back().size) {
      const Bytes end = std::max(out.back().offset + out.back().size, r.offset + r.size);
      out.back().size = end - out.back().offset;
    } else {
      out.push_back(r);
    }
  }
  return out;
}

std::vector<ByteRange> merge_to_at_most(std::vector<ByteRange> ranges, std::size_t limit) {
  if (limit == 0 || ranges.size() <= limit) return ranges;
  std::vector<Bytes> gaps;
  for (std::size_t i = 1; i < ranges.size(); ++i)
    gaps.push_back(ranges[i].offset - (ranges[i - 1].offset + ranges[i - 1].size));
  // Bridging every gap up to the (n - limit)-th smallest leaves at most `limit`.
  const std::size_t k = ranges.size() - limit - 1;
  std::nth_element(gaps.begin(), gaps.begin() + static_cast<std::ptrdiff_t>(k), gaps.end());
  const Bytes bridge = gaps[k];
  std::vector<ByteRange> out;
  for (const ByteRange& r : ranges) {
    if (!out.empty() && r.offset - (out.back().offset + out.back().size) <= bridge)
      out.back().size = r.offset + r.size - out.back().offset;
    else
      out.push_back(r);
  }
  return out;
}

std::vector<ChunkRun> chunks_covering(const std::vector<ByteRange>& held, Bytes chunk) {
  std::vector<ChunkRun> out;
  if (chunk == 0) return out;
  for (const ByteRange& r : merge_ranges(held)) {
    const std::uint64_t first = r.offset / chunk;
    const std::uint64_t end = (r.offset + r.size + chunk - 1) / chunk;
    if (!out.empty() && first <= out.back().first + out.back().count)
      out.back().count = std::max(out.back().first + out.back().count, end) - out.back().first;
    else
      out.push_back({first, end - first});
  }
  return out;
}

namespace {

// Appends chunk i to the runs, extending the last one when i follows it.
void add_chunk(std::vector<ChunkRun>& runs, std::uint64_t i) {
  if (!runs.empty() && runs.back().first + runs.back().count == i)
    ++runs.back().count;
  else
    runs.push_back({i, 1});
}

}  // namespace

BackingChange backing_change(const std::vector<bool>& backed, const std::vector<ChunkRun>& wanted) {
  BackingChange out;
  auto is_backed = [&](std::uint64_t i) { return i < backed.size() && backed[i]; };
  std::uint64_t next = 0;  // chunks below it are decided
  auto unmap_until = [&](std::uint64_t end) {
    for (std::uint64_t i = next; i < end && i < backed.size(); ++i)
      if (backed[i]) add_chunk(out.unmap, i);
  };
  for (const ChunkRun& run : wanted) {
    unmap_until(run.first);
    for (std::uint64_t i = run.first; i < run.first + run.count; ++i)
      if (!is_backed(i)) add_chunk(out.map, i);
    next = run.first + run.count;
  }
  unmap_until(backed.size());
  return out;
}

bool covers(const std::vector<ByteRange>& outer, const std::vector<ByteRange>& inner) {
  auto o = outer.begin();
  for (const ByteRange& r : inner) {
    while (o != outer.end() && o->offset + o->size <= r.offset) ++o;
    if (o == outer.end() || o->offset > r.offset || o->offset + o->size < r.offset + r.size)
      return false;
  }
  return true;
}

std::vector<ByteRange> intersect_ranges(const std::vector<ByteRange>& a,
                                        const std::vector<ByteRange>& b) {
  std::vector<ByteRange> out;
  auto i = a.begin();
  auto j = b.begin();
  while (i != a.end() && j != b.end()) {
    const Bytes lo = std::max(i->offset, j->offset);
    const Bytes hi = std::min(i->offset + i->size, j->offset + j->size);
    if (lo < hi) out.push_back({lo, hi - lo});
    (i->offset + i->size < j->offset + j->size) ? ++i : ++j;
  }
  return out;
}

std::vector<ChunkRun> split_run(const ChunkRun& run, std::uint64_t most) {
  if (most == 0) most = 1;
  std::vector<ChunkRun> out;
  for (std::uint64_t done = 0; done < run.count; done += most)
    out.push_back({run.first + done, std::min(most, run.count - done)});
  return out;
}

}  // namespace salus::arena
