// Size parsing and formatting shared by commands, flags and traces.
#include "arena/size_units.hpp"

#include <gtest/gtest.h>

using namespace salus::arena;

TEST(SizeUnits, ParsesUnitsAndFractions) {
  EXPECT_EQ(parse_size("4096"), 4096u);
  EXPECT_EQ(parse_size("64K"), 64u << 10);
  EXPECT_EQ(parse_size("64M"), 64u << 20);
  EXPECT_EQ(parse_size("64MiB"), 64u << 20);
  EXPECT_EQ(parse_size("1.5G"), 3ull << 29);
  EXPECT_EQ(parse_size("2T"), 2ull << 40);
  EXPECT_EQ(parse_size("512B"), 512u);
}

TEST(SizeUnits, TellsMalformedFromOutOfRange) {
  Bytes v = 0;
  EXPECT_EQ(parse_size("abc", v), SizeParse::malformed);
  EXPECT_EQ(parse_size("-5M", v), SizeParse::malformed);
  EXPECT_EQ(parse_size("12Q", v), SizeParse::malformed);
  EXPECT_EQ(parse_size("0.3", v), SizeParse::malformed);  // not a whole byte
  EXPECT_EQ(parse_size("", v), SizeParse::malformed);
  EXPECT_EQ(parse_size("20000000T", v), SizeParse::out_of_range);
  EXPECT_EQ(parse_size("99999999999999999999", v), SizeParse::out_of_range);
  EXPECT_EQ(parse_size("8388608T", v), SizeParse::ok);  // exactly 2^63
  EXPECT_EQ(v, 1ull << 63);
}

TEST(SizeUnits, FormatsReadably) {
  EXPECT_EQ(format_size(512), "512");
  EXPECT_EQ(format_size(64u << 20), "64.0M");
  EXPECT_EQ(format_size(3ull << 29), "1.5G");
}
