// Backing an arena on demand: which fixed-size chunks of a GPU's arena must hold
// physical memory so that every held range is backed, and what a device that
// backs chunk by chunk must map and unmap to get there.
//
// salusd's cuda arena is a virtual address range with physical memory mapped only
// under lanes and persistent buffers (docs/design.md, "The arena backed on
// demand"), so attached programs, whose memory is their own, can use the rest of
// the card. Pure: the broker computes the held ranges, the device applies a plan.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "arena/size_units.hpp"

namespace salus::arena {

struct ByteRange {
  Bytes offset = 0;
  Bytes size = 0;
  bool operator==(const ByteRange&) const = default;
};

// Chunks [first, first + count) of one chunk size.
struct ChunkRun {
  std::uint64_t first = 0;
  std::uint64_t count = 0;
  bool operator==(const ChunkRun&) const = default;
};

// Sorts `ranges`, drops empty ones and merges those that overlap or touch. What the
// broker hands the device: usually a handful of ranges however many buffers there are.
std::vector<ByteRange> merge_ranges(std::vector<ByteRange> ranges);

// Merges `ranges` (sorted, disjoint: from merge_ranges) across their smallest gaps
// until at most `limit` (>= 1) remain: the result covers every byte of them, and
// the gaps it bridges are the smallest there are. For a list that must fit one
// message to a device that backs them.
std::vector<ByteRange> merge_to_at_most(std::vector<ByteRange> ranges, std::size_t limit);

// Range algebra on sorted, disjoint, merged lists (from merge_ranges): whether
// every range of `inner` lies inside one of `outer`, and the bytes in both
// (merged too). The broker's readiness check while a backing job runs.
bool covers(const std::vector<ByteRange>& outer, const std::vector<ByteRange>& inner);
std::vector<ByteRange> intersect_ranges(const std::vector<ByteRange>& a,
                                        const std::vector<ByteRange>& b);

// The chunks that cover `held` (any order, may overlap), as sorted, disjoint,
// non-adjacent runs. A chunk that any held byte falls in is wanted whole.
std::vector<ChunkRun> chunks_covering(const std::vector<ByteRange>& held, Bytes chunk);

struct BackingChange {
  std::vector<ChunkRun> map;    // wanted, not backed yet
  std::vector<ChunkRun> unmap;  // backed, no longer wanted
};

// What turns `backed` (one flag per chunk) into exactly `wanted`. Chunks past the
// end of `backed` count as unbacked; a wanted run past it is the caller's error.
BackingChange backing_change(const std::vector<bool>& backed, const std::vector<ChunkRun>& wanted);

// `run` cut into consecutive pieces of at most `most` (>= 1) chunks, so that a
// device can hold a lock for one piece at a time while it maps a long run.
std::vector<ChunkRun> split_run(const ChunkRun& run, std::uint64_t most);

}  // namespace salus::arena
